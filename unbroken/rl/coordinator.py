"""The coordinator of one RL run over a Pool: it queues each step's prompt groups, hands them to idle
rollout workers with the newest weights (the weight broadcast after every update), starts a training
step once all of its groups are in (its samples split over the training pool, a new training
generation whenever the pool changed), and in "dynamic" mode asks the Controller after each step
whether to move a process. A lost rollout worker's in-flight group goes back to the queue; a lost
trainer's step is redone by the survivors. It is the single decision point: every move, requeue
and redo is an event written before it acts."""
from __future__ import annotations

import time
from collections import deque
from multiprocessing.connection import wait

from unbroken.events import EventLog
from unbroken.rl import grpo, task
from unbroken.rl.config import RLConfig
from unbroken.rl.controller import Controller, Observation
from unbroken.rl.errors import RLInputError
from unbroken.rl.metrics import Timeline
from unbroken.rl.pool import Pool

PROGRESS_TIMEOUT_S = 120.0
TICK_S = 1.0
WINDOW_STEPS = 3


class RunError(RuntimeError):
    """The run cannot go on (no trainer holding the state is left, a worker stopped answering)."""


class Coordinator:
    def __init__(self, pool: Pool, cfg: RLConfig, method: str, rollout: int, events: EventLog,
                 kill_rollout_at: int | None = None, kill_trainer_at: int | None = None, controller=None,
                 progress=None) -> None:
        self.pool, self.cfg, self.method, self.events = pool, cfg, method, events
        self.alive = set(range(pool.size))
        self.busy: dict[int, tuple | None] = {w: None for w in self.alive}
        self.version, self.gen, self.members = 0, 0, ()
        self.wversion = {w: 0 for w in self.alive}
        self.queue: deque[tuple[int, task.Prompt]] = deque()
        self.admitted = -1  # the last step whose prompts are queued
        self.ready: dict[int, list[list[grpo.Sample]]] = {}
        self.training: dict[int, tuple | None] | None = None  # member -> reply, while a step trains
        self.moving: set[int] = set()  # rollout workers that join the trainers when idle
        self.controller = (controller or Controller()) if method == "dynamic" else None
        self.progress = progress  # called with each step's record
        self.kill_rollout_at, self.kill_trainer_at = kill_rollout_at, kill_trainer_at  # fault injection
        self.tl, self.curve, self.moves, self.requeues, self.redos = Timeline(), [], [], [], []
        self.lengths: list[int] = []
        self.latest: bytes | None = None
        self.t0 = time.perf_counter()
        for w in sorted(self.alive):
            role = "both" if method == "colocated" else ("rollout" if w < rollout else "train")
            self.tl.set_role(w, 0.0, role)

    def now(self) -> float:
        return time.perf_counter() - self.t0

    # -- the loop -------------------------------------------------------------------------------
    def run(self) -> None:
        last = time.monotonic()
        while self.version < self.cfg.steps:
            self._admit()
            self._refill_rollout()
            self._dispatch_rollouts()
            self._maybe_train()
            if self._handle(wait_s=TICK_S):
                last = time.monotonic()
            elif time.monotonic() - last > PROGRESS_TIMEOUT_S:
                waiting = {w: (t[0] if t else None) for w, t in self.busy.items() if w in self.alive}
                raise RunError(f"no RL worker answered for {PROGRESS_TIMEOUT_S:.0f} s at step {self.version}; "
                               f"waiting on {waiting}")

    def _admit(self) -> None:
        """Queue the prompts of every step the current weights may sample for (step <= version + staleness)."""
        stale = 0 if self.method == "colocated" else self.cfg.staleness
        while self.admitted < min(self.version + stale, self.cfg.steps - 1):
            self.admitted += 1
            for p in task.step_prompts(self.cfg.seed, self.admitted, self.cfg.prompts, self.cfg.digits,
                                       self.cfg.lengths, self.cfg.max_repeat):
                self.queue.append((self.admitted, p))

    def _rollout_workers(self) -> list[int]:
        return sorted(w for w in self.alive if self.tl.role(w) in ("rollout", "both") and w not in self.moving)

    def _trainers(self) -> list[int]:
        return sorted(w for w in self.alive if self.tl.role(w) in ("train", "both"))

    def _dispatch_rollouts(self) -> None:
        if self.training is not None and self.method == "colocated":
            return
        for w in self._rollout_workers():
            if not self.queue:
                return
            if self.busy[w] is None:
                step, prompt = self.queue.popleft()
                weights = self.latest if self.wversion[w] < self.version else None
                die = self.kill_rollout_at is not None and step >= self.kill_rollout_at
                if die:  # the worker SIGKILLs itself once it holds the prompts: in flight for sure
                    self.kill_rollout_at = None
                self._send(w, ("rollout", step, prompt, self.version, weights, die))
                self.wversion[w] = self.version
                self.busy[w] = ("rollout", step, prompt, self.now())

    def _send(self, w: int, msg: tuple) -> None:
        try:
            self.pool.conns[w].send(msg)
        except (BrokenPipeError, OSError):
            pass  # a dead worker: its sentinel reports it in _handle

    # -- training ---------------------------------------------------------------------------------
    def _maybe_train(self) -> None:
        step = self.version
        if self.training is not None or len(self.ready.get(step, [])) < self.cfg.prompts:
            return
        for w in sorted(self.moving):  # moving rollout workers join once their group is in
            if self.busy[w] is None:
                self.moving.discard(w)
                self.tl.set_role(w, self.now(), "train")
        trainers = self._trainers()
        if any(self.busy[w] is not None for w in trainers):
            return  # colocated: every process finishes generating first
        if not trainers:
            raise RunError("the training pool is empty and no process holds the optimizer state: the run stops")
        members = tuple([m for m in self.members if m in trainers] + [w for w in trainers if w not in self.members])
        if members != self.members:
            self.gen, self.members = self.gen + 1, members
        samples = [s for g in self.ready[step] for s in g]
        shares = _split(samples, len(members))
        norm = float(grpo.tokens(samples))
        self.training = {w: None for w in members}
        victim = None  # fault injection: the last rank SIGKILLs itself mid-step, before the all-reduce
        if self.kill_trainer_at is not None and step >= self.kill_trainer_at and len(members) > 1:
            self.kill_trainer_at, victim = None, members[-1]
        for rank, w in enumerate(members):
            # disaggregated: every rank returns its weights, so any rank that completes the step can
            # feed the rollout pool; colocated: the processes sample with their own weights (rank 0's kept)
            self._send(w, ("train", step, self.gen, rank, len(members), shares[rank], norm,
                           self.method != "colocated" or rank == 0, w == victim))
            self.busy[w] = ("train", step, None, self.now())

    def _on_train_reply(self, w: int, reply: tuple) -> None:
        self._end_busy(w)
        self.training[w] = reply
        if all(r is not None for m, r in self.training.items() if m in self.alive):
            self._resolve_step()

    def _resolve_step(self) -> None:
        step, replies = self.version, {m: r for m, r in self.training.items() if m in self.alive and r}
        done = [m for m, r in replies.items() if r[0] == "trained"]
        self.training = None
        if not done:  # nobody applied the update: the survivors redo it in a new generation
            self.events.emit("rl_redo", step=step, proc=[m for m in self.members if m not in self.alive],
                             why="a training rank was lost before the update", rollout=len(self._rollout_workers()),
                             train=len(self._trainers()))
            self.redos.append(step)
            self.gen += 1  # never reuse a failed generation's store prefix, even with the same members
            return  # a dead member leaves self.members at the next dispatch
        if self.members[0] not in done:  # a rank that completed the step holds the update: it leads
            self.members = tuple(done + [m for m in self.members if m not in done])
        if len(done) < len(replies):
            self.gen += 1  # ranks whose collective failed rejoin in a new generation and get rank 0's state
        self.latest = next((replies[m][4] for m in done if replies[m][4] is not None), self.latest)
        self.version += 1
        for m in done:
            self.wversion[m] = self.version
        self._record_step(step)
        if self.controller is not None:
            self._decide(step)

    def _record_step(self, step: int) -> None:
        samples = [s for g in self.ready.pop(step) for s in g]
        self.lengths += [len(s.tokens) for s in samples]
        rec = {"step": step, "t": self.now(), "reward": sum(s.reward for s in samples) / len(samples),
               "tokens": grpo.tokens(samples), "max_staleness": max(step - s.version for s in samples),
               "rollout": len(self._rollout_workers()), "train": len(self._trainers()), "gen": self.gen}
        self.curve.append(rec)
        if self.progress:
            self.progress(rec)
        self.events.emit("rl_step", step=step, reward=rec["reward"], samples=len(samples), tokens=rec["tokens"],
                         rollout=rec["rollout"], train=rec["train"], train_gen=self.gen,
                         max_staleness=rec["max_staleness"], wall_s=rec["t"])

    def _decide(self, step: int) -> None:
        t1 = self.now()
        since = [c for c in self.curve if not self.moves or c["step"] > self.moves[-1]["step"]]
        window = since[-WINDOW_STEPS - 1:]
        if len(window) < 2:
            return  # no whole step since the last move yet
        t0, steps = window[0]["t"], len(window) - 1
        (_, r_busy), (_, t_busy) = self.tl.pool_seconds("rollout", t0, t1), self.tl.pool_seconds("train", t0, t1)
        obs = Observation(step, len(self._rollout_workers()), len(self._trainers()), r_busy / steps, t_busy / steps,
                          self.tl.idle_fraction("rollout", t0, t1) or 0.0,
                          self.tl.idle_fraction("train", t0, t1) or 0.0,
                          sum(len(g) for s, g in self.ready.items() if s > step))
        move = self.controller.decide(obs)
        if move is None:
            return
        if move.to_pool == "rollout":
            w = self.members[-1]  # it holds the newest weights: no transfer needed
            self.tl.set_role(w, t1, "rollout")  # the next dispatch forms a generation without it
        else:
            idle = [w for w in self._rollout_workers() if self.busy[w] is None]
            w = (idle or self._rollout_workers())[-1]
            self.moving.add(w)  # joins the next training generation once its group is in
        self.moves.append({"t": t1, "step": step, "proc": w, "to": move.to_pool, "reason": move.reason})
        self.events.emit("rl_move", proc=w, from_pool="train" if move.to_pool == "rollout" else "rollout",
                         to_pool=move.to_pool, step=step, reason=move.reason,
                         rollout=len(self._rollout_workers()), train=len(self._trainers()) + len(self.moving),
                         train_gen=self.gen)

    # -- messages and failures ----------------------------------------------------------------------
    def _handle(self, wait_s: float) -> bool:
        conns = {self.pool.conns[w]: w for w in self.alive}
        sentinels = {self.pool.procs[w].sentinel: w for w in self.alive}
        got = False
        for obj in wait(list(conns) + list(sentinels), timeout=wait_s):
            w = conns.get(obj, sentinels.get(obj))
            if w not in self.alive:
                continue
            try:
                reply = obj.recv() if obj in conns else None
            except (EOFError, OSError):
                reply = None
            if reply is None:
                if not self.pool.alive(w) or obj in conns:
                    self._on_death(w)
                continue
            got = True
            self._on_reply(w, reply)
        return got

    def _on_reply(self, w: int, reply: tuple) -> None:
        kind = reply[0]
        if kind == "input_error":
            raise RLInputError(reply[1])
        if kind == "rollout_done":
            _, step, _, _ = self.busy[w]
            self._end_busy(w)
            self.ready.setdefault(step, []).append(reply[1])
        elif kind in ("trained", "group_failed") and self.training is not None and w in self.training:
            self._on_train_reply(w, reply)
        else:
            raise RunError(f"RL worker {w} sent an unexpected {kind!r}: {reply[1:] if len(reply) > 1 else ''}")

    def _end_busy(self, w: int) -> None:
        if self.busy[w] is not None:
            self.tl.add_busy(w, self.busy[w][3], self.now())
            self.busy[w] = None

    def _on_death(self, w: int) -> None:
        self.alive.discard(w)
        self.moving.discard(w)
        task_ = self.busy[w]
        self.busy[w] = None
        self.tl.set_role(w, self.now(), "gone")
        if task_ is not None and task_[0] == "rollout":
            self.events.emit("rl_requeue", proc=w, step=task_[1], prompts=[task_[2].text], why="worker lost",
                             rollout=len(self._rollout_workers()), train=len(self._trainers()))
            self.requeues.append({"t": self.now(), "proc": w, "step": task_[1]})
            self.queue.appendleft((task_[1], task_[2]))
        if self.training is not None and w in self.training and \
                all(r is not None for m, r in self.training.items() if m in self.alive):
            self._resolve_step()

    def _refill_rollout(self) -> None:
        """The rollout pool died out: between steps, a trainer takes its place."""
        if self.method == "colocated" or self.training is not None or self._rollout_workers() \
                or len(self._trainers()) < 2:
            return
        t = self._trainers()[-1]
        self.events.emit("rl_move", proc=t, from_pool="train", to_pool="rollout", step=self.version,
                         reason="the rollout pool lost its last worker", rollout=1,
                         train=len(self._trainers()) - 1, train_gen=self.gen)
        self.tl.set_role(t, self.now(), "rollout")


def _split(samples: list[grpo.Sample], n: int) -> list[list[grpo.Sample]]:
    """Longest first to the least-loaded share (by tokens): the trainers finish together."""
    shares: list[list[grpo.Sample]] = [[] for _ in range(n)]
    load = [0] * n
    for s in sorted(samples, key=lambda s: -len(s.tokens)):
        i = load.index(min(load))
        shares[i].append(s)
        load[i] += len(s.tokens)
    return shares

"""An RL worker process: it holds the policy and, while it is a trainer, the optimizer and its
training-group generation; it executes the coordinator's commands one at a time (a group of
rollouts, or its share of a training step; as training rank 0 it sends its new weights right
after the step's reply, so that the next step need not wait for their serialization) and exits
when told to, or when the coordinator has been silent for IDLE_EXIT_S (an orphan never lingers)."""
from __future__ import annotations

import copy
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from unbroken.rl import grpo, policy, task
from unbroken.rl.config import RLConfig
from unbroken.rl.errors import RLInputError
from unbroken.rl.traingroup import GroupError, TrainGroup, help_key, share_gradient

IDLE_EXIT_S = 300.0


def _die_if(die: bool) -> None:
    """Fault injection the coordinator asked for: a real SIGKILL of this process, here."""
    if die:
        os.kill(os.getpid(), signal.SIGKILL)


class Worker:
    def __init__(self, wid: int, store: dist.Store) -> None:
        self.wid, self.store = wid, store
        self.cfg: RLConfig | None = None
        self.group: TrainGroup | None = None
        self.groups: list[TrainGroup] = []  # old generations stay referenced: never destroy a group
        self.weights_after: int | None = None  # as training rank 0: the step whose weights follow the reply

    def reset(self, run: str, cfg: dict, init_state: bytes, reward: str | None) -> tuple:
        self.run, self.cfg = run, RLConfig.from_dict(cfg)
        self.model = policy.new_policy(self.cfg)
        self.model.load_state_dict(policy.load_state(init_state))
        self.ref = copy.deepcopy(self.model).eval() if self.cfg.kl > 0 else None
        self.opt = grpo.new_optimizer(self.model, self.cfg)
        self.reward = task.load_reward(reward)
        self.group = None
        return ("ok",)

    def rollout(self, step: int, prompt: task.Prompt, version: int, weights: bytes | None, die: bool) -> tuple:
        if weights is not None:
            self.model.load_state_dict(policy.load_state(weights))
        _die_if(die)  # fault injection (--kill-rollout-at): the group in flight
        t0 = time.perf_counter()
        samples = grpo.rollout_group(self.model, self.cfg, prompt, step, version, self.reward)
        return ("rollout_done", samples, time.perf_counter() - t0)

    def help(self, step: int, gen: int, k: int, weights: bytes | None, samples: list, normalizer: float,
             die: bool) -> tuple:
        """A rollout worker's training share: its gradient goes to the store for rank 0 to add."""
        t0 = time.perf_counter()
        if weights is not None:
            self.model.load_state_dict(policy.load_state(weights))
        _die_if(die)  # fault injection (run(kill_helper_at=...)): the share in hand
        g = share_gradient(self.model, samples, self.cfg, normalizer, self.ref)
        self.store.set(help_key(self.run, gen, step, k), g.numpy().tobytes())
        return ("helped", step, time.perf_counter() - t0)

    def state(self) -> tuple:
        """This process's weights (asked for when training rank 0 was lost after an update)."""
        return ("state", policy.state_bytes(self.model.state_dict()))

    def train(self, step: int, gen: int, rank: int, world: int, samples: list, normalizer: float,
              send_state: bool, die: bool, helped: list | tuple = (), joiners: tuple = ()) -> tuple:
        """This rank's share of `step`; in a new generation `gen`, first the state to the `joiners`."""
        t0 = time.perf_counter()
        if self.group is None or self.group.gen != gen:
            self.group = TrainGroup(self.store, self.run, gen, rank, world)
            self.groups.append(self.group)
            self.group.sync_state(self.model, self.opt, tuple(joiners))
        _die_if(die)  # fault injection: mid-step, before this rank joins the all-reduce
        keyed = [(help_key(self.run, gen, step, k), share) for k, share in helped]
        loss = self.group.update(self.model, self.opt, samples, self.cfg, normalizer, self.ref, keyed, self.store)
        if send_state:  # serialized after the reply: the next step need not wait for it
            self.weights_after = step
        return ("trained", step, loss, time.perf_counter() - t0)


def main(conn, wid: int, host: str, port: int) -> None:
    """The process entry point (multiprocessing spawn)."""
    torch.set_num_threads(1)
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=60))
    w = Worker(wid, store)
    handlers = {"reset": w.reset, "rollout": w.rollout, "train": w.train, "help": w.help, "state": w.state}
    while True:
        try:
            if not conn.poll(IDLE_EXIT_S):
                break
            op, *args = conn.recv()
        except (EOFError, OSError):
            break
        if op == "stop":
            break
        try:
            reply = handlers[op](*args)
        except RLInputError as e:
            reply = ("input_error", str(e))
        except GroupError as e:
            w.group = None  # this generation is broken: the next command names a new one
            reply = ("group_failed", str(e))
        try:
            conn.send(reply)
            if w.weights_after is not None:
                conn.send(("weights", w.weights_after, *w.state()[1:]))
                w.weights_after = None
        except (BrokenPipeError, OSError):
            break
    conn.close()
    os._exit(0)  # skip teardown: gloo's native threads may abort in their destructors

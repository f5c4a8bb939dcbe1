"""The per-node supervisor: owns every process it starts, detects faults, drives generations.

Node 0's supervisor hosts the TCPStore and is the leader: it publishes each generation (who is
rank r), assigns shadows to failed ranks, and decides when the run is over. On the replicated
store (--store etcd://...) the leader role moves to a survivor (runtime/failover.py). Every
supervisor watches its own children (exit codes, heartbeats), SIGKILLs a hung one so a hang
becomes a crash, reports faults to the leader through the store, and keeps its shadow pool full.
"""
from __future__ import annotations

import _thread
import json
import os
import signal
import threading
import time

from unbroken.config import RunConfig
from unbroken.events import EventLog
from unbroken.runtime import (admission, failover, faults, handover, lease, membership, node_heartbeats,
                              store_reads, stranded)
from unbroken.runtime.crash import CrashJudge
from unbroken.runtime.fence import FENCE_FRACTION, LeaseFence
from unbroken.runtime.budget import RecoveryRateExceeded, RecoveryRateLimit
from unbroken.runtime.pool import ShadowPoolSizer
from unbroken.runtime.procs import Child, ProcessTable, fork_server
from unbroken.runtime.standby import list_standbys, pick_standby, slot_of_shadow
from unbroken.runtime.options import LaunchError, LaunchOptions, trust_warning  # noqa: F401 (re-exported)
from unbroken.runtime.tee import Tee, stream_writer
from unbroken.runtime.wake import ChildWake
from unbroken.runtime.watch import Watch

_FAULT_TICK_S = 0.05  # how often the leader reads the fault log when nothing exited here
_LINK_GRACE_S = 0.3  # a crashed member's exit shows within ~0.1 s; errors outliving this mean a link
_LINK_REGROUPS = 2  # per incident: a second link may break during the first regroup's recovery
_KILL_ON = ("hang", "stall", "straggler", "health")  # faults whose process is still alive: kill it first
_QUIET_BEATS = 3  # a node that has not renewed its lease for this many heartbeats holds hang detection
_FENCE_EXIT_S = 2.0  # a fenced supervisor whose loop does not wake within this exits from the fence thread
_HANDOVER_S = 30.0  # at the end: the longest wait for a follower's events, or for the leader's summary


class Supervisor:
    def __init__(self, cfg: RunConfig, opts: LaunchOptions, *, on_progress=None, on_output=None,
                 on_finish=None) -> None:
        """`on_finish(done)`: the leader's summary, once every node's events are here (`done`: each rank's hash)."""
        if cfg.world_size % opts.nnodes:
            raise ValueError(f"world_size ({cfg.world_size}) must be divisible by nnodes ({opts.nnodes})")
        self.cfg, self.opts = cfg, opts
        self.leader = opts.node_rank == 0
        self.node = opts.node_rank
        self.local = cfg.world_size // opts.nnodes
        self.on_progress = on_progress or (lambda info: None)
        self.on_finish = on_finish or (lambda done: None)
        self.run_dir = opts.run_dir
        self.events = EventLog(self.run_dir / "events.jsonl", source="supervisor", node=self.node)
        warn = lambda message: self.events.emit("warning", message=message)  # noqa: E731
        forks = fork_server({"UNBROKEN_RUN_DIR": str(self.run_dir)}, warn)  # ready before we join
        store, self.port, self._listener = admission.open_store(opts)
        self.store = store_reads.TickReads(store)  # on etcd, one request for a tick's reads
        if warning := trust_warning(opts):
            warn(warning)
        self._agree_on_config()
        cfg = self.cfg
        self.beats = node_heartbeats.host(cfg.collective_timeout_s)  # our children's heartbeats
        env = {"MASTER_ADDR": opts.host, "MASTER_PORT": str(self.port), "WORLD_SIZE": str(cfg.world_size),
               "NNODES": str(opts.nnodes), "NODE_RANK": str(self.node), "UNBROKEN_RUN_DIR": str(self.run_dir),
               "UNBROKEN_FAULTS": json.dumps([str(f) for f in opts.faults]), "OMP_NUM_THREADS": str(cfg.threads),
               "UNBROKEN_RESUME": "1" if self.resume else "0",
               "LOCAL_WORLD_SIZE": str(self.local), **({"UNBROKEN_STORE": opts.store} if opts.store else {}),
               node_heartbeats.ENV: str(self.beats.port), faults.SUPERVISOR_ENV: str(os.getpid())}
        self.table = ProcessTable(self.run_dir, env, list(opts.script), server=forks, warn=warn)
        self.tee = Tee(self.run_dir / "logs", opts.tee, node=self.node, write=on_output or stream_writer())
        self.gen: membership.Generation | None = None
        self.fault_log = membership.FaultLogReader(self.store, on_lost=lambda i, w: self.events.emit(
            "warning", message=f"fault record {i} never written ({w:.1f}s after its index was taken): "
                               "its reporter died between add and set"))
        self.rate = RecoveryRateLimit(cfg.max_recoveries_per_hour)
        self.leases: lease.NodeLeases | None = None  # the leader's, once every node joined
        self.held = lease.FaultHold()  # the leader's: other nodes' fault records until their lease decides
        self.pool = ShadowPoolSizer(cfg.max_shadows) if cfg.shadows == "auto" else None
        self._warm: set[str] = set()  # shadows seen ready (their warm-up measured)
        self._quiet = False  # the leader's view: some node's lease is late
        self.killed: set[str] = set()
        self.shadow_seq = 0
        self.joined: set[int] = set()  # nodes admitted (the leader's view)
        self.status = "starting"
        self.crashes = CrashJudge(self.store, self.events)  # software faults (runtime/crash.py)
        self.watch = Watch(cfg, node=self.node, nnodes=opts.nnodes, checkpoint_dir=self.run_dir, events=self.events)
        self._collerr: dict | None = None  # first failed-collective report of the current generation
        self._last_step = 0  # the newest step rank 0 reported done
        self._link_regroups = 0  # link regroups in the incident in progress (reset when a step completes)
        self.chain = None  # the retry chain of the recovery in progress (leader)
        self.attempt = None
        self.fence: LeaseFence | None = None  # a follower's: stop everything when the lease cannot be renewed
        self._fence_ack = threading.Event()  # set when the loop took the fence's interrupt
        self.replicated = opts.store is not None  # etcd: the leader role can move (runtime/failover.py)
        self.leader_watch: failover.LeaderWatch | None = None  # a follower's, on the replicated store
        self._cursor = 0  # the fault log's cursor as last published (replicated store)
        self._fault_watch: membership.FaultLogWatch | None = None  # the leader's, on the replicated store
        # the leader's: a rank lost after its peers finished is never replaced (runtime/stranded.py)
        self.stranding = stranded.Stranding(cfg.world_size, wait_s=cfg.collective_timeout_s, run_dir=self.run_dir)

    # --- store and admission (runtime/admission.py) -----------------------------------
    def _agree_on_config(self) -> None:
        self.cfg, self.resume = admission.agree_on_config(self.store, self.cfg, self.opts, self.events)

    # --- processes -----------------------------------------------------------------
    def _start_worker(self, rank: int, proc: str) -> Child:
        c = self.table.start(proc, "worker", {"RANK": str(rank), "LOCAL_RANK": str(rank % self.local)})
        self.watch.spawned(c, rank)
        self.events.emit("process_started", pid=c.pid, role="worker", proc=proc, cold=False, rank=rank)
        return c

    def _start_shadow(self, cold: bool = False) -> Child:
        proc = f"n{self.node}-s{self.shadow_seq}"
        self.shadow_seq += 1
        i = self.store.add(f"shadows/{self.node}/n", 1) - 1  # its index decides its slot (runtime/standby.py)
        c = self.table.start(proc, "shadow", {"LOCAL_RANK": str(slot_of_shadow(i, self.local))})
        self.watch.spawned(c, None)
        self.store.set(f"shadows/{self.node}/{i}", proc)
        self.events.emit("process_started", pid=c.pid, role="shadow", proc=proc, cold=cold)
        return c

    def _replenish(self) -> None:
        """Keep this node's pool full; publish how long our shadows took to become ready."""
        if self.status not in ("running",) and not self.status.startswith("recovering"):
            return
        standby = [c for c in self.table.children.values()
                   if c.role == "shadow" and not c.taken and c.poll() is None
                   and not self.store.check([f"assign/{c.proc}"])]
        for c in standby:
            if c.proc not in self._warm and self.store.check([f"ready/{c.proc}"]):
                self._warm.add(c.proc)
                self.store.set(f"warmup/{self.node}", f"{time.time() - c.started:.3f}")
        for _ in range(self._pool_size() - len(standby)):
            self._start_shadow()

    def _pool_size(self) -> int:
        if self.cfg.shadows != "auto":
            return self.cfg.shadows
        return int(self.store.get("shadows/size")) if self.store.check(["shadows/size"]) else 1

    def _resize_pool(self, now: float) -> None:
        """shadows = "auto": a failure may show that failures outpace shadows' warm-up."""
        if self.pool is not None:
            self.pool.resize(self.store, self.opts.nnodes, self.events, now)

    # --- detection -----------------------------------------------------------------
    def _check_exits(self) -> bool:
        """Reap children that exited and feed them to the detectors; True if any did."""
        seen = False
        for c in list(self.table.children.values()):
            code = None if c.reaped else c.poll()
            if code is None:
                continue
            seen = True
            c.reaped = True
            rank = self._rank_of(c.proc)
            self.events.emit("process_exited", pid=c.pid, proc=c.proc, returncode=code,
                             signal=-code if code < 0 else None, rank=rank)
            if self.status != "stopping" and c.proc not in self.killed:
                self.watch.exited(c, rank, code)
        return seen

    def _detect(self) -> None:
        """Run the detectors; record each finding and its classification, then act."""
        if self.status in ("stopping", "excluded"):
            return
        # while a node has gone quiet its lease decides: waiting on it is no hang or stall here
        for f, d in self.watch.poll(self.beats.store, list(self.table.children.values()), self._rank_of,
                                    hold_hangs=self._node_quiet()):
            self.events.emit("fault_detected", rank=f.rank, **f.event_fields())
            self.events.emit("fault_classified", rank=d.rank, **d.event_fields())
            if d.exclude:
                self.store.set(f"excluded/{d.node}", "1")
                self.events.emit("node_excluded", **self.watch.offenders.exclude(d.node, f.time))
            child = self.table.children.get(f.proc)
            if child is None or d.action == "none":
                continue
            if f.fault in _KILL_ON and child.poll() is None:
                self.killed.add(child.proc)
                self.events.emit("process_killed", pid=child.pid, proc=child.proc, why=f"{f.fault}: {d.reason}",
                                 rank=f.rank)
                self.table.kill(child)
            occurred = f.time - float(f.evidence.get("last_heartbeat_age_s") or 0.0) if f.fault == "hang" else f.time
            self._hand_to_leader(f.proc, f.fault, f.time, occurred, d.action)
        if not self.leader and self.store.check([f"excluded/{self.node}"]):
            self._leave_excluded_node()

    def _hand_to_leader(self, proc: str, fault: str, t: float, occurred: float, action: str) -> None:
        membership.report_fault(self.store, {"proc": proc, "fault": fault, "time": t, "occurred": occurred,
                                             "node": self.node, "action": action})

    def _leave_excluded_node(self) -> None:
        """This node was excluded: stop every process here; the leader moves our ranks elsewhere."""
        for c in self.table.children.values():
            if c.poll() is not None:
                continue
            self.killed.add(c.proc)
            self.events.emit("process_killed", pid=c.pid, proc=c.proc, why=f"node {self.node} excluded",
                             rank=self._rank_of(c.proc))
            self.table.kill(c)
            if self._rank_of(c.proc) is not None:
                self._hand_to_leader(c.proc, "excluded", time.time(), time.time(), "exclude_node")
        self.status = "excluded"

    def _rank_of(self, proc: str) -> int | None:
        if self.gen is None:
            return None
        for r, p in self.gen.members.items():
            if p == proc:
                return r
        return None

    # --- the leader's decisions ---------------------------------------------------------
    def _take_faults(self, now: float) -> None:
        """Read the fault log (a record whose key lands late: on a later tick; another node's: once its
        lease decides, lease.FaultHold): a process lost (or to be replaced) starts the next generation;
        members' failed collectives with nobody lost may mean a broken link (_check_link)."""
        self.crashes.check_fatal()
        dead = {}
        for f in self.held.admit(self.fault_log.take_indexed(), self.leases, self.store):
            if f["fault"] == "collective_error":
                # only a current member's report counts (a replaced process may still be failing)
                if f["gen"] == self.gen.gen and self.gen.members.get(f["rank"]) == f["proc"]:
                    if self._collerr is None or self._collerr["gen"] != f["gen"]:
                        leases = self.leases.read(self.store) if self.leases is not None else {}
                        self._collerr = {**f, "seen": now, "leases": leases, "reports": 0}
                    self._collerr["reports"] += 1
                continue
            self.crashes.judge(f["proc"])
            self.store.set(f"dead/{f['proc']}", "1")
            rank = self._rank_of(f["proc"])
            if rank is not None:
                dead[rank] = f
        if self.replicated and (cursor := self.held.cursor(self.fault_log.cursor)) != self._cursor:
            self._cursor = cursor  # a successor starts reading there
            self.store.set(failover.CURSOR_KEY, str(self._cursor))
        if dead:
            self._next_generation(dead)
        elif not self.held:  # a held record's node may be gone: its lease decides before any link regroup
            self._check_link(now)

    def _check_link(self, now: float) -> None:
        """Members' collectives failed but no process died (its exit or a detector would have
        moved the generation on within the grace period): a link broke. Every process and
        its state is intact, so regroup the *same* members in a new generation: new
        connections, no replacement, no decode. At most _LINK_REGROUPS times per incident (a
        second link may break during the first regroup's recovery, where the no-progress
        deadline is long); if the link keeps failing before any step completes, the
        detectors (stall, hang) pick a process to replace instead."""
        first = self._collerr
        if first is None or first["gen"] != self.gen.gen or now - first["seen"] < _LINK_GRACE_S:
            return
        if self._link_regroups >= _LINK_REGROUPS:
            return  # the link keeps breaking before any step completes: the detectors pick a process
        if self.leases is not None and not self.leases.renewed_after(self.store, first["leases"]):
            return  # a node has not renewed since the error was seen: its lease decides (node loss)
        from unbroken.detect import Finding, classify

        f = Finding(fault="stall", proc="group", rank=None, node=None, time=now, evidence={
            "why": "a collective failed while every process is alive (broken link)",
            "reported_by": first["rank"], "error": first["error"][:160], "reports": first["reports"]})
        d = classify(f, self.watch.offenders)
        self.events.emit("fault_detected", **f.event_fields())
        self.events.emit("fault_classified", **d.event_fields())
        self._link_regroups += 1
        self._next_generation({}, link={"fault": "stall", "time": now, "occurred": first["time"]})

    def _next_generation(self, dead: dict[int, dict], link: dict | None = None) -> None:
        if stranded.stuck(self, dead):
            return  # finished peers never rejoin: no generation can form
        try:
            self.rate.admit(time.monotonic())
        except RecoveryRateExceeded as e:
            raise LaunchError(f"{e}; see {self.run_dir / 'events.jsonl'}") from None
        if dead:
            self._resize_pool(time.monotonic())
        incident = list(dead.values()) or [link]  # the fault records behind this generation
        members = dict(self.gen.members)
        assigned = []
        self._retry_link(incident)
        self.stranding.replacing(dead)
        for rank, f in sorted(dead.items()):
            self.watch.replaced(members[rank])
            proc, cold = self._pick_shadow(exclude=set(members.values()), prefer=int(f.get("node", 0)),
                                           slot=rank % self.local)
            members[rank] = proc
            assigned.append((rank, proc, cold))
        gen = membership.Generation(self.gen.gen + 1, members, tuple(sorted(dead)), membership.incident_cause(dead))
        membership.publish(self.store, gen)
        self.events.gen = gen.gen
        for rank, proc, cold in assigned:
            membership.put(self.store, f"assign/{proc}", {"rank": rank, "gen": gen.gen})
            self.events.emit("shadow_assigned", proc=proc, rank=rank, gen=gen.gen, cold=cold,
                             shadow="cold" if cold else "warm")
        t_detect = min(f["time"] for f in incident)
        t_fault = min(f.get("occurred", f["time"]) for f in incident)
        self.events.emit("recovery_phase", phase="detect", start=t_fault, end=t_detect, step=None)
        self.events.emit("recovery_phase", phase="decide", start=t_detect, end=time.time(), step=None)
        self.events.emit("generation", gen=gen.gen, members=gen.members, replaced=list(gen.replaced), cause=gen.cause)
        self.gen = gen
        self.tee.follow(gen.gen, gen.members)
        self.status = (f"recovering rank {','.join(map(str, sorted(dead)))} (generation {gen.gen})" if dead
                       else f"recovering from a broken link (generation {gen.gen})")

    def _pick_shadow(self, exclude: set[str], prefer: int, slot: int) -> tuple[str, bool]:
        """A standby shadow (runtime/standby.py: ready, on the failed rank's node, at its slot, first; not ours if
        it exited or we killed it: `dead/` lands a tick later), else a cold start (True: the recovery waits)."""
        gone = {n for n in range(self.opts.nnodes) if n != self.node
                and (self.store.check([f"excluded/{n}"]) or self._node_lost(n))}
        exclude = exclude | {p for p, c in self.table.children.items() if p in self.killed or c.poll() is not None}
        standbys = list_standbys(self.store, [n for n in range(self.opts.nnodes) if n not in gone], self.local, exclude)
        best = pick_standby(standbys, node=prefer, slot=slot)
        proc, unready = (best.proc, not best.ready) if best else (self._start_shadow(cold=True).proc, True)
        if proc in self.table.children:
            self.table.children[proc].taken = True
        return proc, unready

    def _node_lost(self, node: int) -> bool:
        return self.leases is not None and node in self.leases.lost

    def _retry_link(self, incident: list[dict]) -> None:
        """Each generation published for one incident is a link of its retry chain."""
        from unbroken.detect import RetryChain, RetryPolicy

        if self.chain is not None and self.attempt is not None:  # the previous attempt did not resume
            self.events.emit("retry", **self.chain.record(self.attempt, "failed"))
        else:
            fault = ",".join(sorted({f["fault"] for f in incident}))
            self.chain = RetryChain(RetryPolicy(budget=self.cfg.retry_budget, base_backoff_s=0.0),
                                    action="in_place", fault=fault)
        self.attempt = self.chain.next_attempt()
        if self.attempt is None:
            raise LaunchError(f"retry budget exhausted ({self.cfg.retry_budget} attempts without completing a "
                              f"step) for one incident; raise it with --retry-budget; see {self.run_dir / 'events.jsonl'}")

    def _retry_done(self) -> None:
        if self.chain is not None and self.attempt is not None:
            self.events.emit("retry", **self.chain.record(self.attempt, "ok"))
        self.chain = self.attempt = None
        self.stranding.recovered()
        self.watch.recovered()

    def _done_records(self) -> dict[int, dict]:
        """Each finished rank's {"sha256", "steps"} as its worker put it in the store (runtime/worker.py)."""
        return {r: json.loads(self.store.get(f"done/{r}")) for r in range(self.cfg.world_size)
                if self.store.check([f"done/{r}"])}

    def _all_done(self) -> bool:
        return self.store.check([f"done/{r}" for r in range(self.cfg.world_size)])  # one round trip

    # --- the loop --------------------------------------------------------------------
    def run(self) -> dict:
        t0 = time.time()
        if self.leader:
            self.events.emit("run_start", config=self.cfg.to_dict(), world_size=self.cfg.world_size,
                             nodes=self.opts.nnodes, port=self.port)
            self.joined = admission.wait_for_nodes(self.store, self.opts, self.events)
            if self.opts.nnodes > 1:
                self.leases = lease.NodeLeases(self.opts.nnodes, self.cfg.node_lease_s)
            members = {r: f"n{r // self.local}-w{r}" for r in range(self.cfg.world_size)}
            self.gen = membership.Generation(0, members, (), "start")
            membership.publish(self.store, self.gen)
        else:
            self.gen = membership.read_generation(self.store, 0, 60)
            if self.replicated:
                self.leader_watch = failover.LeaderWatch(self.node, self.opts.nnodes, self.cfg.node_lease_s)
        if self.opts.nnodes > 1 and (self.replicated or not self.leader):  # who renews a lease can fence
            self.fence = LeaseFence(FENCE_FRACTION * self.cfg.node_lease_s, self._fence_now).start()
        self.tee.follow(self.gen.gen, self.gen.members)
        self.tee.start()
        finished, summary = False, None
        try:  # from here on, the finally stops whatever was started
            for r in range(self.node * self.local, (self.node + 1) * self.local):
                self._start_worker(r, self.gen.members[r])
            self.status = "running"
            self._loop()
            finished = True
        except KeyboardInterrupt:
            if self.fence is not None and self.fence.fenced_age_s is not None:
                self._fence_ack.set()
                raise LaunchError(self._fence_message()) from None
            raise
        finally:
            fenced = self.fence is not None and self.fence.fenced_age_s is not None
            if self.fence is not None:
                self.fence.stop()
            excluded, self.status = self.status == "excluded", "stopping"
            if self.leader:
                self.store.set("shutdown", "1")
            # done: the workers are writing their last files, give them a moment; stopped (an error,
            # Ctrl-C, SIGTERM): nothing they do now matters, stop them at once
            self._drain(grace_s=10.0 if finished else 0.0)
            self.tee.stop()  # after every process exited: their last lines are all written
            if not fenced:  # a fenced node's link to the store is down: no hand-over, no goodbye
                try:
                    summary = self._hand_over(finished and not excluded)
                finally:
                    self._leave()
        return {"wall_s": time.time() - t0, "port": self.port, "summary": summary}

    def _fence_message(self) -> str:
        where = "the etcd store" if self.replicated else "node 0's store"
        return (f"node {self.node} could not renew its lease for {self.fence.fenced_age_s:.1f} s ({where} "
                "unreachable): its ranks go to other nodes, so it stopped its processes (fenced); check the "
                "network between the nodes")

    def _fence_now(self, age_s: float) -> None:
        """The fence thread: record, stop every process of this node at once, seal the log, wake the loop."""
        self.events.emit("node_fenced", node=self.node, lease_age_s=round(age_s, 3),
                         fence_after_s=self.fence.fence_after_s)
        for child in list(self.table.children.values()):
            if child.poll() is None:
                try:
                    os.kill(child.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.events.seal()
        _thread.interrupt_main()
        if not self._fence_ack.wait(_FENCE_EXIT_S):  # the loop is stuck in a store call on the dead link
            os.write(2, f"error: {self._fence_message()}\n".encode())
            os._exit(2)

    def _hand_over(self, finished: bool) -> dict | None:
        """Every node's events to the leader, the leader's summary to every node (runtime/handover.py)."""
        if not self.leader:
            if not finished:
                return None
            try:
                handover.send_events(self.store, self.node, self.run_dir)
                return handover.receive_summary(self.store, timeout_s=_HANDOVER_S)
            except Exception as e:  # noqa: BLE001 - node 0 is gone: its summary cannot come; training is over
                self.events.emit("warning", message=f"no summary from node 0 ({type(e).__name__}: {e})")
                return None
        summary = None
        try:
            if finished:
                followers = sorted(n for n in self.joined if not self._node_lost(n))
                if missing := handover.collect_events(self.store, followers, self.run_dir, timeout_s=_HANDOVER_S):
                    self.events.emit("events_missing", nodes=missing, timeout_s=_HANDOVER_S)
                summary = self.on_finish(self._done_records())
        finally:
            if self.opts.nnodes > 1:
                handover.publish_summary(self.store, summary)
        return summary

    def _leave(self, timeout_s: float = 10.0) -> None:
        """Followers say they are leaving; the leader (whose exit closes the store) waits for
        them, so that no follower's next store request meets a closed connection."""
        try:
            if not self.leader:
                self.store.set(f"left/{self.node}", "1")
                return
            nodes = [n for n in self.joined if not self._node_lost(n)]
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and not all(self.store.check([f"left/{n}"]) for n in nodes):
                time.sleep(0.02)
        except Exception:  # noqa: BLE001 - leaving is best effort; the run's outcome is already decided
            pass

    def _loop(self) -> None:
        """Sleep until a child exits or the next period: every _FAULT_TICK_S the leader takes fault reports
        (on etcd: when a watch says one landed, else every heartbeat); every heartbeat: detectors, bookkeeping,
        the pool. Store round trips and wake-ups cost CPU the workers need (etcd: one read a tick)."""
        wake = ChildWake()
        try:
            next_beat = next_faults = 0.0
            while True:
                now = time.time()
                exited = self._check_exits()
                beat = exited or now >= next_beat  # an exit is acted on at once, not at the next beat
                if self.store.batched and (beat or (self.leader and now >= next_faults)):
                    self.store.prefetch(store_reads.tick_keys(self))
                try:
                    if beat:
                        next_beat = now + self.cfg.heartbeat_s
                        self._detect()
                        if self._bookkeeping():
                            return
                    if self.leader and (exited or now >= next_faults or self._faults_landed(wake)):
                        next_faults = now + (self.cfg.heartbeat_s if self.replicated else _FAULT_TICK_S)
                        self._take_faults(now)
                finally:
                    self.store.drop()
                wake.wait(min(next_beat, next_faults if self.leader else next_beat) - time.time())
        finally:
            wake.close()
            if self._fault_watch is not None:
                self._fault_watch.close()

    def _faults_landed(self, wake: ChildWake) -> bool:
        """On etcd: has a fault record landed since the last look (a watch; it pokes `wake`)?"""
        if not self.replicated:
            return False
        if self._fault_watch is None:  # the first time this node leads (it may have taken over)
            from unbroken.runtime.etcd_store import EtcdStore

            self._fault_watch = membership.FaultLogWatch(lambda: EtcdStore(self.opts.store, timeout_s=30),
                                                         self.fault_log.cursor, wake.poke)
        return self._fault_watch.landed()

    def _bookkeeping(self) -> bool:
        """Abort, completion, progress and the shadow pool; True when this supervisor is done."""
        if self.store.check(["abort"]):
            raise LaunchError(f"the job cannot run: {self.store.get('abort').decode()}")
        if self.leader:
            if self.replicated and self.opts.nnodes > 1:  # alone, nobody reads our lease or takes over
                self._renew()
                self._still_leader()
            self.crashes.check_fatal()
            if self._all_done():
                return True
            if (self.stranding.stranded or self.status.startswith("recovering")) and stranded.stuck(self, {}):
                return stranded.end(self)
            self._check_leases()
            self._progress()
        elif self.status == "excluded" or self.store.check(["shutdown"]):
            return True
        else:
            self._renew()
            self.tee.follow_store(self.store)
            if self.leader_watch is not None and (won := self.leader_watch.poll(self.store)):
                failover.take_over(self, *won)
        self._replenish()
        return False

    def _renew(self) -> None:
        lease.renew(self.store, self.node)
        if self.fence is not None:
            self.fence.renewed()

    def _still_leader(self) -> None:
        try:
            failover.check_still_leader(self.store, self.node)
        except LaunchError:
            self.leader = False  # a deposed leader neither ends the job (shutdown) nor summarizes it
            raise

    def _check_leases(self) -> None:
        """A node whose lease expired is lost: all its ranks are replaced as one incident. While
        some node is late, `lease/quiet` tells every supervisor to hold its hang detection."""
        if self.leases is None:
            return
        for node in self.leases.nodes:  # excluded by policy: it leaves; its lease is moot
            if node not in self.leases.lost and self.store.check([f"excluded/{node}"]):
                self.leases.forget(node)
        for node, age in self.leases.observe(self.store):
            self._lose_node(node, age)
        quiet = self.leases.late(_QUIET_BEATS * self.cfg.heartbeat_s)
        if quiet != self._quiet:
            self._quiet = quiet
            self.store.set("lease/quiet", "1" if quiet else "0")

    def _node_quiet(self) -> bool:
        if self.opts.nnodes == 1:
            return False
        if self.leader:
            return self._quiet
        if self.leader_watch is not None and self.leader_watch.leases.late(_QUIET_BEATS * self.cfg.heartbeat_s):
            return True  # the leader itself may be late: nobody would say so (the store fails over meanwhile)
        return self.store.check(["lease/quiet"]) and self.store.get("lease/quiet") == b"1"

    def _lose_node(self, node: int, age_s: float) -> None:
        lease.lose_node(self, node, age_s, [r for r, p in self.gen.members.items() if _node_of(p) == node])

    def _progress(self) -> None:
        info = membership.get(self.store, "progress") or {}
        if info.get("step", 0) > self._last_step:
            self._last_step = info["step"]
        # a step completed *in this generation* ends the incident (after a tier-2 rollback its
        # number is below the newest ever seen; a late report from the old one does not count)
        if self.status.startswith("recovering") and info.get("gen") == self.gen.gen:
            self.status = "running"
            self._link_regroups = 0
            self._retry_done()
        self.on_progress({**info, "status": self.status})

    def _drain(self, grace_s: float) -> None:
        """Give workers `grace_s` to exit on their own, then stop everything we own."""
        deadline = time.time() + grace_s
        workers = [c for c in self.table.children.values() if c.role == "worker" or c.taken]
        while time.time() < deadline and any(c.poll() is None for c in workers):
            time.sleep(0.02)
        self.table.stop_all(grace_s=2.0)


def _node_of(proc: str) -> int:
    """Process names are n{node}-w{rank} (workers) and n{node}-s{i} (shadows)."""
    return int(proc[1:proc.index("-")])


def install_signal_handlers() -> None:
    """SIGTERM behaves like Ctrl-C: unwind through `finally` and reap every child."""
    def _raise(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, _raise)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")

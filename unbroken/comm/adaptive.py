"""The congestion-aware all-reduce: run the current plan, learn the links, re-plan, all ranks alike.

After every collective each rank issues an all-gather of one small fixed-size table of what its
transfers saw (per peer and phase: bytes, when it posted, when the receive ended; comm/flow_sync.py) and returns;
the next call waits for it (by then it has usually arrived: the caller computed meanwhile), so
every rank folds the same flows into the same estimates (comm/flows.py) and computes the same
plan (comm/planner.py) for that collective: no plan ever has to be broadcast, and a change takes
effect at the next collective on every rank. A congestion flag change and a plan change are
events (`link_congestion`, `collective_plan`), written by rank 0 before the plan is used.

mode "static" always runs the static ring (rank order, even chunks, its pieces set by the size
alone) and learns nothing: the baseline. mode "chain" always runs the rank-order chain (its
pieces set by the size alone) and learns nothing either: for ranks placed on nodes in blocks,
where a node's link is shared (comm/patterns.py). All-reduces under `learn_bytes` (the same decision on
every rank: the size is the same) skip the exchange: their flows are too small to measure a link
(flows.FlowConfig.min_bytes) and the sync would cost more than it could win. Summing several small
ones (a step's gradient buckets) into one observation was tried and dropped: between buckets the
token bucket refills, so the slow link read well above its rate and cleared, fast links jittered
below the threshold, and plans flapped from step to step (a trial with 2 MB buckets). Plans
are kept per size (a step's buckets differ in size; each keeps its plan until the links change).

With nothing to plan around, the duel (comm/duel.py) picks by time between the paced ring and the
even direct exchange (another job's TCP stream on a link gives the ring's one flow half of it, the
exchange's N-1 flows most of it); links read as shared are planned around only once the exchange won.
Once it won at a learned size, every size under `learn_bytes` duels on its own (`_small_arm`): the
exchange (or the plan around shared links) first, then the paced ring, then the faster. Its times
are agreed by the same all-gather, issued only for the collectives the duel needs timed
(`Duel.due`: two in every DUEL_EVERY): on 8 ranks the even exchange won at 16 MB and ran 1 MB at
1.7x the static ring's time, where at 4 ranks it beat the ring at every size (stop 52).
The ring runs paced (`planner.paced`). A paced ring says nothing about single
links (each pair's bytes spread over the whole collective at the slowest hop's pace), so its flows
are not read, only its time. The first learned collective, one after a paced ring PROBE_SLOWER
times slower than the fastest of its size, and every PROBE_EVERY-th paced one run the ring
unpaced (a probe), and their flows are read as before.

A plan around a slow link is a direct exchange in which the slow rank owns nothing; where the link
is under `squeeze_below_Bps` every transfer of that rank is compressed (`_squeezed`, comm/squeeze.py):
its own bytes are what bounds the plan. It runs at the planner's pipeline depth or half of it,
whichever ran faster at its size (`_depth`; small sizes' times agreed as the duel's).

Readings can lie (eight ranks on two cores read healthy links at 0.9-3.3x their rate; under a plan
around a slow link, the other links read their owners' busy links), so a plan is also judged by
its time: a plan made around flagged links whose first two runs are both slower than the even ring
it replaced, and flags read under a plan whose slow links have cleared, are rejected (`_judge`,
`_reject`): the ring runs paced until the links visibly change or VETO_FOR learned collectives pass.
Sizes under `learn_bytes`, never judged, take a plan around flagged links only once a plan around
the same links passed its judgment at a learned size (`_reference`).
"""
from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Callable, NamedTuple

import torch

from unbroken.comm import flows, planner, squeeze
from unbroken.comm.duel import DEPTHS, Duel
from unbroken.comm.flow_sync import PHASES, FlowSync, flows_of  # noqa: F401 - PHASES: the slots' shape
from unbroken.comm.group import CollectiveError
from unbroken.comm.patterns import Pattern, allreduce
from unbroken.comm.transport import Transport

MODES = ("adaptive", "static", "chain")  # chain: the rank-order chain, for ranks in node blocks
PROBE_EVERY = 8  # paced collectives between two that run unpaced to read the links
PROBE_SLOWER = 1.1  # a paced ring this much slower than the fastest collective of its size: the next one probes
CONTENDED_STEPS = 10  # a contended link is planned at a whole number of tenths of the fleet's rate
VETO_FOR = 32  # learned collectives during which a rejected picture of the links is not planned around
REJECT_SLOWER = 1.05  # a plan around flagged links this much slower than the even ring it replaced is rejected
CHOICES_KEPT = 256  # planner choices remembered per picture of the links (`_choose`)
Emit = Callable[..., object]  # EventLog.emit


class Ran(NamedTuple):
    """The collective whose flow exchange is in flight, as `_replan` reads it when the exchange is in."""

    plan: Pattern
    nbytes: int
    depth: str | None = None  # the depth duel's arm it ran at (None: not duelled)
    # it ran cold: the planner ran for it (its size's first, or a new picture of the links), so ranks
    # left the planner apart and the first to start waited for the last inside the timed collective
    cold: bool = False


class AdaptiveAllreduce:
    """Sum-all-reduces of `rank` of `world` over gloo group `pg`; every wait ends by `timeout_s`."""

    def __init__(self, pg, *, rank: int, world: int, timeout_s: float, mode: str = "adaptive",
                 flow_cfg: flows.FlowConfig | None = None, min_gain: float = 0.05,
                 emit: Emit | None = None, interrupted: Callable[[], bool] | None = None,
                 abort: Callable[[], None] | None = None, learn_bytes: int = 8 << 20,
                 squeeze_below_Bps: float = squeeze.SQUEEZE_BELOW_BPS) -> None:
        if mode not in MODES:
            raise ValueError(f"collectives mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.pg, self.rank, self.world, self.mode, self.min_gain = pg, rank, world, mode, min_gain
        self.learn_bytes = learn_bytes  # smaller all-reduces neither pay for the sync nor change the plan
        self.squeeze_below_Bps = squeeze_below_Bps  # slow links under this carry compressed bytes (0: never)
        self.emit = emit if rank == 0 else None
        self.sync = FlowSync(pg, world=world, timeout_s=timeout_s)  # the flows' all-gather (comm/flow_sync.py)
        self.tp = Transport(pg, rank=rank, world=world, timeout_s=timeout_s, on_transfer=self.sync.record,
                            interrupted=interrupted, abort=abort)
        self.table = flows.FlowTable(flow_cfg)
        self.plan: Pattern | None = Pattern.static_ring(world) if mode == "static" else None  # the last one used
        # per all-reduce size: the links' picture its plan was made for, the planner's choice, and the
        # plan run (the choice; `planner.paced` of it while no link is slow or contended)
        self._sizes: dict[int, tuple[tuple, Pattern, Pattern]] = {}
        self._choices: dict[tuple, tuple[Pattern, float]] = {}  # (key, size, kinds, pieces, prior) -> choice
        self.seq = 0
        self.history: deque[dict] = deque(maxlen=1024)  # the last collectives: seq, plan, seconds, estimates
        self._slow: set[flows.Link] = set()  # the links the current plan was made around (hysteresis)
        self._origin: set[flows.Link] = set()  # the slow links the plan left the even ring for
        self._contended: set[flows.Link] = set()  # the links the current plan saw as shared (hysteresis)
        self._squeeze: set[int] = set()  # the ranks whose transfers are compressed around their slow links
        self._estimates: dict | None = None  # the link estimates the current plan was chosen from
        self._ran: Ran | None = None  # the collective whose flow exchange is in flight
        self._measured = False  # some collective's flows were read
        self._best: dict[int, float] = {}  # per size: the fastest learned collective so far (slowest rank's s)
        self._paced_runs = 0
        self._probe: str | None = None  # why the next collective runs a probe: "first", "every", "slower"
        self._last: dict[int, tuple[Pattern, float]] = {}  # per size: the plan its last collective ran, and its seconds
        self._judged: dict[int, float] = {}  # per size: the ring's seconds, after a plan ran slower than it once
        self._ring_s: dict[int, float] = {}  # per learned size: the last paced even ring's seconds (`_judge`)
        self._passed: frozenset | None = None  # the flagged links of the last plan that passed `_judge`
        self._learned = 0  # collectives whose exchange was folded in
        self._vetoed_until = 0  # until this many learned collectives no link is planned around (`_judge`)
        self.duel = Duel()  # with nothing planned around: the paced ring or the direct exchange, by time
        self._trial = False  # the plan decided runs as the duel's trial (an arm not yet timed, or the loser)
        self._small_due = False  # the plan decided is of a size under learn_bytes whose time the duel needs
        self.depth = Duel(arms=DEPTHS)  # a plan around slow links: the planner's pieces or half (`_depth`)
        self._depth_of: dict[int, Pattern] = {}  # per size: the plan the depth duel is of
        self._depth_arm: str | None = None  # the depth the plan decided runs at (None: not duelled)
        self._planned = False  # the planner ran for the plan decided (`_choose`; a new size's always does)

    def __call__(self, t: torch.Tensor, what: str = "all-reduce") -> None:
        nbytes = t.numel() * t.element_size()
        sync_s = plan_s = None
        if self.mode == "static":
            self.plan = Pattern.static_ring(self.world, planner.pieces_for(nbytes))
        elif self.mode == "chain":
            self.plan = Pattern(kind="chain", order=tuple(range(self.world)), split=(1,) * self.world,
                                pieces=planner.chain_pieces(nbytes))
        elif self.sync.pending is not None:  # the last flow exchange: fold it in, re-plan
            t1 = time.perf_counter()
            try:
                gathered = self.sync.finish()
            except RuntimeError as e:
                self._gather_failed(what, e)
            t2 = time.perf_counter()
            self._replan(*gathered, nbytes)
            t3 = time.perf_counter()  # learning's cost here: the wait for it and the planner (of which plan_s)
            sync_s, plan_s = t3 - t1, t3 - t2
        else:
            self.decide(nbytes)  # a new size gets its plan (a no-op while size and links hold)
            self._probe_if(None if self._measured else "first", nbytes)  # nothing measured yet: measure first
        self.seq += 1
        plan, t0, cold = self.plan, time.perf_counter(), self._planned  # ranks left the planner apart
        self._planned = False
        self.sync.reset()
        learn = self.mode == "adaptive" and self.world > 1 and nbytes >= self.learn_bytes
        allreduce(self.tp, t, plan, self.seq, what, timed=learn and not plan.window)  # a paced ring's flows: not read
        seconds = time.perf_counter() - t0
        self.history.append({"seq": self.seq, "plan": plan.to_json(), "seconds": seconds,
                             "sync_s": sync_s, "plan_s": plan_s, "estimates": self._estimates,
                             "probe": self._probe or ("duel" if self._trial else None)})
        if learn or self._small_due:  # a small size's exchange carries its seconds only (untimed transfers)
            self._ran = Ran(plan, nbytes, self._depth_arm, cold)
            try:
                self.sync.start(seconds)
            except RuntimeError as e:
                self._gather_failed(what, e)

    def close(self) -> None:
        """The group is retired: its transport's waiter threads may end (a flow exchange still in
        flight fails with the group's sockets; it writes only into its own buffer)."""
        self.sync.pending = None
        self.tp.close()

    def _gather_failed(self, what: str, e: RuntimeError) -> None:
        self.tp.broken = f"{what} (flow statistics): {str(e).splitlines()[0][:160]}"
        raise CollectiveError(f"rank {self.rank}/{self.world}: {self.tp.broken}") from e

    # --- planning ------------------------------------------------------------------------------
    def slow_links(self) -> tuple[dict[flows.Link, float], float]:
        """The links the planner plans around (link -> its estimate) and the fleet's typical rate
        (`flows.fleet_rate`: the median of the links' estimates, or of the faster group's when a
        congestion's gap splits them): every link's reference (a link congested from the start has no
        uncongested rate of its own). A link is slow below `congested_below` x it, and stays slow
        until it is above `clear_above` x it (hysteresis: no plan flapping on noise). Neither the
        link's own best estimate nor the faster links' rate: maxima are inflated by token-bucket
        bursts (links measured above their line rate), and against them healthy links looked slow
        and a recovered one did not clear (in trials of the changing-rate scenario)."""
        cfg, est = self.table.cfg, {k: v for k, v in self.table.links.items() if v.rate}
        if not est:
            return {}, 1e9
        fleet = flows.fleet_rate((v.rate for v in est.values()), cfg.congested_below)
        slow = {}
        for link, v in sorted(est.items()):
            bar = cfg.clear_above if link in self._slow else cfg.congested_below
            if v.rate < bar * fleet:
                slow[link] = v.rate
        return slow, fleet

    def contended(self, fleet: float) -> list[flows.Link]:
        """Links under `contended_below` x the fleet's rate that are not slow: a stream of another job
        shares them (in the background scenario rank 2's link read ~3/4 of the others': its three
        row flows against the stream's one). No plan routes around them, but the direct exchange
        keeps N-1 of our flows on each where the ring's all-gather has one (`decide` plans only
        direct exchanges then), and they are planned at the share they get (their estimate), so
        their ranks own less.
        Once contended, a link stays so until it reads above `uncontended_above` x the fleet (0.95;
        hysteresis, as for slow links), and is planned at its estimate in tenths of the fleet's rate
        (`_share`), so that the plan does not change at every wobble of the estimate
        (docs/design.md, "Shared links with hysteresis, planned in tenths").
        `decide` reads them only while no link is slow: beside a slow link the plan is a direct
        exchange already, and fast links read under 0.85x the fleet on noise alone (three of our
        flows share each); planned at those readings, the fast ranks got uneven chunks (docs/design.md,
        "Shared links count only while no link is slow")."""
        cfg = self.table.cfg
        return sorted(k for k, v in self.table.links.items() if v.rate and k not in self._slow
                      and v.rate < (cfg.uncontended_above if k in self._contended else cfg.contended_below) * fleet)

    def _share(self, link: flows.Link, fleet: float) -> float:
        """A contended link's rate as planned: its estimate in tenths of the fleet's rate, so that
        the split does not follow every wobble of the estimate (each change is a new plan)."""
        return max(1, round(self.table.links[link].rate / fleet * CONTENDED_STEPS)) * fleet / CONTENDED_STEPS

    def rates(self) -> planner.Rates:
        """The links as the planner sees them: a slow link (`slow_links`) at its estimate, every other
        link, measured or not yet, at the fleet's typical rate (on shared hosts estimates wander by
        tens of percent, and a plan tuned to that noise loses to the ring)."""
        return self._rates(*self.slow_links())

    def _rates(self, slow: dict[flows.Link, float], fleet: float) -> planner.Rates:
        return planner.Rates(up=tuple(slow.get(("up", r), fleet) for r in range(self.world)),
                             down=tuple(slow.get(("down", r), fleet) for r in range(self.world)))

    def _replan(self, slots: torch.Tensor, slowest_s: float, nbytes: int) -> None:
        """Fold the last collective's flows in; the plan for this one (of `nbytes`). A paced ring's
        flows are not folded in: every send waits its turn, so each pair's bytes spread over the whole
        collective at its slowest hop's pace and no link stands out (a slow rank went unseen in a
        trial). Its time is the evidence instead: when it is PROBE_SLOWER times slower than the fastest
        collective of its size so far, whatever its plan (a paced ring first run while another job's
        stream shared a link would otherwise be its own yardstick), and every PROBE_EVERY paced
        collectives, this collective runs the ring unpaced and its flows are read. A probe run because
        the plan ran slower, or one that ran PROBE_SLOWER slower itself (a routine probe that ran
        into a slowdown), counts its readings twice: the time already says something changed, and
        the median of three then moves at once (with one reading it took a second probe, four
        collectives after a link got slow instead of two)."""
        ran, ran_bytes, depth, cold = self._ran
        # a collective run cold is no duel's evidence: in stop 52's 4-rank record the first 1 MB split ran
        # 43 ms after 8 ms of planning, then 22-26 ms, and such first times picked the ring over the split
        # at 1 MB and half the depth at 4 MB in stop 53's runs
        if depth is not None and not cold:
            self._depth_ran(depth, ran_bytes, slowest_s)
        if ran_bytes < self.learn_bytes:  # a small size's duel (`_small_arm`, `_depth`): its time, no flows
            if depth is None and not cold:
                self._duel_ran("ring" if _paced_even_ring(ran) else "exchange", ran_bytes, slowest_s,
                               exchange=None if _paced_even_ring(ran) else ran)
            self.decide(nbytes)
            self._probe_if(None if self._measured else "first", nbytes)
            return
        probe, self._probe = self._probe, None  # why the collective that ran was a probe, if it was
        trial = self._trial  # a duel's trial: its time is the duel's evidence (`_judge`), not a slowdown's
        best = self._best.get(ran_bytes, slowest_s)
        self._best[ran_bytes] = min(best, slowest_s)
        self._learned += 1
        self._judge(ran, ran_bytes, slowest_s, cold=cold)
        if ran.window:
            self._paced_runs += 1
            why = "slower" if slowest_s > PROBE_SLOWER * best and not trial \
                else "every" if self._paced_runs % PROBE_EVERY == 0 else None
            self.decide(nbytes)
            self._probe_if(why, nbytes)
            if why == "slower":  # the links changed: a rejected picture may hold now (read by this probe)
                self._vetoed_until = 0
            return
        self._measured = True
        # a probe counts twice when a slower ring called it or it ran slower itself (a routine probe
        # that ran into a slowdown: before, the plan changed a slow ring and a second probe later)
        changed = probe == "slower" or (probe is not None and slowest_s > PROBE_SLOWER * best)
        self.table.observe_flows(flows_of(slots), weight=2 if changed else 1)
        self._estimates = {f"{k}:{r}": round(v.rate) for (k, r), v in sorted(self.table.links.items())}
        self.decide(nbytes)

    def _judge(self, ran: Pattern, nbytes: int, seconds: float, cold: bool = False) -> None:
        """A plan made around flagged links must beat the even ring: its first two runs after an even
        ring of its size (the probe whose readings made it, or a paced ring), each REJECT_SLOWER slower
        than that ring, reject the picture of the links it was made from (`_reject`). One slow run is
        not enough: in a full run that rejected on one, a plan around another job's stream lost once in
        the warm-up, and the stream's scenario ran the paced ring at 0.92-1.03x static. A plan re-made
        between its two judged runs inherits the judgment. A plan re-made around other shared links
        (no link slow) is judged the same way against the last paced ring of its size: under a stream
        the splits wobble between plans that all beat the ring (judged against the plan before, they
        fell back to the slower paced ring; stop 44), but on 8 ranks sharing 2 cores the readings move
        at every collective and, once one split passed, splits followed splits unjudged at 1.1-1.3x the
        paced ring's time for a whole scenario (stop 48). A plan around slow links is judged only when
        it leaves the ring: the ring's time before the link got slow is no yardstick. Later runs of a
        plan time the links, not the plan, and are not judged. A plan that passes (or is not judged)
        lets sizes under `learn_bytes` take plans around the same links (`_passed`, `_reference`).
        A `cold` run (`_replan`) is judged as any other but gives the duel no time."""
        last = self._last.get(nbytes)
        self._last[nbytes] = (ran, seconds)
        arm = "ring" if _paced_even_ring(ran) else \
            "exchange" if ran == self._exchange(nbytes) and not self._flags() else None
        if arm is not None and not self._slow and not cold:  # beside a slow link the duel learns nothing
            self._duel_ran(arm, nbytes, seconds)
        if arm == "exchange":  # the duel judges it, against the paced ring
            self._judged.pop(nbytes, None)
            return
        if _even_ring(ran):
            if ran.window:
                self._ring_s[nbytes] = seconds
            self._judged.pop(nbytes, None)
            return
        judged = self._judged.pop(nbytes, None)  # the ring's seconds, after one slow run
        if judged is not None:  # its second run, or its re-make's, decides
            if seconds > REJECT_SLOWER * judged:
                self._reject("slower than the ring", ran, nbytes, seconds=seconds, previous_seconds=judged)
            else:
                self._passed = self._flags()
            return
        if last is not None and _even_ring(last[0]):
            ring_s = last[1]  # it left the ring
        elif last is not None and last[0] != ran and not self._slow and nbytes in self._ring_s:
            # re-made around other shared links: against the faster of the duel's arms (the even exchange
            # too: on 8 ranks splits made from misread links ran 1.1-1.3x its time; stop 51)
            ring_s = min([self._ring_s[nbytes], *self.duel.seconds.get(nbytes, {}).values()])
        else:
            ring_s = float("inf")
        if seconds > REJECT_SLOWER * ring_s:
            self._judged[nbytes] = ring_s  # slower once: its next run decides
            return
        self._passed = self._flags()  # it beat the ring, or follows a plan that did: small sizes may take it

    def _flags(self) -> frozenset:
        """The links the current plan was made around: slow or shared."""
        return frozenset(self._slow | self._contended)

    def _reject(self, why: str, plan: Pattern, nbytes: int, **fields) -> None:
        """No link is planned around, the ring runs paced, for VETO_FOR learned collectives or until a
        paced ring runs PROBE_SLOWER slower than its best (the links changed: the probe that follows
        reads them with the rejection lifted); an event says why."""
        self._vetoed_until = self._learned + VETO_FOR
        self._passed = None
        if self.emit:
            self.emit("collective_plan_rejected", seq=self.seq, why=why, plan=plan.to_json(), bytes=nbytes,
                      for_collectives=VETO_FOR, congested=[f"{k}:{r}" for k, r in sorted(self._slow)],
                      contended=[f"{k}:{r}" for k, r in sorted(self._contended)], **fields)

    def _probe_if(self, why: str | None, nbytes: int) -> None:
        """When there is a reason (`why`: "first", "every", "slower") and the plan is a paced ring, run
        that ring unpaced (no event: the same chunks, every row at once), so that this collective, if
        it is learned from, measures every link. After a paced ring ran slower with no link flagged slow,
        the probe runs whatever was decided: the picture the decision came from is older than the
        slowdown (stop 56: on 8 ranks a veto ran out at the collective after a link got slow, the plan
        went around a link shared before the change, its readings were folded in once, not twice, and
        the slow link went unflagged for the whole 20 s of the congestion). With slow links flagged,
        the plan around them runs (a paced ring beside them, run as the yardstick of a plan, is slower
        by nature: probing after each such ring cost the two-slow 1 and 4 MB sizes their plan)."""
        forced = why == "slower" and not self._slow
        if not why or self.plan is None or nbytes < self.learn_bytes or not (self.plan.window or forced):
            return
        pieces = planner.pieces_for(nbytes)
        if self.plan.window:
            self.plan = dataclasses.replace(self.plan, window=0, pieces=pieces)
        else:  # what was decided does not run: no duel's trial, no depth's
            self.plan, self._trial, self._depth_arm = Pattern.static_ring(self.world, pieces), False, None
        self._probe = why

    def decide(self, nbytes: int) -> None:
        """The plan for the next collective of `nbytes`: the one made around the flagged links
        (`_plan_links`), or with nothing to plan around, the duel's arm (`_arm`)."""
        self._plan_links(nbytes)
        self.plan = self._depth(self._arm(self.plan, nbytes), nbytes)

    def _depth(self, plan: Pattern, nbytes: int) -> Pattern:
        """`plan`, or where it is a direct exchange around slow links, that plan at the depth its size's
        duel picks (comm/duel.py DEPTHS): the planner's pieces, then half of them, then the faster.
        The model's cost of a message is one host's at 4 ranks: on 8 ranks sharing 2 cores, 1 MB
        around one slow rank ran 1.4x the static ring's speed in one piece, 1.1x in the model's two
        (stop 53)."""
        self._depth_arm = None
        if not self._slow or plan.kind != "pipelined" or plan.pieces < 2:
            return plan
        if self._depth_of.get(nbytes) != plan:  # a new plan at this size: its depths afresh
            self._depth_of[nbytes] = plan
            self.depth.drop(nbytes)
        arm, trial = self.depth.pick(nbytes)
        self._depth_arm, self._trial = arm, self._trial or trial
        if nbytes < self.learn_bytes:
            self._small_due = self.depth.due(nbytes)
        return _at_depth(plan, arm)

    def _depth_ran(self, arm: str, nbytes: int, seconds: float) -> None:
        """Give the depth duel `arm`'s time; a change of the depth that runs is an event."""
        before, after = self.depth.ran(nbytes, arm, seconds)
        base = self._depth_of.get(nbytes)
        if self.emit and base is not None and after is not None and after != (before or DEPTHS[0]):
            self.emit("collective_plan", seq=self.seq + 1, plan=_at_depth(base, after).to_json(),
                      previous=_at_depth(base, DEPTHS[1 - DEPTHS.index(after)]).to_json(), predicted_s=None,
                      congested=[f"{k}:{r}" for k, r in sorted(self._slow)], contended=[], bytes=nbytes,
                      by_time=dict(self.depth.seconds[nbytes]))

    def _arm(self, plan: Pattern, nbytes: int) -> Pattern:
        """`plan`, or where it is the paced even ring (nothing planned around) the arm the duel picks:
        that ring or the even direct exchange (comm/duel.py); sizes not learned from: `_small_arm`."""
        self._trial = self._small_due = False
        if nbytes < self.learn_bytes:
            return self._small_arm(plan, nbytes)
        if not _paced_even_ring(plan):
            return plan
        arm, self._trial = self.duel.pick(nbytes)
        return self._exchange(nbytes) if arm == "exchange" else plan

    def _small_arm(self, plan: Pattern, nbytes: int) -> Pattern:
        """A size under `learn_bytes`: `plan`, or once the exchange won at a learned size (another job's
        stream) and no link is slow, the arm its own duel picks, the exchange first (`_duel_arms`);
        the collectives whose time the duel needs carry it in the flow exchange (`_small_due`)."""
        if not self._small_duels():
            return plan
        arm, self._trial = self.duel.pick(nbytes, first="exchange")
        self._small_due = self.duel.due(nbytes)
        return self._duel_arms(plan, nbytes)[arm]

    def _small_duels(self) -> bool:
        return not self._slow and self._exchange_won()

    def _exchange_won(self) -> bool:
        """The exchange beat the ring at a learned size (a small size's own duel is no evidence of a stream)."""
        return self.duel.won_by("exchange", self.learn_bytes)

    def _duel_arms(self, plan: Pattern, nbytes: int) -> dict[str, Pattern]:
        """The duel's arms at `nbytes`: the paced ring, and `plan` where it is a direct exchange (the
        split around shared links at a small size), else the even one."""
        return {"ring": planner.paced(Pattern.static_ring(self.world), nbytes),
                "exchange": plan if plan.kind == "pipelined" else self._exchange(nbytes)}

    def _winner_of(self, plan: Pattern, nbytes: int) -> Pattern:
        """What runs for `plan` once the duel's trials are done: the paced even ring stands for the arm
        that wins at `nbytes`; at a small size that duels, its winner (the exchange until decided)."""
        if nbytes < self.learn_bytes:
            return self._duel_arms(plan, nbytes)[self.duel.winner(nbytes) or "exchange"] \
                if self._small_duels() else plan
        won = self.duel.winner(nbytes)
        return self._exchange(nbytes) if _paced_even_ring(plan) and won == "exchange" else plan

    def _exchange(self, nbytes: int) -> Pattern:
        """The duel's other arm: the direct exchange, even chunks, its pieces set by the size."""
        return Pattern(kind="pipelined", order=tuple(range(self.world)), split=(1,) * self.world,
                       pieces=planner.pieces_for(nbytes))

    def _duel_ran(self, arm: str, nbytes: int, seconds: float, exchange: Pattern | None = None) -> None:
        """Give the duel `arm`'s time; when what runs with nothing planned around changes (the first
        winner the exchange, or a later switch), an event says so (`exchange`: that arm's plan, when it
        is not the even exchange)."""
        before, after = self.duel.ran(nbytes, arm, seconds)
        first = "exchange" if nbytes < self.learn_bytes else "ring"  # what ran before the duel decided
        if self.emit and after is not None and after != (before or first):
            plans = self._duel_arms(exchange or self._exchange(nbytes), nbytes)
            self.emit("collective_plan", seq=self.seq + 1, plan=plans[after].to_json(),
                      previous=plans["exchange" if after == "ring" else "ring"].to_json(), predicted_s=None,
                      congested=[], contended=[], bytes=nbytes, by_time=dict(self.duel.seconds[nbytes]))

    def _plan_links(self, nbytes: int) -> None:
        """The plan around the flagged links for the next collective of `nbytes`, from the current
        estimates (the planner runs only when the links' picture changed: which links are slow and by
        how much, to 5%); the paced even ring when there is nothing to plan around."""
        slow, fleet = self.slow_links()
        if self._origin and not set(slow) & self._origin and self.plan is not None:
            # every slow link the job left the even ring for has cleared; links slow now were read
            # under the plan around them (their owners' busy links): after a recovery such plans ran
            # 0.24-0.39 s per 16 MB for seconds against the paced ring's 0.21 s (stop 43's record)
            self._reject("its slow links cleared", self.plan, nbytes)
        vetoed = self._learned < self._vetoed_until  # a picture of the links was rejected (`_reject`)
        if vetoed:
            slow = {}
        if self.emit:
            for link in sorted(set(slow) ^ self._slow):
                est = self.table.links.get(link)
                self.emit("link_congestion", link=f"{link[0]}:{link[1]}", congested=link in slow, seq=self.seq,
                          rate_Bps=est.rate if est else None, reference_Bps=fleet)
        if slow and not self._slow:  # a link got slow: the duel's times were of other links (and the
            self.duel.forget()  # paced ring that called the probe ran at the slow hop's pace): afresh after
            self.depth.forget()
        self._slow = set(slow)
        # a rank is squeezed once a slow link of its reads under the bar, and stays so while a link of its
        # is slow: squeezed readings are high by the codec's share (`_Wire.settle`), and on 8 ranks sharing
        # 2 cores they crossed the bar every other collective
        self._squeeze = {r for (_, r), rate in slow.items() if rate < self.squeeze_below_Bps or r in self._squeeze}
        self._origin = (self._origin or set(slow)) if slow else set()
        # shared links are planned around only once the direct exchange beat the ring by time (comm/duel.py):
        # readings alone flagged healthy links as shared on 8 ranks sharing 2 cores (stop 51)
        contended = [] if slow or vetoed or not self._exchange_won() else self.contended(fleet)
        self._contended = set(contended)
        rates = self._rates({**slow, **{k: self._share(k, fleet) for k in contended}}, fleet)
        ref = max(rates.up + rates.down)
        key = (tuple(round(x / ref * 20) for x in rates.up + rates.down), bool(contended), tuple(sorted(self._squeeze)))
        known, chosen, current = self._sizes.get(nbytes, (None, None, None))
        if known == key:
            self.plan = self._reference(current, nbytes)
            return
        # another job's stream shares a link: only the direct exchange, whose flows spread over it
        # (a plan chosen among other kinds is no `current` to keep: the choice starts afresh); nothing
        # to plan around: the ring, paced (the model sees no flow counts: on 8 ranks it scored the
        # direct exchange, N-1 flows per link, faster at 16-64 MB, and it ran 1.2x the paced ring)
        kinds = ("pipelined",) if contended else None if slow else ("ring",)
        prior = chosen if known is not None and known[1] == key[1] else None
        # around shared links, the duel's exchange's pieces: the model's deeper pipelines lost on 8 ranks (stop 51)
        chosen, predicted = self._choose(prior, rates, nbytes, key, kinds, pieces=planner.pieces_for(nbytes)
                                         if contended else None)
        plan = chosen if slow or contended else planner.paced(chosen, nbytes)  # nothing to plan around: paced
        plan = _squeezed(plan, self._squeeze)
        # a size's first plan is an event only when made around slow links (not a mere size change)
        previous = current if current is not None else (self.plan if self._slow else None)
        run = self._reference(plan, nbytes)
        shown, before = self._winner_of(plan, nbytes), previous and self._winner_of(previous, nbytes)
        if self.emit and previous is not None and shown != before:
            self.emit("collective_plan", seq=self.seq + 1, plan=shown.to_json(), previous=before.to_json(),
                      predicted_s=predicted, congested=[f"{k}:{r}" for k, r in sorted(self._slow)],
                      contended=[f"{k}:{r}" for k, r in contended], bytes=nbytes, after_paced_ring=run != plan)
        self._sizes[nbytes] = (key, chosen, plan)
        self.plan = run

    def _choose(self, prior: Pattern | None, rates: planner.Rates, nbytes: int, key: tuple,
                kinds: tuple[str, ...] | None, pieces: int | None) -> tuple[Pattern, float]:
        """The planner's choice, once per picture of the links (`key`), size, kinds and prior: readings
        that wobble across a step of the key bring back pictures seen before, and on 8 ranks sharing
        2 cores one choice took 30-90 ms of a collective's wall time (stop 53)."""
        memo = (key, nbytes, kinds, pieces, prior)
        if memo not in self._choices:
            self._planned = True
            if len(self._choices) >= CHOICES_KEPT:
                self._choices.clear()
            self._choices[memo] = planner.choose(prior, rates, nbytes, min_gain=self.min_gain, kinds=kinds,
                                                 pieces=pieces)
        return self._choices[memo]

    def _reference(self, plan: Pattern, nbytes: int) -> Pattern:
        """`plan`, or the paced even ring while `plan` is made around flagged links and not yet trusted.
        At a learned size where the paced ring never ran, that ring runs first: `_judge` weighs a plan's
        first runs against the even ring run just before it, and the ring to beat is the paced one (what
        runs with nothing to plan around). Before, the first probe, unpaced and the job's first
        collective (cold), was the yardstick: on 8 ranks sharing 2 cores a split made from it around
        links misread as shared ran no slower than it, stayed, and ran 1.2-1.6x gloo's time at 1-16 MB
        (docs/design.md, stop 45). Sizes under `learn_bytes` are never judged (their times are not
        shared): they take a plan around flagged links only once a plan around the same links passed
        `_judge` at a learned size; before, 1 and 4 MB ran a split around misread links between its
        two judged runs at up to 1.5x gloo's time (docs/design.md, stop 46). With no learned size at
        all there is nothing to judge by, and the plan runs at once."""
        if _even_ring(plan):
            return plan
        if nbytes < self.learn_bytes:
            if not self._last or self._flags() == self._passed or self._small_duels():
                return plan
        elif nbytes in self._ring_s:
            return plan
        return planner.paced(Pattern.static_ring(self.world), nbytes)


def _squeezed(plan: Pattern, ranks: set[int]) -> Pattern:
    """A direct exchange around slow links, compressing every transfer of `ranks` (comm/squeeze.py):
    the slow rank's own bytes bound the plan, and its CPU is idle."""
    return dataclasses.replace(plan, squeeze=tuple(sorted(ranks))) if plan.kind == "pipelined" and ranks else plan


def _at_depth(plan: Pattern, arm: str) -> Pattern:
    """`plan` at the depth duel's `arm`: its own pieces ("model"), or half of them."""
    return plan if arm == DEPTHS[0] else dataclasses.replace(plan, pieces=max(1, plan.pieces // 2))


def _paced_even_ring(p: Pattern) -> bool:
    """What runs with nothing planned around, and the duel's ring arm."""
    return _even_ring(p) and p.window > 0


def _even_ring(p: Pattern) -> bool:
    """The ring with nothing planned around: rank order, even chunks (paced, or unpaced as a probe)."""
    return p.kind == "ring" and len(set(p.split)) == 1 and p.order == tuple(range(len(p.order)))


def for_comm(comm, mode: str, *, emit: Emit | None = None,
             interrupted: Callable[[], bool] | None = None) -> AdaptiveAllreduce:
    """The all-reduce of `mode` (one of MODES) for a generation's `Comm` (group.py)."""
    return AdaptiveAllreduce(comm.pg, rank=comm.rank, world=comm.world, timeout_s=comm.timeout_s, mode=mode,
                             emit=emit, interrupted=interrupted, abort=comm.drop_links)

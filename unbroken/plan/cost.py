"""Step time and memory per strategy, from a model's profile and a measured topology; the choice.

Step time = the step's compute and collectives laid out on two queues (`plan.pipeline`),
plus the optimizer (over the shard where it is sharded) and the framework's own work per
step (the profile's world-1 step minus its forward, backward and optimizer). A collective's
CPU work (the topology's `cpu_block`, where a rank has under 2 cores) also occupies the
compute queue: overlap cannot hide it. Collectives:

    ddp    gradient all-reduce in DDP's buckets (1 MiB first, then 25 MiB), each issued when
           backward has produced its gradients
    zero1  ddp's all-reduce, then each parameter broadcast from the rank that owns it
    zero2  per unit: all-gather before its forward; reduce-scatter after its backward
    zero3  zero2 plus the all-gather again before each unit's backward (prefetched one ahead;
           the root stays gathered from forward to backward)

unbroken's own zero3 (`schedule="unbroken"`, what `--strategy auto` predicts it with) gathers
as zero3 above but sums the gradient in one reduce-scatter after backward (as its zero2 does:
the same reduction, hence the same bits), and holds the whole local gradient until then.

Memory per rank (fp32, Adam's two moments; P = 4 bytes x parameters, N ranks): ddp 4P,
zero1 2P + 2P/N, zero2 P + 3P/N, zero3 4P/N as state; plus transients (DDP's bucket copy P,
zero2's unsharded parameters, zero3's two largest units), the activations, and unbroken's
protection memory when asked for (`protection_bytes`). unbroken's zero3: 4P/N as state plus the
local gradient (P) as state, its two largest units' parameters as transient.
"""
from __future__ import annotations

import dataclasses
import math

from unbroken.plan.pipeline import Pipeline
from unbroken.plan.profile import ModelProfile
from unbroken.plan.topology import Topology

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
FIRST_BUCKET_BYTES, BUCKET_BYTES = 1 << 20, 25 << 20
CPU_WORK = " (its CPU work)"  # the suffix of a collective's CPU share on the compute queue


class PlanError(ValueError):
    """The plan cannot be made as asked (the message names the problem and the fix)."""


@dataclasses.dataclass(frozen=True)
class Prediction:
    strategy: str
    step_s: float
    compute_s: float     # forward + backward + optimizer + framework overhead
    comm_s: float        # every collective, as if alone
    exposed_comm_s: float  # what overlap did not hide
    state_bytes: int
    peak_bytes: int      # state + transients + activations (+ protection when given)

    def fits(self, limit_bytes: float | None) -> bool:
        return limit_bytes is None or self.peak_bytes <= limit_bytes


def ddp_buckets(tensor_elems: tuple[int, ...]) -> list[int]:
    """Bucket sizes in bytes, in the order backward fills them (parameters in reverse)."""
    buckets, cur, cap = [], 0, FIRST_BUCKET_BYTES
    for n in reversed(tensor_elems):
        if cur and cur + 4 * n > cap:
            buckets.append(cur)
            cur, cap = 0, BUCKET_BYTES
        cur += 4 * n
    if cur:
        buckets.append(cur)
    return buckets


def _collective(pipe: Pipeline, topo: Topology, name: str, collective: str, nbytes: float, after: list[int]) -> int:
    """A collective on the comm queue and, beside it, the CPU work it takes from this rank's compute
    (topology's cpu_block: on a host where a rank has under 2 cores, a loopback collective is CPU
    work that overlap cannot hide). Returns the collective's task."""
    secs = topo.seconds(collective, nbytes)
    task = pipe.add(name, "comm", secs, after=after)
    block = topo.cpu_block(collective, nbytes)
    if block > 0:
        pipe.add(f"{name}{CPU_WORK}", "compute", block * secs, after=after)
    return task


def _gradient_allreduce(pipe: Pipeline, prof: ModelProfile, topo: Topology) -> int:
    """Backward as compute slices, each bucket's all-reduce after the slice that completes it.
    Returns the last all-reduce's task."""
    total, last = 4 * prof.params, -1
    for b in ddp_buckets(prof.tensor_elems):
        piece = pipe.add("backward", "compute", prof.backward_s * b / total)
        last = _collective(pipe, topo, "all-reduce", "all_reduce", b, [piece])
    return last


def _fsdp(pipe: Pipeline, prof: ModelProfile, topo: Topology, *, regather: bool, scatter_after: bool = False) -> None:
    units = list(prof.units)
    order = [units[-1], *units[:-1]]  # the root's all-gather comes first (it wraps the blocks)
    prev = None
    for u in order:  # forward: each unit gathered (synchronously) before it runs
        g = _collective(pipe, topo, f"all-gather {u.name}", "all_gather", 4 * u.params,
                        [prev] if prev is not None else [])
        prev = pipe.add(f"forward {u.name}", "compute", prof.forward_s * u.flop_share, after=[g])
    back = list(reversed(units[:-1]))  # blocks, last first; the root's part is computed last
    gathers: dict[str, int] = {}
    if regather and back:
        gathers[back[0].name] = _collective(pipe, topo, f"re-gather {back[0].name}", "all_gather",
                                            4 * back[0].params, [prev])
    for i, u in enumerate([*back, units[-1]]):
        if regather and i + 1 < len(back):  # prefetch the next unit's gather before computing this one
            nxt = back[i + 1]
            gathers[nxt.name] = _collective(pipe, topo, f"re-gather {nxt.name}", "all_gather", 4 * nxt.params,
                                            [prev])
        deps = [prev] + ([gathers[u.name]] if u.name in gathers else [])
        prev = pipe.add(f"backward {u.name}", "compute", prof.backward_s * u.flop_share, after=deps)
        if not scatter_after:
            _collective(pipe, topo, f"reduce-scatter {u.name}", "reduce_scatter", 4 * u.params, [prev])
    if scatter_after:  # one reduce-scatter of the whole gradient once backward has ended
        _collective(pipe, topo, "reduce-scatter", "reduce_scatter", 4 * prof.params, [prev])


def predict(strategy: str, prof: ModelProfile, topo: Topology, *, protection_bytes: int = 0,
            schedule: str = "fsdp") -> Prediction:
    """Step time and memory of `strategy` on `topo` (whose world size is the job's); schedule
    "unbroken": unbroken's own zero3 (module docstring), else the native peers' schedules."""
    if strategy not in STRATEGIES:
        raise PlanError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)} or auto")
    p = topo.world
    if p > 1 and strategy != "ddp" and prof.params < p:
        raise PlanError(f"{strategy} cannot shard {prof.params} parameters over {p} ranks; use ddp or fewer ranks")
    sharded_opt = strategy != "ddp"
    opt = prof.optimizer_s / p if sharded_opt else prof.optimizer_s
    overhead = max(0.0, prof.solo_step_s[strategy] - prof.forward_s - prof.backward_s - prof.optimizer_s)
    pipe = Pipeline()
    if strategy in ("ddp", "zero1"):
        pipe.add("forward", "compute", prof.forward_s)
        reduced = _gradient_allreduce(pipe, prof, topo)
        if strategy == "zero1":
            last = pipe.add("optimizer shard", "compute", opt, after=[reduced])
            for n in prof.tensor_elems:
                _collective(pipe, topo, "broadcast", "broadcast", 4 * n, [last])
    else:
        _fsdp(pipe, prof, topo, regather=strategy == "zero3", scatter_after=schedule == "unbroken")
    span = pipe.makespan()
    model_compute = sum(t.seconds for t in pipe.tasks if t.resource == "compute" and not t.name.endswith(CPU_WORK))
    compute = model_compute + overhead + (0.0 if strategy == "zero1" else opt)
    step = span + overhead + (0.0 if strategy == "zero1" else opt)
    state, peak = memory(strategy, prof, p, schedule=schedule)
    return Prediction(strategy=strategy, step_s=step, compute_s=compute, comm_s=pipe.busy("comm"),
                      exposed_comm_s=max(0.0, step - compute), state_bytes=state,
                      peak_bytes=peak + protection_bytes)


def memory(strategy: str, prof: ModelProfile, world: int, *, schedule: str = "fsdp") -> tuple[int, int]:
    """(state bytes, peak bytes) per rank: parameters, gradients, Adam's moments, transients, activations."""
    P, n = 4 * prof.params, world
    shard = lambda x: math.ceil(x / n)  # noqa: E731
    largest = sorted((4 * u.params for u in prof.units), reverse=True)
    if strategy == "ddp":
        state, transient = 4 * P, P  # DDP's buckets are a copy of the gradients
    elif strategy == "zero1":
        state, transient = 2 * P + shard(2 * P), P
    elif strategy == "zero2":
        state, transient = P + shard(3 * P), largest[0]  # a unit's unsharded gradient before its reduce-scatter
    elif schedule == "unbroken":  # + the whole local gradient; two units' parameters
        state, transient = P + shard(4 * P), sum(largest[:2])
    else:
        state, transient = shard(4 * P), sum(largest[:2]) * 2  # current + prefetched unit, parameters and gradients
    return state, state + transient + prof.activation_bytes


def choose(predictions: list[Prediction], limit_bytes: float | None) -> Prediction:
    """The fastest prediction that fits; PlanError naming the smallest need when none does."""
    fitting = [p for p in predictions if p.fits(limit_bytes)]
    if not fitting:
        least = min(predictions, key=lambda p: p.peak_bytes)
        raise PlanError(f"no strategy fits in {limit_bytes / 1e9:.3g} GB per rank; the smallest is {least.strategy} "
                        f"at {least.peak_bytes / 1e9:.3g} GB: raise --memory-limit or use more ranks")
    return min(fitting, key=lambda p: p.step_s)

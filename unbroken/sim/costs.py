"""Cost models shared by the policies: the workload, job restart, scaling laws, Young/Daly.

Every default here is an assumption with a stated origin (docs/simulator.md); measured
values replace them through sim/calibrate.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from unbroken.sim.errors import need

Phases = tuple[tuple[str, float], ...]


def _positive(owner: str, **values: float) -> None:
    for name, v in values.items():
        need(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0,
             f"{owner}.{name} must be a number > 0, got {v!r}")


def _non_negative(owner: str, **values: float) -> None:
    for name, v in values.items():
        need(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0,
             f"{owner}.{name} must be a number >= 0, got {v!r}")


def log2_scale(n: int) -> float:
    """The depth of a tree over n participants; costs that grow like log N use this."""
    return max(1.0, math.log2(max(n, 1)))


@dataclass(frozen=True, kw_only=True)
class Workload:
    """What one GPU carries and moves.

    state_gb: per-GPU shard of weights + optimizer state (Llama 3 report: checkpoints
    of 1 MB to 4 GB per GPU). storage_gbps: per-GPU share of persistent storage
    bandwidth (Llama 3: 2 TB/s sustained over 16,384 GPUs = 0.122 GB/s). net_gbps:
    per-GPU back-end bandwidth usable for recovery traffic (a quarter of a 400 Gb/s NIC).
    overlap: fraction of the asynchronous persistent (tier-2) save hidden behind compute.
    Per-step protection copies (in-memory copies, parity updates) are not modelled as saves:
    they are in each policy's failure-free `overhead` (sim/policies.py).
    """

    step_s: float = 10.0
    state_gb: float = 4.0
    storage_gbps: float = 0.122
    net_gbps: float = 12.5
    overlap: float = 0.9

    def __post_init__(self) -> None:
        _positive("workload", step_s=self.step_s, state_gb=self.state_gb,
                  storage_gbps=self.storage_gbps, net_gbps=self.net_gbps)
        need(isinstance(self.overlap, (int, float)) and 0 <= self.overlap < 1,
             f"workload.overlap must be in [0, 1), got {self.overlap!r}")

    @property
    def storage_s(self) -> float:
        """Seconds to write or read this GPU's shard to/from persistent storage."""
        return self.state_gb / self.storage_gbps

    @property
    def network_s(self) -> float:
        """Seconds to move this GPU's shard once over the network."""
        return self.state_gb / self.net_gbps

    def background_s(self, copy_s: float) -> float:
        """Blocking share of a copy that otherwise runs behind compute."""
        return (1.0 - self.overlap) * copy_s


@dataclass(frozen=True, kw_only=True)
class JobRestart:
    """Stop the whole job and start it again: what checkpoint-restart pays per failure.

    detect_s: the launcher sees a dead worker or an NCCL abort. reschedule_s: requeue,
    health checks and swapping the bad node (the `decide` phase). relaunch_per_log2_s:
    process launch + communicator init, growing like log2(GPUs) (the `regroup` phase).
    The `rebuild` phase is loading state, given by the caller.
    """

    detect_s: float = 60.0
    reschedule_s: float = 120.0
    relaunch_per_log2_s: float = 4.0

    def __post_init__(self) -> None:
        _non_negative("restart", detect_s=self.detect_s, reschedule_s=self.reschedule_s,
                      relaunch_per_log2_s=self.relaunch_per_log2_s)

    def phases(self, gpus: int, load_s: float) -> Phases:
        return (("detect", self.detect_s), ("decide", self.reschedule_s),
                ("regroup", self.relaunch_per_log2_s * log2_scale(gpus)), ("rebuild", load_s))


def young_interval(save_s: float, mttf_s: float) -> float:
    """Young (1974): compute time between checkpoints, sqrt(2 C M)."""
    return math.sqrt(2.0 * save_s * mttf_s)


def daly_interval(save_s: float, mttf_s: float) -> float:
    """Daly (2006) higher-order optimum compute time between checkpoints."""
    if save_s >= 2.0 * mttf_s:
        return mttf_s
    x = save_s / (2.0 * mttf_s)
    return math.sqrt(2.0 * save_s * mttf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - save_s


def ettr_checkpoint_restart(interval_s: float, save_s: float, restart_s: float, mttf_s: float) -> float:
    """Exact expected ETTR of checkpoint-restart under exponential failures.

    Failures may strike during compute, checkpoint or restart (a restart hit by a failure
    starts over). Expected wall time per saved segment (Daly 2006):
    E[T] = M e^(R/M) (e^((tau + C)/M) - 1), so ETTR = tau / E[T].
    """
    lam = 1.0 / mttf_s
    return interval_s * lam * math.exp(-lam * restart_s) / math.expm1(lam * (interval_s + save_s))

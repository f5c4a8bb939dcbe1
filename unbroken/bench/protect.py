"""What protection costs: parity encode bandwidth, per-step overhead, rebuild time, memory.

Step overhead is measured on the demo job itself, with and without tier-1 parity (and with
tier-2 async checkpoints added), same steps and seed, run back to back interleaved
(A B C A B C ...) so that the shared machine's drift hits every variant alike.
"""
from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from unbroken.bench import rebuild
from unbroken.bench.common import SKIP_STEPS, fmt, goal, job_events, run_job, steady_step_times
from unbroken.config import RunConfig
from unbroken.protect.codes import measure_encode_bandwidth

GOAL_ENCODE_VS_MEMCPY = 0.5
GOAL_STEP_OVERHEAD = 0.02
TIER2_EVERY = 10

VARIANTS: dict[str, dict] = {
    "none": {"tier1": False},                                  # zero1, no protection
    "tier1": {},                                               # the default: tier-1 parity
    "tier1+tier2": {"checkpoint_every": TIER2_EVERY},          # plus async persistent checkpoints
}


def overhead(samples: dict[str, list[float]], variant: str, base: str = "none") -> dict:
    """Per-step time of `variant` relative to `base`, by median (typical step) and mean (amortized)."""
    a, b = samples[variant], samples[base]
    if not a or not b:
        raise ValueError(f"no step samples for {variant if not a else base!r}; run more than {SKIP_STEPS} steps")
    return {"median": statistics.median(a) / statistics.median(b) - 1,
            "mean": statistics.fmean(a) / statistics.fmean(b) - 1}


def measure_step_overhead(*, steps: int, rounds: int, console: Console) -> dict:
    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
    per_run: list[dict] = []
    shas: dict[str, set] = {v: set() for v in VARIANTS}
    protected = 0
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-protect-") as tmp:
        for rnd in range(rounds):
            for name, changes in VARIANTS.items():
                console.log(f"protect: step overhead, round {rnd + 1}/{rounds}, variant {name}")
                run_dir = Path(tmp) / f"{name.replace('+', '_')}-{rnd}"
                s = run_job(RunConfig(steps=steps, **changes), run_dir, console=console)
                if not s["ok"]:
                    raise RuntimeError(f"overhead run {name} (round {rnd}) did not finish; see {run_dir}")
                events = job_events(run_dir)
                times = steady_step_times(events)
                built = [e.fields["bytes"] for e in events if e.kind == "parity_built"]
                if built:  # parity is 1/(k-1) of the protected bytes
                    protected = built[0] * (RunConfig().effective_parity_group - 1)
                samples[name] += times
                shas[name].add(s["weights_sha256"])
                per_run.append({"variant": name, "round": rnd, "median_step_s": statistics.median(times),
                                "wall_s": s["wall_s"]})
    return {"steps": steps, "rounds": rounds, "samples": samples, "runs": per_run, "protected_bytes": protected,
            "weights_sha256": {v: sorted(x) for v, x in shas.items()},
            # every variant reproduces itself bitwise; across variants the flat layout (padding to
            # whole parity windows) changes the all-reduce's summation order, so bits may differ
            "weights_reproducible": all(len(x) == 1 for x in shas.values()),
            "weights_equal_across_variants": len(set.union(*shas.values())) == 1}


def protect_result(encode: dict, steps: dict, rb: dict, rb_demo: dict) -> dict:
    """The JSON schema of protect.json from the measurements (rb: 64 MB/rank; rb_demo: the demo's state size)."""
    t1, t2 = overhead(steps["samples"], "tier1"), overhead(steps["samples"], "tier1+tier2")
    med = {v: statistics.median(x) for v, x in steps["samples"].items()}
    return {
        "encode_gbps": encode["encode_gbps"], "memcpy_gbps": encode["memcpy_gbps"],
        "encode_vs_memcpy": encode["encode_vs_memcpy"], "encode_bytes": encode["nbytes"],
        "step_overhead": t1["median"], "step_overhead_mean": t1["mean"],
        "step_overhead_tier2": t2["median"], "step_overhead_tier2_mean": t2["mean"],
        "tier2_checkpoint_every": TIER2_EVERY,
        "median_step_s": med, "overhead_steps": steps["steps"], "overhead_rounds": steps["rounds"],
        "overhead_runs": steps["runs"], "weights_equal_across_variants": steps["weights_equal_across_variants"],
        "weights_reproducible": steps["weights_reproducible"], "weights_sha256": steps["weights_sha256"],
        # a low-noise cross-check of step_overhead: the parity work of one step, timed on its own
        # at the demo's state size, over the unprotected step time
        "demo_protected_bytes_per_rank": rb_demo["bytes_protected"], "demo_delta_update_s": rb_demo["delta_update_s"],
        "demo_delta_vs_allreduce": rb_demo["delta_vs_allreduce"],
        "step_overhead_estimate": rb_demo["delta_update_s"] / med["none"],
        "rebuild_s": rb["rebuild_s"], "rebuild_gbps": rb["rebuild_gbps"], "rebuild_phases": rb["rebuild_phases"],
        "rebuild_verified_bitwise": rb["verified_bitwise"], "rebuild_world": rb["world"],
        "protected_bytes_per_rank": rb["bytes_protected"], "parity_bytes_per_rank": rb["parity_bytes"],
        "memory_overhead": rb["memory_overhead"], "memory_overhead_expected": 1 / (rb["world"] - 1),
        "parity_build_s": rb["build_s"],
        "delta_update_s": rb["delta_update_s"], "delta_stage_s": rb["delta_stage_s"],
        "delta_collectives_s": rb["delta_collectives_s"], "delta_windows": rb["delta_windows"],
        "allreduce_same_bytes_s": rb["allreduce_same_bytes_s"], "delta_vs_allreduce": rb["delta_vs_allreduce"],
        "goals": {"encode_vs_memcpy": GOAL_ENCODE_VS_MEMCPY, "step_overhead": GOAL_STEP_OVERHEAD},
    }


def measure(*, quick: bool, console: Console | None = None) -> dict:
    console = console or Console(stderr=True)
    console.log("protect: encode bandwidth (64 MB)")
    encode = measure_encode_bandwidth(64 << 20, 2 if quick else 5)
    steps = measure_step_overhead(steps=12 if quick else 24, rounds=1 if quick else 2, console=console)
    nbytes = (16 << 20) if quick else (64 << 20)
    console.log(f"protect: tier-1 rebuild and delta update, 4 processes x {nbytes >> 20} MB")
    rb = rebuild.run_processes(nbytes=nbytes, world=4, repeats=2 if quick else 3)
    console.log(f"protect: delta update at the demo's state size ({steps['protected_bytes'] / 1e6:.1f} MB)")
    rb_demo = rebuild.run_processes(nbytes=steps["protected_bytes"], world=4, repeats=3 if quick else 5)
    return protect_result(encode, steps, rb, rb_demo)


def table(r: dict) -> Table:
    t = Table(title="protection cost (one invocation; shared 2-core machine)")
    for col in ("measure", "value", "goal", ""):
        t.add_column(col)
    mb = r["protected_bytes_per_rank"] / 2**20
    rows = [
        ("XOR encode", f"{r['encode_gbps']:.2f} GB/s", "", ""),
        ("memcpy", f"{r['memcpy_gbps']:.2f} GB/s", "", ""),
        ("encode / memcpy", f"{r['encode_vs_memcpy']:.2f}", f">= {GOAL_ENCODE_VS_MEMCPY:.0%}",
         goal(r["encode_vs_memcpy"] >= GOAL_ENCODE_VS_MEMCPY)),
        ("step overhead, tier 1 (median)", f"{r['step_overhead']:+.2%}", f"<= {GOAL_STEP_OVERHEAD:.0%}",
         goal(r["step_overhead"] <= GOAL_STEP_OVERHEAD)),
        ("step overhead, tier 1 (mean)", f"{r['step_overhead_mean']:+.2%}", "", ""),
        ("step overhead, tier 1, from its parts", f"{r['step_overhead_estimate']:+.2%}", f"<= {GOAL_STEP_OVERHEAD:.0%}",
         goal(r["step_overhead_estimate"] <= GOAL_STEP_OVERHEAD)),
        (f"  delta update at demo size ({r['demo_protected_bytes_per_rank'] / 1e6:.1f} MB)",
         f"{r['demo_delta_update_s']:.3f} s", "", f"{r['demo_delta_vs_allreduce']:.1f}x an all-reduce of it"),
        (f"step overhead, tier 1 + tier 2 every {TIER2_EVERY} (median)", f"{r['step_overhead_tier2']:+.2%}", "", ""),
        (f"step overhead, tier 1 + tier 2 every {TIER2_EVERY} (mean)", f"{r['step_overhead_tier2_mean']:+.2%}", "", ""),
        ("median step s: none / tier1 / +tier2",
         " / ".join(fmt(r["median_step_s"][v]) for v in VARIANTS), "", ""),
        ("each variant bitwise reproducible across rounds", str(r["weights_reproducible"]), "", ""),
        ("same weights with and without protection", str(r["weights_equal_across_variants"]), "", ""),
        (f"rebuild one rank ({r['rebuild_world']} ranks x {mb:.0f} MB)", f"{r['rebuild_s']:.3f} s",
         "", f"{r['rebuild_gbps']:.2f} GB/s, bitwise ok: {r['rebuild_verified_bitwise']}"),
        ("memory overhead (parity / protected)", f"{r['memory_overhead']:.4f}",
         f"1/(k-1) = {r['memory_overhead_expected']:.4f}", ""),
        (f"full delta update ({r['delta_windows']} windows)", f"{r['delta_update_s']:.3f} s", "",
         f"stage {r['delta_stage_s']:.3f} s + collectives {r['delta_collectives_s']:.3f} s"),
        (f"gloo all-reduce of {mb:.0f} MB", f"{r['allreduce_same_bytes_s']:.3f} s", "", ""),
        ("delta update / all-reduce", f"{r['delta_vs_allreduce']:.2f}x", "", ""),
    ]
    for row in rows:
        t.add_row(*row)
    return t

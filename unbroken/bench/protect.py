"""What tier-1 parity costs on its own: encode bandwidth, rebuild time of one rank, memory.

The per-step overhead of protection is not measured here: `unbroken bench overhead`
(`overhead.py`) measures it end to end against the native PyTorch peers (interleaved
rounds, mean step time, bootstrap CI). This benchmark keeps what only it measures: the
XOR encode against memcpy, the rebuild of one lost rank (bitwise checked), one full delta
update against an all-reduce of the same bytes, and the parity memory overhead.
"""
from __future__ import annotations

from rich.console import Console
from rich.table import Table

from unbroken.bench import rebuild
from unbroken.bench.common import goal
from unbroken.protect.codes import measure_encode_bandwidth

GOAL_ENCODE_VS_MEMCPY = 0.5


def protect_result(encode: dict, rb: dict) -> dict:
    """The JSON schema of protect.json from the encode measurement and the rebuild run (rb)."""
    return {
        "encode_gbps": encode["encode_gbps"], "memcpy_gbps": encode["memcpy_gbps"],
        "encode_vs_memcpy": encode["encode_vs_memcpy"], "encode_bytes": encode["nbytes"],
        "rebuild_s": rb["rebuild_s"], "rebuild_gbps": rb["rebuild_gbps"], "rebuild_phases": rb["rebuild_phases"],
        "rebuild_verified_bitwise": rb["verified_bitwise"], "rebuild_world": rb["world"],
        "protected_bytes_per_rank": rb["bytes_protected"], "parity_bytes_per_rank": rb["parity_bytes"],
        "memory_overhead": rb["memory_overhead"], "memory_overhead_expected": 1 / (rb["world"] - 1),
        "parity_build_s": rb["build_s"],
        "delta_update_s": rb["delta_update_s"], "delta_stage_s": rb["delta_stage_s"],
        "delta_collectives_s": rb["delta_collectives_s"], "delta_windows": rb["delta_windows"],
        "allreduce_same_bytes_s": rb["allreduce_same_bytes_s"], "delta_vs_allreduce": rb["delta_vs_allreduce"],
        "goals": {"encode_vs_memcpy": GOAL_ENCODE_VS_MEMCPY},
    }


def measure(*, quick: bool, console: Console | None = None) -> dict:
    console = console or Console(stderr=True)
    console.log("protect: encode bandwidth (64 MB)")
    encode = measure_encode_bandwidth(64 << 20, 2 if quick else 5)
    nbytes = (16 << 20) if quick else (64 << 20)
    console.log(f"protect: tier-1 rebuild and delta update, 4 processes x {nbytes >> 20} MB")
    rb = rebuild.run_processes(nbytes=nbytes, world=4, repeats=2 if quick else 3)
    return protect_result(encode, rb)


def _rows(r: dict) -> list[tuple[str, str, str, str]]:
    mb = r["protected_bytes_per_rank"] / 2**20
    return [
        ("XOR encode", f"{r['encode_gbps']:.2f} GB/s", "", ""),
        ("memcpy", f"{r['memcpy_gbps']:.2f} GB/s", "", ""),
        ("encode / memcpy", f"{r['encode_vs_memcpy']:.2f}", f">= {GOAL_ENCODE_VS_MEMCPY:.0%}",
         goal(r["encode_vs_memcpy"] >= GOAL_ENCODE_VS_MEMCPY)),
        (f"rebuild one rank ({r['rebuild_world']} ranks x {mb:.0f} MB)", f"{r['rebuild_s']:.3f} s",
         "", f"{r['rebuild_gbps']:.2f} GB/s, bitwise ok: {r['rebuild_verified_bitwise']}"),
        ("memory overhead (parity / protected)", f"{r['memory_overhead']:.4f}",
         f"1/(k-1) = {r['memory_overhead_expected']:.4f}", ""),
        (f"full delta update ({r['delta_windows']} windows)", f"{r['delta_update_s']:.3f} s", "",
         f"stage {r['delta_stage_s']:.3f} s + collectives {r['delta_collectives_s']:.3f} s"),
        (f"gloo all-reduce of {mb:.0f} MB", f"{r['allreduce_same_bytes_s']:.3f} s", "", ""),
        ("delta update / all-reduce", f"{r['delta_vs_allreduce']:.2f}x", "", ""),
    ]


def table(r: dict) -> Table:
    t = Table(title="protection cost (one invocation; shared 2-core machine; step overhead: bench overhead)")
    for col in ("measure", "value", "goal", ""):
        t.add_column(col)
    for row in _rows(r):
        t.add_row(*row)
    return t

"""`unbroken bench strategies`' arithmetic: ratios, the memory allowance, bytes per step."""
from __future__ import annotations

import pytest

from unbroken.bench import strategies as sb
from unbroken.bench.common import SKIP_STEPS


def _run(step_s, rss, tensors, tx, protection=0):
    return {"step_s": [9.0] * SKIP_STEPS + step_s, "peak_rss_bytes": rss, "tensor_bytes": tensors, "tx_bytes": tx,
            "protection_bytes": protection, "protection_parts": {"parity": protection}}


def test_throughput_is_native_over_unbroken_and_memory_allows_the_protection():
    pair = {"native": [_run([1.0, 1.0], 1000, 100, 800)],
            "unbroken": [_run([2.0, 2.0], 1100, 300, 1600, protection=100)]}
    r = sb.pair_result(pair, steps=8)
    assert r["ratio"] == pytest.approx(0.5)  # warm-up steps dropped on both sides
    assert r["memory_ratio"] == pytest.approx(1.1) and r["memory_ratio_allowed"] == pytest.approx(1.15)
    assert r["tensor_ratio"] == pytest.approx(3.0) and r["protection_parts"] == {"parity": 100}
    assert r["bytes_per_step"] == {"native": 100.0, "unbroken": 200.0}
    assert not r["goal_met"]  # slower than 0.98x


def test_the_goal_needs_both_speed_and_memory_and_uncounted_bytes_stay_null():
    fast = {"native": [_run([1.0], 1000, 100, None)], "unbroken": [_run([1.0], 1040, 100, 10)]}
    r = sb.pair_result(fast, steps=4)
    assert r["goal_met"] and r["bytes_per_step"]["native"] is None
    heavy = {"native": [_run([1.0], 1000, 100, 1)], "unbroken": [_run([1.0], 1100, 100, 1)]}
    assert not sb.pair_result(heavy, steps=4)["goal_met"]  # 1.10 > 1.05 with no protection memory


def test_zero3_runs_next_to_fsdp2_with_reshard_after_forward_and_is_built():
    from unbroken.bench import native_job
    from unbroken.bench.baseline_job import FSDP

    assert "zero3" in sb.STRATEGIES
    peer = native_job.peer_for("zero3")
    assert not peer["fallback"] and FSDP[peer["optimizer"]] is True  # reshard_after_forward=True
    assert FSDP[native_job.peer_for("zero2")["optimizer"]] is False
    one = {"native": [_run([1.0], 1000, 100, 1)], "unbroken": [_run([1.0], 1000, 100, 1)]}
    res = sb.result({"zero3": one}, steps=4, rounds=1, world=4)
    assert "zero3" not in res["not_built"] and res["peer"]["zero3"].endswith("reshard_after_forward=True) + AdamW")


def test_fsdp_is_built_and_runs_next_to_fsdp2_with_reshard_after_forward():
    from unbroken.bench import native_job
    from unbroken.bench.baseline_job import FSDP

    assert "fsdp" in sb.STRATEGIES
    peer = native_job.peer_for("fsdp")
    assert not peer["fallback"] and FSDP[peer["optimizer"]] is True
    one = {"native": [_run([1.0], 1000, 100, 1)], "unbroken": [_run([1.0], 1000, 100, 1)]}
    res = sb.result({"fsdp": one}, steps=4, rounds=1, world=4)
    assert res["not_built"] == {} and res["ratio_vs_native"]["fsdp"] == pytest.approx(1.0)

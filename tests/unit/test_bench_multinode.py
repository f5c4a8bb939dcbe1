"""`unbroken bench multinode`'s arithmetic (bench/multinode.py `result`): efficiency per rank against 1x4, ratios to torchrun."""
import pytest

import json

from unbroken.bench.multinode import SYSTEMS, kept_sections, result


def _cells(tps: dict[str, dict[str, list[float]]]) -> dict:
    return {"1gbit": {lay: {s: [{"tokens_per_s": v, "bytes_on_wire_per_step": 1e6 * i} for i, v in enumerate(vals)]
                            for s, vals in systems.items()} for lay, systems in tps.items()}}


def test_efficiency_is_tokens_per_rank_against_one_node_of_four_and_ratios_are_to_torchrun():
    same = {s: [400.0, 400.0] for s in SYSTEMS}
    res = result(_cells({"1x4": same, "2x2": {**same, "unbroken-zero1": [300.0, 500.0]},
                         "2x4": {s: [600.0, 600.0] for s in SYSTEMS}}), steps=8, rounds=2)
    by = {(r["layout"], r["system"]): r for r in res["rows"]}
    assert by[("1x4", "torchrun-ddp")]["efficiency"] == pytest.approx(1.0)
    assert by[("2x4", "unbroken-ddp")]["efficiency"] == pytest.approx(600 / 8 / 100)  # 8 ranks, 100 tok/s/rank at 1x4
    assert by[("2x2", "unbroken-zero1")]["tokens_per_s"] == pytest.approx(400.0)
    assert by[("2x2", "unbroken-zero1")]["ratio_vs_torchrun_ddp"] == pytest.approx(1.0)
    assert by[("2x4", "unbroken-zero1")]["bytes_on_wire_per_step"] == pytest.approx(0.5e6)
    assert res["efficiency"]["1gbit"]["2x4"]["torchrun-ddp"] == pytest.approx(0.75)
    assert set(res["tokens_per_s"]["1gbit"]) == {"1x4", "2x2", "2x4"}


def test_a_rewrite_keeps_the_regroup_fit_another_benchmark_wrote(tmp_path):
    path = tmp_path / "multinode.json"
    assert kept_sections(path) == {}
    path.write_text(json.dumps({"rows": [], "regroup_fit": {"model": "log2"}, "commit": "x"}))
    assert kept_sections(path) == {"regroup_fit": {"model": "log2"}}

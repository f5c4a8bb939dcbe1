"""bench overlap's arithmetic (cuts, exposed and hidden communication) and its timeline figure."""
from __future__ import annotations

import pytest

from unbroken.bench import overlap as ob


def _rec(step_s, exposed=0.0, compute=0.0, update=0.0, timeline=None):
    return {"step_s": step_s, "exposed_comm_s": exposed, "compute_s": compute, "update_s": update,
            "plan": {"bucket_kb": 256}, "timeline": timeline}


def _timeline(backward_s, buckets):
    return {"step": 3, "backward_s": backward_s, "end_s": 0.5, "buckets": buckets,
            "phases": {"compute_s": 0.3, "allreduce_s": 0.2, "update_s": 0.05}}


def _runs(scale):
    tl = _timeline(0.2, [[0.05, 0.3], [0.1, None]])
    return {"none": [_rec(1.0 * scale, exposed=0.6 * scale, compute=0.3), _rec(1.2 * scale, exposed=0.6 * scale, compute=0.5)],
            "ddp": [_rec(0.9 * scale, update=0.1), _rec(0.9 * scale, update=0.1)],
            "default": [_rec(0.8 * scale, exposed=0.3 * scale, timeline=tl)] * 2,
            "tuned": [{**_rec(0.7 * scale, exposed=0.15 * scale, timeline=tl), "search": {"search_s": scale}},
                      _rec(0.7 * scale, exposed=0.15 * scale, timeline=tl)]}


def test_cuts_take_the_smaller_comm_heavy_config_and_hidden_is_relative_to_none():
    cfg = ob.bench_config(steps=6, quick=True)
    res = ob.result({"loopback": _runs(0.5), "1gbit": _runs(1.0), "200mbit": _runs(2.0)}, steps=6, rounds=2, cfg=cfg)
    c = res["configs"]["200mbit"]
    assert c["step_s"]["none"] == pytest.approx(2.2)
    assert c["cut_vs_none"] == pytest.approx(1 - 1.4 / 2.2) and c["cut_vs_ddp"] == pytest.approx(1 - 1.4 / 1.8)
    assert c["tuned_search"] == {"search_s": 2.0}  # the searching run's table, kept beside the plan
    assert c["hidden"]["tuned"] == pytest.approx(0.75) and c["hidden"]["none"] == pytest.approx(0.0)
    # DDP's exposed time: its step minus none's compute (mean 0.4) and its own update
    assert c["exposed_comm_s"]["ddp"] == pytest.approx(1.8 - 0.4 - 0.1)
    cuts = [res["configs"][k]["cut_vs_none"] for k in ob.COMM_HEAVY]
    assert res["cut_vs_none"] == min(cuts)
    assert res["goals"]["compute_bound_not_slower_than_ddp"] is True
    assert res["goals"]["met_cut_vs_ddp"] == (res["cut_vs_ddp"] >= ob.GOAL_CUT_VS_DDP)


def test_loopback_alone_has_no_comm_heavy_cut_and_the_timeline_is_drawn(tmp_path):
    res = ob.result({"loopback": _runs(1.0)}, steps=6, rounds=2, cfg=ob.bench_config(steps=6, quick=True))
    assert res["cut_vs_none"] is None and res["goals"]["met_cut_vs_none"] is None
    ob.plot_timeline(res, tmp_path / "overlap.png")
    assert (tmp_path / "overlap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ob.table(res)  # renders without the comm-heavy configs

"""--overlap end to end: off vs on give the same bits; a tuned run equals the run given its plan."""
from __future__ import annotations

import json

import pytest

from tests.integration.conftest import run_cli, run_job
from tests.procs import communicate_all

# world 3: gloo's ring sums each element in an order set by its place in the buffer, so with
# three ranks the bucket boundaries matter to the bits (two ranks would hide a difference)
SMALL = ["--n-layer", "2", "--n-embd", "64", "--batch-size", "4", "--steps", "3", "--world-size", "3",
         "--parity-group", "3", "--chunk-kb", "16"]


def _small_buckets(tmp_path) -> str:
    cfg = tmp_path / "buckets.toml"
    cfg.write_text("bucket_kb = 16\n")  # many buckets: the hooks issue them one by one during backward
    return str(cfg)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_overlap_off_gives_the_same_weights_as_on(tmp_path, strategy):
    cfg = _small_buckets(tmp_path)
    on = run_job(tmp_path / "on", *SMALL, "--strategy", strategy, "--config", cfg)
    off = run_job(tmp_path / "off", *SMALL, "--strategy", strategy, "--config", cfg, "--overlap", "off")
    assert on["overlap"]["during_backward"] and not off["overlap"]["during_backward"]
    assert on["weights_sha256"] == off["weights_sha256"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "zero1"])
def test_the_eager_update_applies_chunks_as_buckets_land_and_keeps_the_bits(tmp_path, strategy):
    cfg = tmp_path / "eager.toml"
    cfg.write_text("bucket_kb = 16\ngrad_clip = 0\n")  # no clipping: every step's guess holds
    plan = tmp_path / "eager.json"  # opt-in
    plan.write_text(json.dumps({"format": "unbroken-overlap/1", "plan": {"bucket_kb": 16, "eager_update": True}}))
    five = [a if a != "3" or i != SMALL.index("--steps") + 1 else "5" for i, a in enumerate(SMALL)]
    on = run_job(tmp_path / "on", *five, "--strategy", strategy, "--config", str(cfg), "--overlap", str(plan))
    off = run_job(tmp_path / "off", *five, "--strategy", strategy, "--config", str(cfg), "--overlap", "off")
    events = [json.loads(line) for line in (tmp_path / "on" / "events.jsonl").read_text().splitlines()]
    timeline = next(e["fields"] for e in events if e["kind"] == "overlap_timeline")
    assert 0 < timeline["eager_chunks"] <= timeline["chunks"]
    assert on["overlap"]["eager_update"] and on["weights_sha256"] == off["weights_sha256"]


@pytest.mark.slow
def test_tuned_run_equals_the_run_given_its_plan_and_the_cache_skips_the_search(tmp_path):
    plan = tmp_path / "plan.json"
    tuned = run_job(tmp_path / "tuned", *SMALL, "--strategy", "ddp", "--overlap", str(plan))
    kinds = [json.loads(line)["kind"] for line in (tmp_path / "tuned" / "events.jsonl").read_text().splitlines()]
    assert "overlap_tuned" in kinds and tuned["overlap"]["source"] == "tuned"
    rows = json.loads(plan.read_text())["measured"]["candidates"]
    assert [r["during_backward"] for r in rows].count(False) == 1  # the best buckets, after backward
    cached = run_job(tmp_path / "cached", *SMALL, "--strategy", "ddp", "--overlap", str(plan))
    assert cached["overlap"]["source"] == "cache"
    assert cached["weights_sha256"] == tuned["weights_sha256"]
    # the same plan written by hand (no key: used as given) gives the same bits too
    chosen = json.loads(plan.read_text())["plan"]
    hand = tmp_path / "hand.json"
    hand.write_text(json.dumps({"format": "unbroken-overlap/1", "plan": chosen}))
    given = run_job(tmp_path / "given", *SMALL, "--strategy", "ddp", "--overlap", str(hand))
    assert given["overlap"]["source"] == "file" and given["weights_sha256"] == tuned["weights_sha256"]
    # another world size: the cached plan is stale, the job re-tunes and says why
    other = run_job(tmp_path / "other", *[a if a != "3" else "2" for a in SMALL], "--strategy", "ddp",
                    "--overlap", str(plan))
    assert other["overlap"]["source"] == "tuned" and "world_size" in other["overlap"]["reason"]


def test_a_plan_file_with_a_bad_bucket_size_stops_the_launch_with_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "unbroken-overlap/1", "plan": {"bucket_kb": 0}}))
    p = run_cli(tmp_path / "run", *SMALL, "--overlap", str(bad), timeout=60)
    assert p.returncode == 2, p.stderr
    assert "bucket_kb must be an integer >= 1" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


@pytest.mark.slow
def test_a_shadow_taking_a_rank_uses_the_tuned_plan(tmp_path):
    """The search runs at step 1; a rank killed at step 3 is replaced by a shadow that never
    searched: it takes the plan from the store, so its buckets match and the bits equal a
    failure-free run given the same plan."""
    plan = tmp_path / "plan.json"
    # bucket_kb = 16 is no candidate of the search: a shadow that fell back to the configured size
    # would issue other buckets than its peers
    args = [*SMALL[:SMALL.index("--steps")], "--steps", "4", *SMALL[SMALL.index("--steps") + 2:], "--strategy", "ddp",
            "--config", _small_buckets(tmp_path)]
    killed = run_job(tmp_path / "killed", *args, "--overlap", str(plan), "--inject", "sigkill:rank=1,step=3,phase=backward")
    assert killed["overlap"]["source"] == "tuned" and killed["recoveries"]
    assert killed["overlap"]["bucket_kb"] != 16
    chosen = json.loads(plan.read_text())["plan"]
    hand = tmp_path / "hand.json"
    hand.write_text(json.dumps({"format": "unbroken-overlap/1", "plan": chosen}))
    clean = run_job(tmp_path / "clean", *args, "--overlap", str(hand))
    assert killed["weights_sha256"] == clean["weights_sha256"] and killed["ranks_agree"]


def test_a_shadow_taking_a_rank_uses_the_plan_file_its_peers_agreed_on(tmp_path):
    """A plan given as a file is agreed at step 1 without a search; the shadow that replaces a rank
    killed at step 3 adopts it from the store (it once waited on an agreement its peers had finished:
    the job hung)."""
    hand = tmp_path / "hand.json"  # not the configured 16 KiB: a shadow that fell back would differ
    hand.write_text(json.dumps({"format": "unbroken-overlap/1", "plan": {"bucket_kb": 32}}))
    args = [*SMALL[:SMALL.index("--steps")], "--steps", "4", *SMALL[SMALL.index("--steps") + 2:], "--strategy", "ddp",
            "--config", _small_buckets(tmp_path), "--overlap", str(hand)]
    given = run_job(tmp_path / "given", *args, "--inject", "sigkill:rank=1,step=3,phase=backward")
    assert given["overlap"]["source"] == "file" and given["overlap"]["bucket_kb"] == 32
    assert len(given["recoveries"]) == 1 and given["ranks_agree"]
    clean = run_job(tmp_path / "clean", *args)
    assert given["weights_sha256"] == clean["weights_sha256"]


@pytest.mark.parametrize("collectives", [pytest.param("chain", marks=pytest.mark.slow), "shm"])  # chain: test_chain_collectives
def test_a_plan_naming_our_collectives_switches_every_rank_and_a_shadow_to_them(tmp_path, collectives):
    """A plan file's `collectives` replaces the job's gloo all-reduce with the chain (or shared
    memory) on every rank, before step 1; the shadow replacing a rank killed at step 3 adopts it
    from the store (and maps a new generation's file). Same reduction order as our static ring, so
    the same bits as a failure-free static run."""
    hand = tmp_path / "hand.json"
    hand.write_text(json.dumps({"format": "unbroken-overlap/1", "plan": {"bucket_kb": 32, "collectives": collectives}}))
    args = [*SMALL[:SMALL.index("--steps")], "--steps", "4", *SMALL[SMALL.index("--steps") + 2:], "--strategy", "ddp",
            "--config", _small_buckets(tmp_path)]
    given = run_job(tmp_path / "given", *args, "--overlap", str(hand), "--inject", "sigkill:rank=1,step=3,phase=backward")
    assert given["overlap"]["collectives"] == collectives and len(given["recoveries"]) == 1 and given["ranks_agree"]
    static = run_job(tmp_path / "static", *args, "--collectives", "static", "--overlap", "off")
    assert given["weights_sha256"] == static["weights_sha256"]


def test_two_nodes_tune_the_chain_as_a_candidate(tmp_path):
    """2 nodes x 2 ranks with --overlap auto: the search times gloo's all-reduce and the chain on the
    whole gradient first, then runs every candidate on the one it chose, and the job uses it."""
    from unbroken.bench.common import free_port

    from .conftest import start_node

    env_cache = tmp_path / "cache.json"
    args = ["--n-layer", "2", "--n-embd", "64", "--batch-size", "4", "--steps", "4", "--world-size", "4",
            "--chunk-kb", "16", "--strategy", "ddp", "--port", str(free_port())]
    nodes = [start_node(tmp_path / f"n{k}", k, *args, "--overlap", str(env_cache)) for k in (0, 1)]
    outs = communicate_all(nodes, timeout=240)
    assert [n.returncode for n in nodes] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    tuned = json.loads(outs[0][0])
    rows = json.loads(env_cache.read_text())["measured"]["candidates"]
    probe = json.loads(env_cache.read_text())["measured"]["collectives_probe"]
    assert set(probe["seconds"]) == {"gloo", "chain"} and probe["chosen"] in (None, "chain")
    assert all(len(v) == 5 for v in probe["seconds"].values())
    assert 1 <= len(probe["rounds"]) <= 3 and probe["rounds"][-1] == probe["seconds"]  # the last round decides
    assert {r["collectives"] for r in rows} == {probe["chosen"]}  # every candidate on the chosen collectives
    chosen = json.loads(env_cache.read_text())["plan"]
    assert tuned["overlap"]["collectives"] == (chosen["collectives"] or "gloo")


def test_shared_memory_collectives_on_several_nodes_stop_the_launch_with_one_line(tmp_path):
    p = run_cli(tmp_path / "run", *SMALL, "--collectives", "shm", "--nnodes", "2", "--node-rank", "0", timeout=60)
    assert p.returncode == 2, p.stderr
    assert "--collectives shm" in p.stderr and "spans 2 nodes" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr

"""RL pools as processes: a pooled on-policy run computes the same update as the single-process
loop; the controller's moves form new training generations with no lost step; a killed rollout
worker's in-flight prompts are re-queued."""
import io
import json

import pytest
import torch

from unbroken.rl import local, policy, run as rlrun
from unbroken.rl.config import RLConfig
from unbroken.rl.controller import Move
from unbroken.rl.pool import Pool

CFG = RLConfig(digits=1, pretrain_steps=30, pretrain_batch=16, prompts=4, group=4, steps=5, staleness=0)


@pytest.fixture(scope="module")
def warm():
    torch.set_num_threads(1)
    return policy.pretrain(CFG)


@pytest.fixture(scope="module")
def pool():
    with Pool(4) as p:
        yield p
    assert not any(pr.is_alive() for pr in p.procs.values())


def _events(out):
    return [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]


def test_pooled_run_matches_the_single_process_loop(pool, warm, tmp_path):
    """Staleness 0, two trainers summing gradients of their shares: the same steps as one process
    (same prompts, same per-group sampling RNG; weights equal up to float summation order)."""
    cfg = RLConfig(**{**CFG.to_dict(), "steps": 2})
    res = rlrun.run(pool, cfg, "static", policy.state_bytes(warm), tmp_path, rollout=2)
    ref, ref_state = local.run_local(cfg, warm)
    assert [c["step"] for c in res["curve"]] == [0, 1] and res["max_staleness_seen"] == 0
    assert [c["reward"] for c in res["curve"]] == [c["reward"] for c in ref]
    final = torch.load(io.BytesIO((tmp_path / "policy.pt").read_bytes()), weights_only=True)
    moved = max(float((ref_state[k] - warm[k]).abs().max()) for k in warm)
    assert moved > 1e-4  # the updates did change the weights
    for k in warm:  # Adam amplifies summation-order noise where a gradient is ~0 (the key bias): < 10% of a step
        assert torch.allclose(final[k], ref_state[k], atol=0.1 * moved), k


class Scripted:
    """Moves at fixed steps: train->rollout after step 1, rollout->train after step 3."""

    def decide(self, obs):
        return {1: Move("rollout", "scripted"), 3: Move("train", "scripted")}.get(obs.step)


def _final_trainers_hold_the_kept_weights(pool, res, out, trainers: set[int]) -> None:
    """Every process that ends the run a trainer holds, bitwise, the weights the run kept: a joiner
    got rank 0's weights and optimizer state (a stale or fresh optimizer would step elsewhere)."""
    for m in res["moves"]:
        (trainers.add if m["to"] == "train" else trainers.discard)(m["proc"])
    kept = torch.load(io.BytesIO((out / "policy.pt").read_bytes()), weights_only=True)
    for w in sorted(trainers):
        mine = policy.load_state(pool.call(w, ("state",))[1])
        assert all(torch.equal(mine[k], kept[k]) for k in kept), f"worker {w} holds other weights"


def test_moves_form_new_generations_without_losing_a_step(pool, warm, tmp_path):
    cfg = RLConfig(**{**CFG.to_dict(), "steps": 6, "staleness": 1})
    res = rlrun.run(pool, cfg, "dynamic", policy.state_bytes(warm), tmp_path, rollout=2, controller=Scripted())
    assert [c["step"] for c in res["curve"]] == list(range(6))
    assert [m["to"] for m in res["moves"]] == ["rollout", "train"]
    _final_trainers_hold_the_kept_weights(pool, res, tmp_path, {2, 3})
    by_step = {c["step"]: c for c in res["curve"]}
    assert by_step[2]["train"] == 1 and by_step[5]["train"] == 2
    assert by_step[2]["gen"] > by_step[1]["gen"] and by_step[5]["gen"] > by_step[2]["gen"]
    assert all(c["max_staleness"] <= 1 for c in res["curve"])
    kinds = [e["kind"] for e in _events(tmp_path)]
    assert kinds.count("rl_move") == 2 and kinds.count("rl_step") == 6
    assert tuple(res["pool_sizes"][-1][1:]) == (2, 2)
    from unbroken.detect.report import pool_changes
    from unbroken.events import read_events

    shown = pool_changes(read_events(tmp_path))  # what `unbroken report` prints
    assert [(c["rollout"], c["train"]) for c in shown] == [(2, 2), (3, 1), (2, 2)]


class AllTrain:
    """On-policy, after step 1: both rollout workers join training in one generation (time-sharing)."""

    def decide(self, obs):
        return Move("train", "scripted", count=2) if obs.step == 1 else None


def test_on_policy_every_process_may_train_and_the_trainers_generate(pool, warm, tmp_path):
    """Both rollout workers move to training at once (one new generation, two joiners that get the
    state from rank 0): from step 1 the rollout pool is empty, the trainers generate every group,
    and the run learns what the static run learns."""
    cfg = RLConfig(**{**CFG.to_dict(), "steps": 5})
    static = rlrun.run(pool, cfg, "static", policy.state_bytes(warm), tmp_path / "static", rollout=2)
    res = rlrun.run(pool, cfg, "dynamic", policy.state_bytes(warm), tmp_path / "dyn", rollout=2,
                    controller=AllTrain())
    assert [c["reward"] for c in res["curve"]] == [c["reward"] for c in static["curve"]]
    assert sorted(m["proc"] for m in res["moves"]) == [0, 1] and {m["step"] for m in res["moves"]} == {1}
    assert [(c["rollout"], c["train"]) for c in res["curve"]] == [(2, 2)] * 2 + [(0, 4)] * 3
    assert len({c["gen"] for c in res["curve"][2:]}) == 1 and res["curve"][2]["gen"] > res["curve"][1]["gen"]
    assert res["lends"] >= 3 * cfg.prompts and res["helps"] == 2 * 2  # steps 0 and 1: two helpers, none after
    _final_trainers_hold_the_kept_weights(pool, res, tmp_path / "dyn", {2, 3})


@pytest.mark.parametrize("rollout", [2, 1])  # 1: the rollout pool dies out and a trainer refills it
def test_killed_rollout_worker_prompts_are_requeued(warm, tmp_path, rollout):
    with Pool(3) as p:
        res = rlrun.run(p, CFG, "static", policy.state_bytes(warm), tmp_path, rollout=rollout, kill_rollout_at=1)
        dead = [w for w in range(3) if not p.alive(w)]
    assert len(dead) == 1 and len(res["requeues"]) == 1
    assert [c["step"] for c in res["curve"]] == list(range(CFG.steps))
    assert res["samples"] == CFG.steps * CFG.samples_per_step
    events = _events(tmp_path)
    ev = [e for e in events if e["kind"] == "rl_requeue"]
    assert len(ev) == 1 and ev[0]["fields"]["proc"] == dead[0] and ev[0]["fields"]["rollout"] == rollout - 1
    refills = [e for e in events if e["kind"] == "rl_move" and "lost its last worker" in e["fields"]["reason"]]
    assert len(refills) == (rollout == 1) and res["curve"][-1]["rollout"] == 1


def test_killed_trainer_step_is_redone_by_the_survivors(warm, tmp_path):
    with Pool(3) as p:
        res = rlrun.run(p, CFG, "static", policy.state_bytes(warm), tmp_path, rollout=1, kill_trainer_at=2)
        dead = [w for w in range(3) if not p.alive(w)]
    assert len(dead) == 1
    assert [c["step"] for c in res["curve"]] == list(range(CFG.steps))  # no step lost or applied twice
    assert res["curve"][-1]["train"] == 1
    kinds = [e["kind"] for e in _events(tmp_path)]
    assert kinds.count("rl_step") == CFG.steps and kinds.count("rl_redo") == 1 and res["redos"] == [2]


def test_colocated_run_is_on_policy_and_keeps_its_weights(pool, warm, tmp_path):
    cfg = RLConfig(**{**CFG.to_dict(), "steps": 3, "staleness": 1})  # colocated ignores it: always 0
    res = rlrun.run(pool, cfg, "colocated", policy.state_bytes(warm), tmp_path)
    assert [c["step"] for c in res["curve"]] == [0, 1, 2]
    assert res["staleness"] == 0 and res["max_staleness_seen"] == 0
    assert all(c["train"] == 4 and c["rollout"] == 4 for c in res["curve"]) and set(res["idle"]) == {"both"}
    assert (tmp_path / "policy.pt").exists()


class Never:
    def decide(self, obs):
        return None


def test_idle_trainers_lend_a_hand_without_changing_what_is_learned(pool, warm, tmp_path):
    """Dynamic mode, one rollout worker and three trainers, no moves: idle trainers generate queued
    groups of the step training waits for. On-policy (staleness 0) every group is sampled from the
    same weights with the same RNG whoever generates it, so the rewards are the static run's."""
    cfg = RLConfig(**{**CFG.to_dict(), "steps": 3})
    static = rlrun.run(pool, cfg, "static", policy.state_bytes(warm), tmp_path / "static", rollout=1)
    lent = rlrun.run(pool, cfg, "dynamic", policy.state_bytes(warm), tmp_path / "dyn", rollout=1, controller=Never())
    assert [c["reward"] for c in lent["curve"]] == [c["reward"] for c in static["curve"]]
    assert static["lends"] == 0 and lent["lends"] > 0 and not lent["moves"]
    ev = [e for e in _events(tmp_path / "dyn") if e["kind"] == "rl_lend"]
    assert len(ev) == lent["lends"] and all(e["fields"]["from_pool"] == "train" for e in ev)
    assert all(c["rollout"] == 1 and c["train"] == 3 for c in lent["curve"])


def test_idle_rollout_workers_help_train_and_a_lost_helper_share_is_computed_by_rank_0(pool, warm, tmp_path):
    """Dynamic mode on-policy, two rollout workers and two trainers, no moves: while a step trains,
    the rollout workers have nothing to generate and each computes a share of the gradient (`rl_help`),
    which rank 0 adds before the all-reduce. The same steps as the static run (same rewards); a helper
    SIGKILLed with its share in hand is an `rl_help_lost` event and rank 0 computes that share."""
    cfg = RLConfig(**{**CFG.to_dict(), "steps": 3})
    static = rlrun.run(pool, cfg, "static", policy.state_bytes(warm), tmp_path / "static", rollout=2)
    helped = rlrun.run(pool, cfg, "dynamic", policy.state_bytes(warm), tmp_path / "dyn", rollout=2, controller=Never())
    assert [c["reward"] for c in helped["curve"]] == [c["reward"] for c in static["curve"]]
    assert static["helps"] == 0 and helped["helps"] == 2 * cfg.steps and not helped["moves"]
    # the run ended with every command answered: nothing comes late for the next run to misread
    assert not any(pool.conns[w].poll(0.2) for w in range(pool.size))
    ev = [e for e in _events(tmp_path / "dyn") if e["kind"] == "rl_help"]
    assert len(ev) == helped["helps"] and all(e["fields"]["to_pool"] == "train" for e in ev)
    a = torch.load(io.BytesIO((tmp_path / "static" / "policy.pt").read_bytes()), weights_only=True)
    b = torch.load(io.BytesIO((tmp_path / "dyn" / "policy.pt").read_bytes()), weights_only=True)
    moved = max(float((a[k] - warm[k]).abs().max()) for k in warm)
    for k in warm:  # the same update up to float summation order (see the first test)
        assert torch.allclose(a[k], b[k], atol=0.1 * moved), k
    with Pool(4) as p:
        lost = rlrun.run(p, cfg, "dynamic", policy.state_bytes(warm), tmp_path / "lost", rollout=2,
                         controller=Never(), kill_helper_at=1)
        dead = [w for w in range(4) if not p.alive(w)]
    assert len(dead) == 1 and [c["step"] for c in lost["curve"]] == list(range(cfg.steps))
    assert [c["reward"] for c in lost["curve"]] == [c["reward"] for c in static["curve"]]
    gone = [e for e in _events(tmp_path / "lost") if e["kind"] == "rl_help_lost"]
    assert len(gone) == 1 and gone[0]["fields"]["proc"] == dead[0] and gone[0]["fields"]["step"] == 1

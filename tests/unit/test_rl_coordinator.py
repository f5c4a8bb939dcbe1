"""The coordinator's bookkeeping without processes: where the newest weights come from."""
import pytest

from unbroken.events import EventLog
from unbroken.rl.config import RLConfig
from unbroken.rl.coordinator import Coordinator, RunError


class FakeConn:
    def __init__(self, sent, w):
        self.sent, self.w = sent, w

    def send(self, msg):
        self.sent.append((self.w, msg))


class FakePool:
    """Three workers that never run: what the coordinator sends them is recorded."""

    size = 3

    def __init__(self):
        self.sent = []
        self.conns = {w: FakeConn(self.sent, w) for w in range(self.size)}


def _coordinator(tmp_path, pool):
    cfg = RLConfig(digits=1, prompts=1, group=2, steps=3, processes=3, rollout=1, pretrain_steps=0)
    events = EventLog(tmp_path / "events.jsonl", source="rl")
    c = Coordinator(pool, cfg, "static", 1, events)
    c._record_step = lambda step: None  # no samples in these fake steps
    return c, events


def _train_step(c, replies: dict):
    c.ready[c.version] = [[]]
    c.training = replies
    c._resolve_step()


def test_the_newest_weights_come_from_rank_0_or_from_a_rank_that_applied_the_update(tmp_path):
    pool = FakePool()
    c, events = _coordinator(tmp_path, pool)
    c.members = (1, 2)
    _train_step(c, {1: ("trained", 0, 0.0, 0.1), 2: ("trained", 0, 0.0, 0.1)})
    assert c.version == 1 and c.latest_version == 0 and not pool.sent  # rank 0 sends them after its reply
    assert not c._has_weights(0) and c._has_weights(1)  # the rollout worker waits for them, the trainers hold them
    c._on_reply(1, ("weights", 0, b"w1"))
    assert c.latest == b"w1" and c.latest_version == 1 and c._has_weights(0)
    c._on_reply(1, ("weights", 1, b"early"))  # before the other rank's reply: kept until the step resolves
    assert c.latest == b"w1"
    _train_step(c, {1: ("trained", 1, 0.0, 0.1), 2: ("trained", 1, 0.0, 0.1)})
    assert c.latest == b"early" and c.latest_version == c.version == 2

    c.alive.discard(1)  # rank 0 dies after its update, before it replied: the other rank is asked
    _train_step(c, {1: None, 2: ("trained", 2, 0.0, 0.1)})
    assert pool.sent == [(2, ("state",))] and c.members[0] == 2 and c.busy[2][0] == "state"
    c._on_reply(2, ("state", b"w2"))
    assert c.latest == b"w2" and c.latest_version == 3 and c.busy[2] is None

    _train_step(c, {2: ("trained", 3, 0.0, 0.1)})  # rank 0 is lost after its reply, before its weights
    c.alive.discard(2)
    with pytest.raises(RunError, match="no process holds the weights of update 4"):
        c._ensure_state()
    events.close()
    whys = [line for line in (tmp_path / "events.jsonl").read_text().splitlines() if "rl_state_from" in line]
    assert len(whys) == 1 and "lost after the update" in whys[0]


def test_a_sender_lost_before_the_weights_came_is_replaced_by_an_idle_holder(tmp_path):
    pool = FakePool()
    c, events = _coordinator(tmp_path, pool)
    c.members = (1, 2)
    _train_step(c, {1: ("trained", 0, 0.0, 0.1), 2: ("trained", 0, 0.0, 0.1)})
    c.alive.discard(1)
    c.busy[2] = ("rollout", 1, None, 0.0, True)
    c._ensure_state()  # the holder is busy: nobody asked yet
    assert not pool.sent
    c.busy[2] = None
    c._ensure_state()
    assert pool.sent == [(2, ("state",))]
    c._on_reply(2, ("state", b"w"))
    assert c.latest_version == 1
    events.close()


class FakeStore:
    def __init__(self):
        self.deleted = []

    def delete_key(self, key):
        self.deleted.append(key)
        return False


def test_a_helper_late_for_its_step_leaves_no_gradient_in_the_store(tmp_path):
    """Rank 0 computed the share itself (the helper did not answer in time) and the step went on:
    what the helper writes afterwards has no reader, so the coordinator removes it."""
    pool = FakePool()
    pool.store = FakeStore()
    c, events = _coordinator(tmp_path, pool)
    c.busy[0] = ("help", 0, (1, 0), 0.0, True)
    c._on_reply(0, ("helped", 0, 0.1))  # in time: rank 0 reads (and deletes) it
    assert pool.store.deleted == [] and c.busy[0] is None
    c.members = (1, 2)
    c.busy[0] = ("help", 0, (1, 0), 0.0, True)
    _train_step(c, {1: ("trained", 0, 0.0, 0.1), 2: ("trained", 0, 0.0, 0.1)})
    assert c._in_flight()  # the run does not end with the helper's reply on its way
    c._on_reply(0, ("helped", 0, 31.0))
    assert pool.store.deleted == [f"rl/{c.run_id}/help/1/0/0"] and not c._in_flight()
    events.close()


def test_a_pooled_run_refuses_several_epochs_instead_of_taking_one(tmp_path):
    """The pools take one optimizer step per step: epochs=2 would silently train as epochs=1."""
    from unbroken.rl import run as rlrun
    from unbroken.rl.errors import RLInputError

    cfg = RLConfig(digits=1, prompts=1, group=2, steps=1, epochs=2, pretrain_steps=0)
    with pytest.raises(RLInputError, match="epochs=2: pooled runs take one optimizer step per step"):
        rlrun.run(FakePool(), cfg, "dynamic", b"", tmp_path)

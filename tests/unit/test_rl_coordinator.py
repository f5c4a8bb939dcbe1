"""The coordinator's bookkeeping without processes: where the newest weights come from."""
from unbroken.events import EventLog
from unbroken.rl.config import RLConfig
from unbroken.rl.coordinator import Coordinator


class FakePool:
    """Two workers that never run: `call` answers what a worker would."""

    size = 2

    def __init__(self):
        self.calls = []

    def call(self, w, msg, timeout_s=0):
        self.calls.append((w, msg))
        return ("state", f"weights of {w}".encode())


def test_rank_0_lost_after_the_update_the_weights_come_from_a_rank_that_applied_it(tmp_path):
    cfg = RLConfig(digits=1, prompts=1, group=2, steps=3, processes=2, rollout=1, pretrain_steps=0)
    pool = FakePool()
    events = EventLog(tmp_path / "events.jsonl", source="rl")
    c = Coordinator(pool, cfg, "static", 0, events)
    c.ready[0] = [[]]
    c._record_step = lambda step: None  # no samples in this fake step
    c.members, c.training = (0, 1), {0: None, 1: ("trained", 0, 0.0, 0.1, None)}
    c.alive.discard(0)  # rank 0 died after its update, before it replied
    c._resolve_step()
    assert pool.calls == [(1, ("state",))] and c.latest == b"weights of 1" and c.version == 1
    assert c.members[0] == 1  # the rank that holds the update leads the next generation
    c.training = {1: ("trained", 1, 0.0, 0.1, b"fresh")}  # rank 0 replies with its state: nobody is asked
    c.members = (1,)
    c._resolve_step()
    assert len(pool.calls) == 1 and c.latest == b"fresh"
    events.close()
    kinds = [line for line in (tmp_path / "events.jsonl").read_text().splitlines() if "rl_state_from" in line]
    assert len(kinds) == 1

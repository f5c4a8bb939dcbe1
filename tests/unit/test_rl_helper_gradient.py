"""Rank 0's wait for a helper's gradient (rl/traingroup.helper_gradient): found, lost, or late."""
import pytest
import torch

from unbroken.rl import traingroup


class _Store:
    """A store whose key appears after `after` looks (never when None)."""

    def __init__(self, value: bytes | None, after: int | None) -> None:
        self.value, self.after, self.looks, self.deleted = value, after, 0, []

    def check(self, keys):
        self.looks += 1
        return self.after is not None and self.looks > self.after

    def get(self, key):
        return self.value

    def delete_key(self, key):
        self.deleted.append(key)


@pytest.fixture
def clock(monkeypatch):
    """A fake clock that time.sleep advances; returns the pauses taken."""
    now, pauses = [0.0], []
    monkeypatch.setattr(traingroup.time, "monotonic", lambda: now[0])

    def sleep(s):
        pauses.append(s)
        now[0] += s

    monkeypatch.setattr(traingroup.time, "sleep", sleep)
    return pauses


def test_a_helpers_gradient_is_read_and_its_key_removed(clock):
    g = torch.arange(4, dtype=torch.float32)
    store = _Store(g.numpy().tobytes(), after=6)
    got = traingroup.helper_gradient(store, "k", g, compute=lambda: pytest.fail("computed a share it had"))
    assert torch.equal(got, g) and store.deleted == ["k"]
    lo, hi = traingroup.HELP_POLL_S
    assert clock == [min(lo * 2 ** i, hi) for i in range(6)]  # doubling from 0.5 ms, capped at 5 ms
    assert clock[-1] == hi


def test_a_lost_helpers_share_is_computed(clock):
    like = torch.zeros(3)
    got = traingroup.helper_gradient(_Store(traingroup.LOST, after=0), "k", like, compute=lambda: torch.ones(3))
    assert torch.equal(got, torch.ones(3)) and clock == []


def test_a_late_helpers_share_is_computed_after_the_timeout(clock):
    got = traingroup.helper_gradient(_Store(None, after=None), "k", torch.zeros(2), compute=lambda: torch.full((2,), 7.0))
    assert torch.equal(got, torch.full((2,), 7.0))
    assert traingroup.HELP_TIMEOUT_S <= sum(clock) <= traingroup.HELP_TIMEOUT_S + traingroup.HELP_POLL_S[1]
    assert max(clock) == traingroup.HELP_POLL_S[1]

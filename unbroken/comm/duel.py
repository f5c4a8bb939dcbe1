"""The ring against the direct exchange, by time: which of the two runs when no link is planned around.

With nothing flagged the adaptive all-reduce runs the paced ring: one of our flows per link at a
time, the fastest on links it has to itself. When another job's TCP stream shares a link, the
ring's one flow on it gets about half of it, while the direct exchange's N-1 flows get N-1 of N
shares: on 8 ranks with a stream from rank 2 to rank 3 fixed exchanges ran 1.06-1.43x the static
ring's speed; without the stream the paced ring ran 1.10-1.16x faster than the even exchange
(docs/design.md, stop 51).
The link readings did not tell the two apart (on 8 ranks sharing 2 cores the stream's links read
like the others), so the choice is made by the collectives' times: at each learned size the ring
runs first, then the exchange once; the faster (the exchange only by `margin`) runs from then on,
and every `every`-th collective of that size runs the other once more, so a stream that stops or
starts is followed. Once the exchange wins at some learned size, links read as shared are planned
around, and sizes not learned from duel too, the exchange first (comm/adaptive.py): their times
cost a sync of their own, so only the collectives `due` names are timed.
The same contest, between other arms (`arms`), picks the depth of a plan around slow links:
the planner's pieces or half of them (DEPTHS; comm/adaptive.py `_depth`): the model's cost of a
message is one host's at 4 ranks, and on 8 ranks sharing 2 cores a 1 MB all-reduce around a slow
rank ran 1.4x the static ring's speed in one piece, 1.1x in the model's two (stop 53).
Pure: the same times (the slowest rank's, shared by every rank) give the same choices on every rank.
"""
from __future__ import annotations

ARMS = ("ring", "exchange")
DEPTHS = ("model", "half")  # a plan around slow links at the planner's pieces, or half of them
DUEL_EVERY = 16  # collectives of a size between two runs of the losing arm
DUEL_MARGIN = 1.05  # the exchange wins only when it is this much faster than the ring


class Duel:
    """Per all-reduce size: the last seconds of each of two arms, which one wins (the second only by
    `margin`), which one runs next."""

    def __init__(self, *, arms: tuple[str, str] = ARMS, every: int = DUEL_EVERY, margin: float = DUEL_MARGIN) -> None:
        if len(arms) != 2 or len(set(arms)) != 2 or not all(isinstance(a, str) and a for a in arms):
            raise ValueError(f"duel arms must be two distinct names, got {arms!r}")
        if not isinstance(every, int) or every < 2:
            raise ValueError(f"duel every must be an integer >= 2 (collectives), got {every!r}")
        if not margin >= 1:
            raise ValueError(f"duel margin must be >= 1 (a ratio of times), got {margin!r}")
        self.arms, self.every, self.margin = tuple(arms), every, margin
        self.seconds: dict[int, dict[str, float]] = {}
        self._since: dict[int, int] = {}  # collectives of the size since its losing arm last ran

    def winner(self, nbytes: int) -> str | None:
        """The faster arm at `nbytes` once both ran (the second, the exchange, only by `margin`), else None."""
        t = self.seconds.get(nbytes, {})
        if len(t) < 2:
            return None
        first, second = self.arms
        return second if t[second] * self.margin < t[first] else first

    def won_by(self, arm: str, at_least: int = 0) -> bool:
        """`arm` is the winner at some size of `at_least` bytes or more."""
        return any(self.winner(n) == arm for n in self.seconds if n >= at_least)

    def pick(self, nbytes: int, first: str | None = None) -> tuple[str, bool]:
        """The arm the next collective of `nbytes` runs, and whether it runs as a trial (an arm not yet
        timed, or the loser run again): `first` (default the first arm), then the other, then the winner."""
        first = self.arms[0] if first is None else first
        if first not in self.arms:
            raise ValueError(f"duel arm must be one of {', '.join(self.arms)}, got {first!r}")
        t = self.seconds.get(nbytes, {})
        for arm in sorted(self.arms, key=lambda a: a != first):
            if arm not in t:
                return arm, arm != first
        won = self.winner(nbytes)
        self._since[nbytes] = self._since.get(nbytes, 0) + 1
        if self._since[nbytes] >= self.every:
            self._since[nbytes] = 0
            return self.arms[1 - self.arms.index(won)], True
        return won, False

    def due(self, nbytes: int) -> bool:
        """Whether the collective just picked at `nbytes` must be timed where timing costs a sync: an arm
        has no time yet, it is the loser's re-run, or the next one is (the winner's time, fresh beside
        the loser's, is what the re-run is weighed against)."""
        if len(self.seconds.get(nbytes, {})) < 2:
            return True
        return self._since.get(nbytes, 0) in (0, self.every - 1)

    def forget(self) -> None:
        """The links changed (a link got slow): every size's duel starts afresh once nothing is planned
        around again (times of before say nothing of the links after)."""
        self.seconds.clear()
        self._since.clear()

    def drop(self, nbytes: int) -> None:
        """One size's duel starts afresh (what its arms stand for changed)."""
        self.seconds.pop(nbytes, None)
        self._since.pop(nbytes, None)

    def ran(self, nbytes: int, arm: str, seconds: float) -> tuple[str | None, str | None]:
        """Record that `arm` ran `seconds` at `nbytes`; the size's winner before and after."""
        if arm not in self.arms:
            raise ValueError(f"duel arm must be one of {', '.join(self.arms)}, got {arm!r}")
        before = self.winner(nbytes)
        self.seconds.setdefault(nbytes, {})[arm] = seconds
        return before, self.winner(nbytes)

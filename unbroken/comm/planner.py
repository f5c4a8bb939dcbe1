"""Choose the all-reduce pattern with the least predicted time from the links' rate estimates.

The cost model is the switch of comm/flows.py: rank r sends at up[r] and receives at down[r]
(bytes/s), a pair moves at min(up[src], down[dst]), each message round costs `latency_s` and
every transfer a rank posts and waits for costs it `op_s` of its own time (a pipelined plan of
many small pieces pays for its messages).
Candidates: the static ring; the pipelined exchange with an even split and with the split
that balances every rank's bytes against its link (a slow rank owns less, or nothing, and
then only sends its rows and receives results: S bytes each way instead of 2(N-1)/N x S);
the ring ordered fastest-first with that split; two-level trees whose aggregators are the
fastest 1..N-1 ranks. A plan is kept unless another is predicted `min_gain` faster (no flapping).
`choose` can be held to some kinds: while another job's traffic shares a link, only the direct
exchange (the model's links are fixed capacities; TCP shares a link per flow, and a ring's one
all-gather flow per hop gets less of a shared link than the exchange's N-1); `paced`
makes a ring send one piece after another with a few in flight, for links none of which is slow
(N-1 flows at once through a token bucket move less than one at a time, which the model does not see).
Pure: the same estimates give the same plan on every rank.
"""
from __future__ import annotations

import dataclasses

from unbroken.comm.patterns import KINDS, Pattern

SPLIT_SCALE = 1000  # splits are integers: the same plan on every rank, exactly, and in JSON


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rates:
    """Per rank: what its link sends (up) and receives (down) per second; a message round's latency."""

    up: tuple[float, ...]
    down: tuple[float, ...]
    latency_s: float = 2e-4
    # each transfer's own cost: gloo moved a 64 KB message for 40-90 us of CPU on this 2-core host,
    # and in the 4-rank exchange each extra piece cost an owner ~100 us per transfer (docs/design.md,
    # "A transfer costs 100 us": at 3e-5 the planner cut 1-16 MB into too many pieces)
    op_s: float = 1e-4
    reduce_Bps: float = 1e9  # one rank summing rows (bytes of rows per second, a loaded core): what is not overlapped

    def __post_init__(self) -> None:
        if len(self.up) != len(self.down) or not self.up:
            raise ValueError(f"Rates needs one up and one down rate per rank, got {len(self.up)} and {len(self.down)}")
        if any(not x > 0 for x in (*self.up, *self.down, self.reduce_Bps)) or self.latency_s < 0 or self.op_s < 0:
            raise ValueError(f"Rates must be > 0 bytes/s and latency, op_s >= 0 s, got {self.up}, {self.down}, "
                             f"{self.latency_s}, {self.op_s}")

    @property
    def world(self) -> int:
        return len(self.up)

    def pair(self, src: int, dst: int) -> float:
        return min(self.up[src], self.down[dst])

    @classmethod
    def uniform(cls, world: int, rate: float = 1e9) -> "Rates":
        return cls(up=(rate,) * world, down=(rate,) * world)


PIECES = (1, 2, 4, 8, 16, 32)  # pipeline depths tried: more overlap, more messages


def pieces_for(nbytes: int) -> int:
    """The default pipeline depth: pieces of at least ~2 MB, at most 32 (`candidates` tries others)."""
    return max(1, min(32, nbytes // (2 << 20)))


def _shares(p: Pattern, nbytes: float) -> list[float]:
    total = sum(p.split)
    return [nbytes * w / total for w in p.split]


def predict(p: Pattern, nbytes: float, rates: Rates) -> float:
    """Predicted seconds of one all-reduce of `nbytes` with pattern `p` on links `rates`."""
    c, n, lat = _shares(p, nbytes), rates.world, rates.latency_s
    if n == 1:
        return 0.0
    if p.kind == "ring":
        return _ring_time(p, c, rates)
    if p.kind == "pipelined":
        return _exchange_time(c, {r: [r] for r in range(n)}, rates, p.pieces)
    if p.kind == "chain":
        return _chain_time(nbytes, rates, p.pieces)
    aggs = p.aggregators
    leaves = [r for r in range(n) if r not in aggs]
    parent = {leaf: aggs[i % len(aggs)] for i, leaf in enumerate(leaves)}
    holders = {a: [a] + [leaf for leaf in leaves if parent[leaf] == a] for a in aggs}
    if not leaves:
        return _exchange_time(c, holders, rates, p.pieces)
    up = max([nbytes / rates.pair(leaf, parent[leaf]) for leaf in leaves]
             + [(len(h) - 1) * nbytes / rates.down[a] for a, h in holders.items()])
    down = max([nbytes / rates.pair(parent[leaf], leaf) for leaf in leaves]
               + [(len(h) - 1) * nbytes / rates.up[a] for a, h in holders.items()])
    return 2 * lat + up + _exchange_time(c, holders, rates, p.pieces) + down


def _ring_time(p: Pattern, c: list[float], rates: Rates) -> float:
    """The ring (patterns._ring): every pair's bytes at that pair's rate, a rank's sends (rows to each
    owner, the all-gather to the next rank) and receives added up, the busiest rank's direction sets
    the pace; what the pieces save is the reduction of a whole chunk between the two halves."""
    n, order, total, busy = rates.world, p.order, sum(c), 0.0
    for i, r in enumerate(order):
        nxt, prv = order[(i + 1) % n], order[(i - 1) % n]
        out = sum(c[d] / rates.pair(r, d) for d in range(n) if d != r) + (total - c[nxt]) / rates.pair(r, nxt)
        inn = sum(c[r] / rates.pair(s, r) for s in range(n) if s != r) + (total - c[r]) / rates.pair(prv, r)
        busy = max(busy, out, inn)
    exposed_reduce = n * max(c) / p.pieces / rates.reduce_Bps
    return busy + exposed_reduce + rates.latency_s * 2 * (n - 1) + rates.op_s * 4 * (n - 1) * p.pieces


def _chain_time(nbytes: float, rates: Rates, pieces: int) -> float:
    """The chain (patterns._chain), one rank per link: a middle rank sends the running sum up and the
    result down (2S each way on its link), the ends S; the pipeline fills over 2(N-1) hops of a piece."""
    n = rates.world
    busy = max(((r < n - 1) + (r > 0)) * nbytes / min(rates.up[r], rates.down[r]) for r in range(n))
    hop = max(nbytes / pieces / rates.pair(r, r + 1) for r in range(n - 1))
    return busy + 2 * (n - 1) * (hop + rates.latency_s) + rates.op_s * 4 * pieces + nbytes / pieces / rates.reduce_Bps


def chain_pieces(nbytes: int) -> int:
    """The chain's pipeline depth: pieces of ~1 MB (its fill is 2(N-1) hops of one piece), at most 64."""
    return max(1, min(64, nbytes // (1 << 20)))


def _exchange_time(c: list[float], holders: dict[int, list[int]], rates: Rates, pieces: int) -> float:
    """The direct exchange: every transfer at once, so a rank's time is its busier direction."""
    n, total = rates.world, sum(c)
    if len(holders) == 1:
        return 0.0
    busy, fill = 0.0, 0.0
    for a, h in holders.items():
        rows_out = len(h) * (total - c[a])  # my rows for the other owners' chunks
        results_out = (len(holders) - 1) * c[a]
        rows_in = (n - len(h)) * c[a]
        results_in = total - c[a]
        busy = max(busy, (rows_out + results_out) / rates.up[a], (rows_in + results_in) / rates.down[a])
        fill = max(fill, rows_out / rates.up[a], rows_in / rates.down[a])
    ops = 4 * (n - 1) * pieces  # rows and results, out and in, per piece
    exposed_reduce = n * max(c) / pieces / rates.reduce_Bps
    return rates.latency_s * 2 * pieces + rates.op_s * ops + busy + fill / pieces + exposed_reduce


def balanced_split(rates: Rates, members: list[int], holders: dict[int, int] | None = None) -> tuple[int, ...]:
    """Integer chunk weights over `members` (the others get 0) that make the direct exchange's
    busiest link as short as possible, then the next busiest, and so on (water-filling). With S = 1
    and member a's share x, a holding the rows of h_a ranks among m members of n: a sends
    h_a (1 - x) + (m - 1) x and receives (n - h_a) x + 1 - x. Each bound is linear in x and a
    rank's time depends on its own share alone, so for a time t every member has an interval of
    feasible x; the least t whose intervals can sum to the shares left is found by bisection. The
    members it pins (an empty interval there: the bottleneck) keep that share, the others are
    balanced again among themselves. Sharing the slack out at once instead gave a second slow rank,
    measured a little faster than the first, a chunk that made it the bottleneck at its true rate
    (two slow links of 250 Mbit/s: 1.14x the bytes on one of them, the plan 15 % slower)."""
    n = rates.world
    h = holders or {a: 1 for a in members}
    m = len(members)
    lines = {a: ((h[a], m - 1 - h[a], rates.up[a]), (1.0, n - h[a] - 1, rates.down[a])) for a in members}
    shares: dict[int, float] = {}
    free, mass = list(members), 1.0
    while free:
        iv = _least_time_intervals(lines, free, mass)
        if iv is None:
            return tuple(int(r in members) for r in range(n))
        pinned = [a for a in free if iv[a][1] - iv[a][0] <= _PINNED]
        if pinned and len(pinned) < len(free):
            for a in pinned:
                shares[a] = iv[a][0]
                mass -= iv[a][0]
            free = [a for a in free if a not in pinned]
            continue
        slack = mass - sum(iv[a][0] for a in free)
        room = sum(iv[a][1] - iv[a][0] for a in free) or 1.0
        shares.update({a: iv[a][0] + slack * (iv[a][1] - iv[a][0]) / room for a in free})
        free = []
    w = [round(SPLIT_SCALE * shares[r]) if r in members else 0 for r in range(n)]
    return tuple(w) if sum(w) else tuple(int(r in members) for r in range(n))


_PINNED = 1e-9  # an interval this narrow (in shares of the tensor) at the least time: that member is a bottleneck


def _interval(bounds: tuple, t: float) -> tuple[float, float] | None:
    """The shares x in [0, 1] a member can take within time t: base + slope x <= t rate, per direction."""
    lo, hi = 0.0, 1.0
    for base, slope, rate in bounds:
        room = t * rate - base
        if slope > 0:
            hi = min(hi, room / slope)
        elif slope < 0:
            lo = max(lo, room / slope)
        elif room < 0:
            return None
    return (lo, hi) if lo <= hi else None


def _least_time_intervals(lines: dict, free: list[int], mass: float) -> dict[int, tuple[float, float]] | None:
    """Each free member's interval at the least time t at which their intervals can hold `mass`
    (bisection); None when no time can."""
    def at(t: float):
        iv = {a: _interval(lines[a], t) for a in free}
        ok = all(iv.values()) and sum(x[0] for x in iv.values()) <= mass <= sum(x[1] for x in iv.values())
        return iv if ok else None

    lo, hi = 0.0, 1.0
    while at(hi) is None:
        hi *= 2
        if hi > 1e300:
            return None
    hi = max(hi, 1e-300)
    for _ in range(100):  # to 1e-13 of the time (~45 halvings): plans are integers of 1/SPLIT_SCALE
        if hi - lo <= 1e-13 * hi:
            break
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if at(mid) is not None else (mid, hi)
    return at(hi)


def candidates(rates: Rates, nbytes: int, kinds: tuple[str, ...] | None = None) -> list[Pattern]:
    """The plans `choose` scores, of `kinds` only (all when None): the balanced splits are most of a
    plan's cost (on 8 ranks sharing 2 cores, 30-90 ms a re-plan when every kind was built and most
    thrown away)."""
    n, pieces = rates.world, pieces_for(nbytes)
    ident = tuple(range(n))
    by_speed = sorted(range(n), key=lambda r: (-min(rates.up[r], rates.down[r]), r))
    out = [Pattern.static_ring(n, pieces), Pattern.static_ring(n),
           Pattern(kind="pipelined", order=ident, split=(1,) * n, pieces=pieces)]
    if kinds is None or {"pipelined", "ring"} & set(kinds):
        split = balanced_split(rates, list(range(n)))
        out += [Pattern(kind="pipelined", order=ident, split=split, pieces=k) for k in PIECES if k != pieces]
        out.append(Pattern(kind="pipelined", order=ident, split=split, pieces=pieces))
        out.append(Pattern(kind="ring", order=tuple(by_speed), split=split, pieces=pieces))
    for k in range(1, n) if kinds is None or "tree" in kinds else ():
        aggs = tuple(sorted(by_speed[:k]))
        leaves = [r for r in range(n) if r not in aggs]
        holders = {a: 1 + sum(1 for i, leaf in enumerate(leaves) if aggs[i % k] == a) for a in aggs}
        out.append(Pattern(kind="tree", order=ident, split=balanced_split(rates, list(aggs), holders),
                           pieces=pieces, aggregators=aggs))
    out.append(Pattern(kind="chain", order=ident, split=(1,) * n, pieces=chain_pieces(nbytes)))
    return out


PACED_WINDOW = 4  # sends a paced ring keeps in flight
PACED_PIECE_BYTES = 2 << 20  # a paced ring's pieces: ~2 MB of the whole tensor each, however many


def paced_pieces(nbytes: int) -> int:
    """A paced ring's pipeline depth: pieces of ~2 MB of the tensor, not capped at 32 (at 256 MB on 4
    ranks on this host, 128 pieces ran 3.47 s where 32 ran 4.1 s and gloo 3.37 s), at most 1024."""
    return max(1, min(1024, nbytes // PACED_PIECE_BYTES))


def paced(p: Pattern, nbytes: int) -> Pattern:
    """`p`, a ring, with every send in schedule order, PACED_WINDOW in flight (patterns._ring), for
    links none of which is slow or shared: then one of our flows at a time per link direction goes
    faster than N-1 at once (rows alone, 64 MB on 4 ranks at 1 Gbit/s: 84 % of the link against 77 %:
    the model's links are fixed capacities and do not see it). Not with a slow link: a paced ring
    moves at its slowest hop's pace. Non-rings are returned as they are."""
    if p.kind != "ring":
        return p
    return dataclasses.replace(p, pieces=paced_pieces(nbytes), window=PACED_WINDOW)


def choose(current: Pattern | None, rates: Rates, nbytes: int, *, min_gain: float = 0.05,
           kinds: tuple[str, ...] | None = None, pieces: int | None = None) -> tuple[Pattern, float]:
    """The plan for the next collectives and its predicted seconds, among the candidates of `kinds`
    (all when None) cut in `pieces` (any when None); `current` stays unless another is predicted at
    least `min_gain` (a fraction) faster."""
    if not 0 <= min_gain < 1:
        raise ValueError(f"min_gain must be in [0, 1), got {min_gain!r}")
    pool = [p for p in candidates(rates, nbytes, kinds) if (kinds is None or p.kind in kinds)
            and (pieces is None or p.pieces == pieces)]
    if not pool:
        in_pieces = "" if pieces is None else f" in {pieces} pieces"
        raise ValueError(f"no candidate plan of kinds {kinds}{in_pieces} for {rates.world} ranks; pick from "
                         f"{', '.join(KINDS)}")
    scored = [(predict(p, nbytes, rates), i, p) for i, p in enumerate(pool)]
    t_best, _, best = min(scored, key=lambda x: (x[0], x[1]))
    if current is not None and current.world == rates.world and (kinds is None or current.kind in kinds) \
            and (pieces is None or current.pieces == pieces):
        t_cur = predict(current, nbytes, rates)
        if t_best > (1 - min_gain) * t_cur:
            return current, t_cur
    return best, t_best

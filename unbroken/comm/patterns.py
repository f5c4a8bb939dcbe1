"""All-reduce (SUM) patterns over point-to-point transfers, all giving the same bits.

The determinism rule: the flat tensor is cut into one chunk per owner rank (`split` weighs
the chunks; a weight 0 owns nothing). Each owner receives the *raw* contribution of every
rank to its chunk, never a partial sum, and reduces them into a zero buffer in rank order:
`((0 + x_0) + x_1) + ... + x_{N-1}`, element by element. Moving finished chunks around
(all-gather) copies bits. So the result does not depend on the ring order, the split, the
pieces or the aggregation ranks: every pattern equals `reference` (gather everything, sum
in rank order) bit for bit, for floats as for integers.

    ring       reduce-scatter along `order` (my contribution to the chunk of the rank s places
               ahead, s = 1..N-1), then a ring all-gather along `order`; with `pieces` > 1 each
               chunk goes piece by piece and a piece's all-gather overlaps the next piece's
               reduce-scatter (the static baseline: even split, identity order). With `window`
               0 every rank's rows leave at once; with `window` w > 0 (paced) every send, rows
               and all-gather alike, goes in schedule order with w in flight, as gloo's own ring
               moves: a link carries one or two of our flows at a time instead of N
    pipelined  every transfer in flight at once, each owner chunk cut in `pieces`: a piece's
               all-gather starts as soon as it is reduced, so a rank's sending (reduce-scatter)
               overlaps its receiving (all-gather); `split` sets each rank's share; every transfer
               to or from a rank in `squeeze` is compressed losslessly (squeeze.py)
    tree       two-level: each other rank sends its whole tensor to an aggregator (`aggregators`,
               assigned round-robin in rank order); aggregators exchange the raw rows for each
               other's chunks, reduce, share results, and send the whole result back
    chain      the reduction itself travels: rank 0 sends 0 + x_0 to rank 1, which adds x_1 and
               passes it on, ..., rank N-1 has the sum and it travels back down the chain, each
               piece as soon as it is done. The running sum IS the rank-order reduction, so the
               bits are the same, and no rank ever sends a raw row. Where ranks sit on nodes in
               blocks of consecutive ranks (how launchers place them) only the node boundaries
               cross a link, each carrying the tensor once each way: a ring carries 2(N-1)/N of
               it there (1.5x at 2 nodes x 2 ranks); with one rank per node a ring is better.
               Needs the identity order (the sum's order is the rank order).
"""
from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Sequence

import torch

from unbroken.comm import native_ring, squeeze
from unbroken.comm.group import CollectiveError
from unbroken.comm.transport import Transfer, Transport

KINDS = ("ring", "pipelined", "tree", "chain")
MAX_WORLD = 64  # the tag layout gives a source rank 6 bits
MAX_PIECES = 4096


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pattern:
    """How one all-reduce moves its bytes. `split[r]` weighs rank r's chunk (integers, any scale)."""

    kind: str
    order: tuple[int, ...]
    split: tuple[int, ...]
    pieces: int = 1
    aggregators: tuple[int, ...] = ()
    window: int = 0  # a ring's sends in flight when paced (0: every row at once)
    squeeze: tuple[int, ...] = ()  # a direct exchange's ranks whose every transfer is compressed (squeeze.py)

    def __post_init__(self) -> None:
        n = len(self.order)
        if self.kind not in KINDS:
            raise ValueError(f"pattern kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not 1 <= n <= MAX_WORLD or sorted(self.order) != list(range(n)):
            raise ValueError(f"pattern order must be a permutation of 0..N-1 (N <= {MAX_WORLD}), got {self.order}")
        if len(self.split) != n or any(w < 0 for w in self.split) or sum(self.split) <= 0:
            raise ValueError(f"pattern split needs {n} weights >= 0 with a positive sum, got {self.split}")
        if not 1 <= self.pieces <= MAX_PIECES:
            raise ValueError(f"pattern pieces must be in 1..{MAX_PIECES}, got {self.pieces}")
        if self.kind == "tree":
            if not self.aggregators or len(set(self.aggregators)) != len(self.aggregators) \
                    or any(not 0 <= a < n for a in self.aggregators):
                raise ValueError(f"a tree needs distinct aggregator ranks in 0..{n - 1}, got {self.aggregators}")
            if any(w and r not in self.aggregators for r, w in enumerate(self.split)):
                raise ValueError(f"a tree's chunks belong to aggregators {self.aggregators}; split {self.split} "
                                 "gives weight to another rank")
        if not isinstance(self.window, int) or self.window < 0 or (self.window and self.kind != "ring"):
            raise ValueError(f"pattern window must be an integer >= 0, and > 0 only for a ring; got {self.window!r} "
                             f"for a {self.kind}")
        if self.squeeze and (self.kind != "pipelined" or list(self.squeeze) != sorted(set(self.squeeze))
                             or not all(0 <= r < n for r in self.squeeze)):
            raise ValueError(f"pattern squeeze must be distinct ranks in 0..{n - 1} in ascending order, and only for a "
                             f"pipelined exchange; got {self.squeeze!r} for a {self.kind}")
        if self.kind == "chain" and self.order != tuple(range(n)):
            raise ValueError(f"a chain runs in rank order (its running sum is the rank-order reduction); "
                             f"order must be 0..{n - 1}, got {self.order}")

    @property
    def world(self) -> int:
        return len(self.order)

    @classmethod
    def static_ring(cls, world: int, pieces: int = 1) -> "Pattern":
        """The baseline: ranks in rank order, even chunks (`pieces` each: the ring's own pipelining)."""
        return cls(kind="ring", order=tuple(range(world)), split=(1,) * world, pieces=pieces)

    def to_json(self) -> dict:
        return {"kind": self.kind, "order": list(self.order), "split": list(self.split), "pieces": self.pieces,
                "aggregators": list(self.aggregators), "window": self.window, "squeeze": list(self.squeeze)}

    @classmethod
    def from_json(cls, d: dict) -> "Pattern":
        return cls(kind=d["kind"], order=tuple(d["order"]), split=tuple(d["split"]), pieces=int(d["pieces"]),
                   aggregators=tuple(d.get("aggregators", ())), window=int(d.get("window", 0)),
                   squeeze=tuple(d.get("squeeze", ())))


def bounds(n: int, split: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) of each rank's chunk of n elements, in proportion to `split` (integer arithmetic)."""
    total, acc, out = sum(split), 0, []
    for w in split:
        start = n * acc // total
        acc += w
        out.append((start, n * acc // total))
    return out


def pieces_of(start: int, end: int, pieces: int) -> list[tuple[int, int]]:
    """[start, end) cut into up to `pieces` near-equal non-empty parts."""
    n = end - start
    k = max(1, min(pieces, n))
    return [(start + n * i // k, start + n * (i + 1) // k) for i in range(k)] if n else []


# tag phases: what a transfer carries (comm/adaptive.py measures links on all but results)
PHASE_ROWS, PHASE_RESULTS, PHASE_RING_GATHER, PHASE_TREE_UP, PHASE_TREE_DOWN = 0, 1, 2, 2, 3


def tag(seq: int, phase: int, src: int, piece: int) -> int:
    """A unique tag per collective (seq), phase, source rank and piece: messages never cross."""
    return ((seq % 1024) << 20) | (phase << 18) | (src << 12) | (piece % MAX_PIECES)


def reduce_rows(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """Rows summed into a zero buffer in the given (rank) order: THE reduction every pattern uses."""
    acc = torch.zeros_like(rows[0])
    for r in rows:
        acc.add_(r)
    return acc


def allreduce(tp: Transport, t: torch.Tensor, pattern: Pattern, seq: int, what: str = "all-reduce", *,
              timed: bool = True) -> None:
    """Sum `t` (contiguous) over the ranks in place, moving bytes as `pattern` says; `timed`: each
    transfer is stamped with its own end (its flows will be read; transport.py)."""
    if pattern.world != tp.world:
        raise ValueError(f"pattern is for {pattern.world} ranks, the group has {tp.world}")
    if not t.is_contiguous():
        raise ValueError(f"all-reduce needs a contiguous tensor, got strides {t.stride()}; pass t.contiguous()")
    flat = t.view(-1)
    if tp.world == 1 or flat.numel() == 0:
        return
    tp.begin(timed=timed)
    try:
        {"ring": _ring, "pipelined": _pipelined, "tree": _tree, "chain": _chain}[pattern.kind](tp, flat, pattern, seq,
                                                                                             what)
    finally:
        tp.end()


def reference(tp: Transport, t: torch.Tensor, seq: int, what: str = "reference all-reduce") -> None:
    """The naive reduction to test against: every rank gets every rank's tensor, sums in rank order."""
    flat = t.view(-1)
    if tp.world == 1 or flat.numel() == 0:
        return
    tp.begin()
    rows = [flat if r == tp.rank else torch.empty_like(flat) for r in range(tp.world)]
    xs = [tp.recv(rows[r], r, tag(seq, PHASE_ROWS, r, 0)) for r in range(tp.world) if r != tp.rank]
    xs += [tp.send(flat, r, tag(seq, PHASE_ROWS, tp.rank, 0)) for r in range(tp.world) if r != tp.rank]
    tp.wait(xs, what)
    flat.copy_(reduce_rows(rows))


RING_WINDOW = 2  # all-gather sends a ring rank keeps in flight: the next is on the wire while the last one ends


def _ring(tp: Transport, flat: torch.Tensor, p: Pattern, seq: int, what: str) -> None:
    """Reduce-scatter then all-gather along `order`, each chunk cut in `pieces` (`_ring_schedule`);
    a piece's all-gather along the ring starts as soon as its rows are reduced, overlapping the rows
    of the next pieces. Unpaced (`window` 0), every rank's rows go to their owners at once, piece by
    piece, with RING_WINDOW all-gather sends in flight (a rank never waits for a round to end);
    paced, every send waits its turn in schedule order with `window` in flight. `ring_plan` says what
    to post and wait for; a caller that waits inside gloo runs it compiled when built (native_ring.py)."""
    me, bits = tp.rank, (seq % 1024) << 20
    lo, hi, recvs, pre, steps, waits, window = ring_plan(p, flat.numel(), me)
    rows = [flat.new_empty(0) if r == me else tp.scratch(r, hi - lo, flat.dtype) for r in range(tp.world)]
    if tp.caller_waits and (walk := native_ring.module()) is not None:
        tp.wait_native(lambda left: walk.walk_ring(tp.pg, flat, rows, lo, me, bits, recvs, pre, steps, waits, window,
                                                   left), what)
        return
    rx = [tp.recv(rows[src][a - lo:z - lo] if into_rows else flat[a:z], src, bits | t)
          for src, into_rows, a, z, t in recvs]
    row_sends = [tp.send(flat[a:z], peer, bits | t) for peer, a, z, t in pre]
    sends, waited = [], 0
    for kind, peer, a, z, t, first, last in steps:
        if len(sends) - waited >= window:
            tp.wait([sends[waited]], f"{what} (send {waited} of the ring)")
            waited += 1
        if kind == STEP_OWN:  # my piece: every rank's rows are in; reduce in rank order, pass it on
            tp.wait([rx[k] for k in waits[first:last]], f"{what} (reduce-scatter of my piece at {a})")
            flat[a:z] = reduce_rows([flat[a:z] if r == me else rows[r][a - lo:z - lo] for r in range(tp.world)])
        elif kind == STEP_FWD:
            tp.wait([rx[k] for k in waits[first:last]], f"{what} (all-gather of the piece at {a})")
        sends.append(tp.send(flat[a:z], peer, bits | t))
    unwaited = sorted(set(range(len(rx))) - set(waits))
    tp.wait([*row_sends, *sends[waited:], *(rx[k] for k in unwaited)], f"{what} (all-gather)")


STEP_OWN, STEP_FWD, STEP_ROWS = 0, 1, 2  # ring_plan's step kinds (ring_walk.cpp reads the same numbers)


@functools.lru_cache(maxsize=64)
def ring_plan(p: Pattern, numel: int, me: int) -> tuple:
    """What `me` posts and waits for in ring `p` over `numel` elements: (lo, hi) of its chunk;
    receives (src, into src's rows (1) or the tensor (0), start, end, tag), posted at once in the
    order each peer sends (rows first when unpaced, schedule order when paced: a timed pair's works
    are waited for in posting order, transport.py, so any other order could hang); sends posted
    at once (an unpaced ring's rows: peer, start, end, tag); the steps in schedule order (kind,
    peer, start, end, tag, first, last), step k waiting for receives waits[first:last] before its
    send; and the sends in flight. Tags carry no collective number (the caller ORs it in)."""
    n = p.world
    b = bounds(numel, p.split)
    cut = [pieces_of(*b[r], p.pieces) for r in range(n)]
    lo, hi = b[me]
    npieces = [len(c) for c in cut]
    recvs, rs_in, ag_in = [], [[] for _ in cut[me]], {}
    for src in (r for r in range(n) if r != me):
        theirs = _ring_schedule(p, src, npieces)
        for _, kind, peer, o, i in (theirs if p.window else sorted(theirs, key=lambda x: x[1] != "rows")):
            if peer == me and kind == "rows":
                rs_in[i].append(len(recvs))
                recvs.append((src, 1, *cut[me][i], tag(0, PHASE_ROWS, src, i)))
            elif peer == me:
                ag_in[(o, i)] = len(recvs)
                recvs.append((src, 0, *cut[o][i], tag(0, PHASE_RING_GATHER, o, i)))
    mine = _ring_schedule(p, me, npieces)
    pre = [] if p.window else [(peer, *cut[o][i], tag(0, PHASE_ROWS, me, i)) for _, k, peer, o, i in mine if k == "rows"]
    steps, waits = [], []
    for _, kind, peer, o, i in mine if p.window else [x for x in mine if x[1] != "rows"]:
        need = rs_in[i] if kind == "own" else [ag_in[(o, i)]] if kind == "fwd" else []
        t = tag(0, PHASE_ROWS, me, i) if kind == "rows" else tag(0, PHASE_RING_GATHER, o, i)
        steps.append(({"own": STEP_OWN, "fwd": STEP_FWD, "rows": STEP_ROWS}[kind], peer, *cut[o][i], t, len(waits),
                      len(waits) + len(need)))
        waits += need
    return lo, hi, recvs, pre, steps, waits, p.window or RING_WINDOW


def _ring_schedule(p: Pattern, me: int, npieces: list[int]) -> list[tuple[int, int, int, int, int]]:
    """`me`'s sends in order: (step, kind, peer, chunk owner, piece). Piece i's rows go to the rank s
    places ahead at step i(N-1) + s-1 ("rows"); the owner sends its reduced piece i on at step (i+1)(N-1)
    ("own") and the rank r places behind it forwards it at step (i+1)(N-1) + r ("fwd"). What a send
    waits for was sent at an earlier step by its sender: no two ranks can wait for each other."""
    n, order = len(p.order), p.order
    pos = order.index(me)
    nxt = order[(pos + 1) % n]
    out = []
    for s in range(1, n):
        dst = order[(pos + s) % n]
        out += [(i * (n - 1) + s - 1, 2, dst, dst, i) for i in range(npieces[dst])]
    out += [((i + 1) * (n - 1), 0, nxt, me, i) for i in range(npieces[me])]
    for r in range(1, n - 1):
        o = order[(pos - r) % n]
        out += [((i + 1) * (n - 1) + r, 1, nxt, o, i) for i in range(npieces[o])]
    names = ("own", "fwd", "rows")
    return [(step, names[k], peer, o, i) for step, k, peer, o, i in sorted(out)]


def _pipelined(tp: Transport, flat: torch.Tensor, p: Pattern, seq: int, what: str) -> None:
    _exchange(tp, flat, p, seq, what, holders={r: [r] for r in range(tp.world)}, rows_of={tp.rank: flat})


def _exchange(tp: Transport, flat: torch.Tensor, p: Pattern, seq: int, what: str, *,
              holders: dict[int, list[int]], rows_of: dict[int, torch.Tensor]) -> None:
    """The direct exchange among `holders` (rank -> the ranks whose raw rows it holds; this rank's
    rows are `rows_of`): rows go to the owners of their chunks, pieces reduced in rank order, each
    reduced piece sent to every holder as soon as it is done. Sends are posted piece by piece across
    the owners (a squeezed piece is compressed as it is posted: every owner's first piece leaves
    first); a transfer to or from a rank in `p.squeeze` is compressed (squeeze.py)."""
    me, b, peers = tp.rank, bounds(flat.numel(), p.split), [h for h in holders if h != tp.rank]
    lo, hi = b[me]
    my_pieces = pieces_of(lo, hi, p.pieces)
    got = {r: rows_of[r][lo:hi] if r in rows_of else tp.scratch(r, hi - lo, flat.dtype) for r in range(tp.world)}
    wire = _Wire(tp, p.squeeze, flat.element_size())
    recvs = [[wire.recv(got[src][a - lo:z - lo], h, tag(seq, PHASE_ROWS, src, i)) for h in peers for src in holders[h]]
             for i, (a, z) in enumerate(my_pieces)]
    theirs = {h: pieces_of(*b[h], p.pieces) for h in peers}
    sends, results = [], []
    for i in range(max((len(c) for c in theirs.values()), default=0)):  # my rows for other owners' chunks
        for h in (h for h in peers if i < len(theirs[h])):
            a, z = theirs[h][i]
            sends += [wire.send(rows_of[src][a:z], h, tag(seq, PHASE_ROWS, src, i)) for src in holders[me]]
            # posted now, into the rows just sent (or squeezed): the owner sends a result only after it
            # has received my rows for it, so no result byte can arrive before they left this buffer
            results.append(wire.recv(flat[a:z], h, tag(seq, PHASE_RESULTS, h, i)))
    wire.settle(sends)
    for i, (a, z) in enumerate(my_pieces):
        tp.wait(recvs[i], f"{what} (reduce-scatter piece {i})")
        wire.decode(recvs[i])
        flat[a:z] = reduce_rows([got[r][a - lo:z - lo] for r in range(tp.world)])
        results += wire.send_all(flat[a:z], peers, tag(seq, PHASE_RESULTS, me, i))
    for x in results:  # a squeezed result is decoded as it lands, while the later ones are on the wire
        tp.wait([x], f"{what} (all-gather)")
        wire.decode([x])
    tp.wait(sends, f"{what} (rows sent)")


class _Wire:
    """The exchange's sends and receives, squeezed (compressed) where either end is in `squeeze`."""

    def __init__(self, tp: Transport, squeeze: tuple[int, ...], itemsize: int) -> None:
        self.tp, self.squeeze, self.itemsize = tp, frozenset(squeeze), itemsize
        self._into: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(transfer) -> (message, destination)

    def _squeezed(self, peer: int) -> bool:
        return self.tp.rank in self.squeeze or peer in self.squeeze

    def send(self, t: torch.Tensor, peer: int, tg: int) -> Transfer:
        return self.tp.send(squeeze.squeeze(t) if self._squeezed(peer) else t, peer, tg)

    def send_all(self, t: torch.Tensor, peers: list[int], tg: int) -> list[Transfer]:
        """`t` to every peer; compressed once for all the squeezed ones."""
        msg = squeeze.squeeze(t) if any(self._squeezed(h) for h in peers) else None
        return [self.tp.send(msg if self._squeezed(h) else t, h, tg) for h in peers]

    def recv(self, t: torch.Tensor, peer: int, tg: int) -> Transfer:
        if not self._squeezed(peer):
            return self.tp.recv(t, peer, tg)
        buf = torch.empty(squeeze.bound(t.numel() * self.itemsize), dtype=torch.uint8)
        x = self.tp.recv(buf, peer, tg, wire_bytes=lambda: squeeze.wire_bytes(buf))
        self._into[id(x)] = (buf, t)
        return x

    def settle(self, sends: list[Transfer]) -> None:
        """Date every squeezed send to a peer as posted when the last of them was (before anything
        waits for them: the flow statistics read `posted` then). A flow starts when both ends had
        posted (flows.join), and squeezed pieces are posted as they are compressed: where the codec
        is slower than the link (a link that got fast again, a busy host), the first piece's post
        would time the codec, the link would keep reading slow and the plan around it would stay
        (on 8 ranks sharing 2 cores one did for the rest of a run). From the last post, what is
        timed is the wire draining what the codec queued: on a link slower than the codec nearly all
        of it (the reading is high by at most the codec's share of the time), on a fast one little,
        which reads fast, and the link clears."""
        last: dict[int, float] = {}
        for x in sends:
            if self._squeezed(x.peer):
                last[x.peer] = max(last.get(x.peer, 0.0), x.posted)
        for x in sends:
            if x.peer in last:
                x.posted = last[x.peer]

    def decode(self, transfers: list[Transfer]) -> None:
        """Write the squeezed ones among `transfers` (all waited for) into their destinations."""
        for x in transfers:
            if (m := self._into.pop(id(x), None)) is not None:
                try:
                    squeeze.unsqueeze(*m)
                except squeeze.SqueezeError as e:  # the group's stream can no longer be trusted: a new one
                    self.tp.broken = f"a damaged message from rank {x.peer}: {e}"
                    raise CollectiveError(f"rank {self.tp.rank}: {self.tp.broken}") from e


def _tree(tp: Transport, flat: torch.Tensor, p: Pattern, seq: int, what: str) -> None:
    me, aggs = tp.rank, p.aggregators
    leaves = [r for r in range(tp.world) if r not in aggs]
    parent = {leaf: aggs[i % len(aggs)] for i, leaf in enumerate(leaves)}
    if me in parent:  # a leaf: whole tensor up, whole result down
        up = tp.send(flat, parent[me], tag(seq, PHASE_TREE_UP, me, 0))
        tp.wait([up], f"{what} (to aggregator {parent[me]})")
        tp.wait([tp.recv(flat, parent[me], tag(seq, PHASE_TREE_DOWN, me, 0))], f"{what} (from aggregator {parent[me]})")
        return
    mine = [leaf for leaf in leaves if parent[leaf] == me]
    rows_of = {me: flat, **{leaf: torch.empty_like(flat) for leaf in mine}}
    tp.wait([tp.recv(rows_of[leaf], leaf, tag(seq, PHASE_TREE_UP, leaf, 0)) for leaf in mine], f"{what} (from leaves)")
    holders = {a: [a] + [leaf for leaf in leaves if parent[leaf] == a] for a in aggs}
    _exchange(tp, flat, p, seq, what, holders=holders, rows_of=rows_of)
    tp.wait([tp.send(flat, leaf, tag(seq, PHASE_TREE_DOWN, leaf, 0)) for leaf in mine], f"{what} (to leaves)")


def _chain(tp: Transport, flat: torch.Tensor, p: Pattern, seq: int, what: str) -> None:
    """The running sum goes up the chain piece by piece; the result comes back down, relayed by a
    thread of each middle rank as each piece arrives, so both directions stream at once. A rank's
    result pieces land in `flat` where its own row was: piece i comes back only after this rank
    added its row to piece i and sent it on."""
    me, n = tp.rank, tp.world
    pcs = pieces_of(0, flat.numel(), p.pieces)
    up = [tp.recv(flat[a:z], me + 1, tag(seq, PHASE_RESULTS, me + 1, i)) for i, (a, z) in enumerate(pcs)] \
        if me < n - 1 else []
    acc = torch.zeros_like(flat) if me == 0 else torch.empty_like(flat)
    below = [tp.recv(acc[a:z], me - 1, tag(seq, PHASE_ROWS, me - 1, i)) for i, (a, z) in enumerate(pcs)] \
        if me > 0 else []
    relay = _Relay(tp, flat, pcs, up, seq, what) if 0 < me < n - 1 else None
    sends = []
    for i, (a, z) in enumerate(pcs):
        if me > 0:
            tp.wait([below[i]], f"{what} (chain piece {i} from rank {me - 1})")
        acc[a:z].add_(flat[a:z])  # ((0 + x_0) + ... ) + x_me: the rank-order reduction so far
        if me < n - 1:
            sends.append(tp.send(acc[a:z], me + 1, tag(seq, PHASE_ROWS, me, i)))
        else:
            flat[a:z] = acc[a:z]
            sends.append(tp.send(flat[a:z], me - 1, tag(seq, PHASE_RESULTS, me, i)))
    if relay is not None:
        sends += relay.join()
    elif me == 0:
        tp.wait(up, f"{what} (chain results)")
    tp.wait(sends, f"{what} (chain sends)")


class _Relay:
    """A middle rank's result pieces, passed down the chain as each one arrives (its own thread)."""

    def __init__(self, tp: Transport, flat: torch.Tensor, pcs: list, up: list, seq: int, what: str) -> None:
        self.tp, self.what = tp, what
        self.sends: list[Transfer] = []
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(flat, pcs, up, seq), daemon=True,
                                        name=f"unbroken-chain-relay-r{tp.rank}")
        self._thread.start()

    def _run(self, flat: torch.Tensor, pcs: list, up: list, seq: int) -> None:
        tp = self.tp
        try:
            for i, (a, z) in enumerate(pcs):
                tp.wait([up[i]], f"{self.what} (chain result piece {i} from rank {tp.rank + 1})")
                self.sends.append(tp.send(flat[a:z], tp.rank - 1, tag(seq, PHASE_RESULTS, tp.rank, i)))
        except BaseException as e:  # noqa: BLE001 - raised in the caller by join()
            self.error = e

    def join(self) -> list[Transfer]:
        """The relay's sends, once every result piece was passed on; its error raised here. Bounded:
        each of its waits ends by the collective's deadline."""
        self._thread.join(self.tp.timeout_s + 5.0)
        if self.error is not None:
            raise self.error
        if self._thread.is_alive():
            raise CollectiveError(f"{self.what}: the chain's result relay on rank {self.tp.rank} did not end")
        return self.sends

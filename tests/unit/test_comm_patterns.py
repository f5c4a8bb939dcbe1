"""Every all-reduce pattern gives the reference reduction's bits (comm/patterns.py)."""
from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.commgroups import on_ranks
from unbroken.comm.patterns import Pattern, allreduce, bounds, pieces_of, reference

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64)
_seq = itertools.count(1)


def _inputs(world: int, n: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.int64:
        return [torch.randint(-2**40, 2**40, (n,), generator=g) for _ in range(world)]
    # widely spread magnitudes: the sum's bits depend on the order of additions
    return [(torch.randn(n, generator=g) * torch.exp2(torch.randint(-12, 12, (n,), generator=g).float())).to(dtype)
            for _ in range(world)]


def _run(world: int, xs: list[torch.Tensor], pattern: Pattern | None, *, timed: bool = True) -> list[torch.Tensor]:
    """`pattern` (the reference when None) on copies of `xs`; `timed=False`: the caller waits inside gloo."""
    seq = next(_seq)
    ts = [x.clone() for x in xs]

    def body(tp, r):
        if pattern is None:
            reference(tp, ts[r], seq)
        else:
            allreduce(tp, ts[r], pattern, seq, timed=timed)
        return ts[r]

    return on_ranks(world, body)


@st.composite
def patterns(draw, world: int) -> Pattern:
    kind = draw(st.sampled_from(("ring", "pipelined", "tree", "chain")))
    if kind == "chain":  # the running sum's order is the rank order
        return Pattern(kind=kind, order=tuple(range(world)), split=(1,) * world, pieces=draw(st.integers(1, 6)))
    order = tuple(draw(st.permutations(range(world))))
    if kind == "tree":
        aggs = tuple(draw(st.lists(st.integers(0, world - 1), min_size=1, max_size=world, unique=True)))
        split = tuple(draw(st.integers(0, 5)) if r in aggs else 0 for r in range(world))
        if not sum(split):
            split = tuple(1 if r in aggs else 0 for r in range(world))
        return Pattern(kind=kind, order=order, split=split, pieces=draw(st.integers(1, 4)), aggregators=aggs)
    split = tuple(draw(st.lists(st.integers(0, 5), min_size=world, max_size=world)))
    if not sum(split):
        split = (1,) * world
    window = draw(st.integers(0, 5)) if kind == "ring" else 0  # a ring paced with 1..5 sends in flight
    squeezed = tuple(sorted(draw(st.sets(st.integers(0, world - 1))))) if kind == "pipelined" else ()
    return Pattern(kind=kind, order=order, split=split, pieces=draw(st.integers(1, 4)), window=window,
                   squeeze=squeezed)


@settings(max_examples=40)
@given(data=st.data(), world=st.integers(2, 8), n=st.integers(1, 300), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**31))
def test_every_pattern_gives_the_reference_bits(data, world, n, dtype, seed):
    xs = _inputs(world, n, dtype, seed)
    want = _run(world, xs, None)
    expect = xs[0].clone().zero_()
    for x in xs:
        expect.add_(x)
    assert torch.equal(want[0].view(torch.uint8) if dtype != torch.int64 else want[0], 
                       expect.view(torch.uint8) if dtype != torch.int64 else expect)
    pattern = data.draw(patterns(world))
    got = _run(world, xs, pattern)
    for r in range(world):
        assert torch.equal(got[r].view(torch.uint8), want[r].view(torch.uint8)), (pattern, r)


def test_the_order_of_additions_matters_for_these_inputs():
    """The test above could not fail if every order gave the same bits: here two orders differ."""
    xs = _inputs(4, 300, torch.bfloat16, 7)
    fwd, back = torch.zeros_like(xs[0]), torch.zeros_like(xs[0])
    for x in xs:
        fwd.add_(x)
    for x in reversed(xs):
        back.add_(x)
    assert not torch.equal(fwd, back)


@given(n=st.integers(0, 10_000), split=st.lists(st.integers(0, 9), min_size=1, max_size=8), pieces=st.integers(1, 9))
def test_bounds_and_pieces_cover_the_tensor_once(n, split, pieces):
    if not sum(split):
        split = [1] * len(split)
    b = bounds(n, split)
    assert b[0][0] == 0 and b[-1][1] == n and all(b[i][1] == b[i + 1][0] for i in range(len(b) - 1))
    for (lo, hi), w in zip(b, split):
        assert w or lo == hi
        ps = pieces_of(lo, hi, pieces)
        assert sum(z - a for a, z in ps) == hi - lo and all(z > a for a, z in ps)


@pytest.mark.parametrize("bad", [dict(kind="star"), dict(order=(0, 0, 1)), dict(split=(0, 0, 0)),
                                 dict(pieces=0), dict(kind="tree", aggregators=()),
                                 dict(kind="tree", aggregators=(0,), split=(1, 1, 0)),
                                 dict(kind="chain", order=(1, 0, 2)), dict(window=-1),
                                 dict(kind="pipelined", window=2), dict(squeeze=(1,)),
                                 dict(kind="pipelined", squeeze=(3,)), dict(kind="pipelined", squeeze=(1, 0))])
def test_bad_patterns_are_refused(bad):
    base = dict(kind="ring", order=(0, 1, 2), split=(1, 1, 1))
    with pytest.raises(ValueError):
        Pattern(**{**base, **bad})


@pytest.mark.parametrize("world", [2, 3, 5, 8])
@pytest.mark.parametrize("pieces", [1, 7])
def test_the_chain_gives_the_reference_bits(world, pieces):
    xs = _inputs(world, 1000, torch.float32, world * 10 + pieces)
    want = _run(world, xs, None)
    got = _run(world, xs, Pattern(kind="chain", order=tuple(range(world)), split=(1,) * world, pieces=pieces))
    for r in range(world):
        assert torch.equal(got[r].view(torch.uint8), want[r].view(torch.uint8)), r


@pytest.mark.parametrize("world", [2, 3, 4, 7])
@pytest.mark.parametrize("window", [1, 2, 4])
def test_a_paced_ring_gives_the_reference_bits(world, window):
    """Paced, a rank sends rows and all-gather pieces in schedule order with `window` in flight and
    its peers' receives are posted in that order: with 1 in flight every send waits for the last."""
    xs = _inputs(world, 2000, torch.float32, world * 10 + window)
    want = _run(world, xs, None)
    ring = Pattern(kind="ring", order=tuple(reversed(range(world))), split=(3,) + (1,) * (world - 1), pieces=9,
                   window=window)
    got = _run(world, xs, ring)
    for r in range(world):
        assert torch.equal(got[r].view(torch.uint8), want[r].view(torch.uint8)), r


def test_a_pattern_keeps_its_window_through_json():
    p = Pattern(kind="ring", order=(2, 0, 1), split=(1, 2, 0), pieces=5, window=3)
    assert Pattern.from_json(p.to_json()) == p
    old = {k: v for k, v in p.to_json().items() if k not in ("window", "squeeze")}  # recorded before both
    assert Pattern.from_json(old).window == 0 and Pattern.from_json(old).squeeze == ()
    q = Pattern(kind="pipelined", order=(0, 1, 2), split=(1, 0, 1), pieces=3, squeeze=(1,))
    assert Pattern.from_json(q.to_json()) == q


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("timed", [True, False])
def test_a_squeezed_exchange_gives_the_reference_bits_and_counts_the_bytes_sent(dtype, timed):
    """Rank 1 owns nothing and every transfer to or from it is compressed (what a plan around its slow
    link runs): the bits are the reference's, and the flow statistics see the compressed bytes."""
    world, n = 4, 30_000
    xs = _inputs(world, n, dtype, 7)
    if dtype != torch.int64:  # values as gradients look (the spread of _inputs leaves nothing to compress)
        xs = [torch.randn(n, generator=torch.Generator().manual_seed(r)).to(dtype) for r in range(world)]
    want = _run(world, xs, None)
    seen: list[tuple[int, int, int]] = []  # (rank, peer, bytes) of each receive
    seq = next(_seq)
    ts = [x.clone() for x in xs]
    plan = Pattern(kind="pipelined", order=tuple(range(world)), split=(1, 0, 1, 1), pieces=3, squeeze=(1,))

    def body(tp, r):
        allreduce(tp, ts[r], plan, seq, timed=timed)
        return ts[r]

    posted: dict[tuple[int, int], set[float]] = {}  # (rank, peer) -> the post times of its sends' records

    def counter(r):
        def rec(kind, peer, tag, nbytes, when, _ended):
            if kind == "recv":
                seen.append((r, peer, nbytes))
            elif (tag >> 18) & 3 == 0:  # rows (tag layout: patterns.tag)
                posted.setdefault((r, peer), set()).add(when)
        return rec

    got = on_ranks(world, body, on_transfer=counter)
    for r in range(world):
        assert torch.equal(got[r].view(torch.uint8), want[r].view(torch.uint8)), r
    if timed:
        raw = n * xs[0].element_size()
        into_1 = sum(b for r, _, b in seen if r == 1)  # the whole result, squeezed
        assert 0 < into_1 < raw / 1.05
        # between two ranks outside `squeeze`, the raw bytes: rank 0's rows from 2 and 3, their results
        assert sum(b for r, p, b in seen if r == 0 and p != 1) == 4 * (raw // 3)
        # squeezed rows are dated from their last post (`_Wire.settle`): one time per peer; raw ones differ
        assert all(len(posted[(1, p)]) == 1 for p in (0, 2, 3))
        assert len(posted[(0, 2)]) > 1


def test_a_squeezed_result_is_decoded_before_the_later_ones_are_waited_for(monkeypatch):
    """The rank that owns nothing decodes each squeezed result as it lands: after the last byte only
    the last piece is left to decode (all of them at the end cost 28 ms of a 0.64 s collective at
    16 MB on 8 ranks; docs/design.md, stop 55), and the bits stay the reference's."""
    import threading

    from unbroken.comm import squeeze
    from unbroken.comm.transport import Transport

    world, n = 4, 30_000
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    want = _run(world, xs, None)
    plan = Pattern(kind="pipelined", order=tuple(range(world)), split=(1, 0, 1, 1), pieces=3, squeeze=(1,))
    seq, ts = next(_seq), [x.clone() for x in xs]
    said: dict[int, list[str]] = {}  # thread -> what it did, in order
    real_wait, real_unsqueeze = Transport.wait, squeeze.unsqueeze

    def wait(self, transfers, what):
        if self.rank == 1:
            said.setdefault(threading.get_ident(), []).append("wait")
        return real_wait(self, transfers, what)

    def unsqueeze(msg, into):
        said.setdefault(threading.get_ident(), []).append("decode")
        return real_unsqueeze(msg, into)

    monkeypatch.setattr(Transport, "wait", wait)
    monkeypatch.setattr(squeeze, "unsqueeze", unsqueeze)
    got = on_ranks(world, lambda tp, r: (allreduce(tp, ts[r], plan, seq), ts[r])[1])
    for r in range(world):
        assert torch.equal(got[r].view(torch.uint8), want[r].view(torch.uint8)), r
    (steps,) = [v for v in said.values() if "wait" in v]  # rank 1's thread
    assert steps.count("decode") == 3 * 3  # three owners, three pieces each
    first = steps.index("decode")
    assert "wait" in steps[first:], steps  # a wait for a later result after the first decode


def test_a_damaged_squeezed_message_fails_the_collective_and_retires_the_group(monkeypatch):
    """A squeezed message that does not decode (here every one, a byte flipped after compression)
    raises CollectiveError naming the sender in its receiver, and that transport refuses further
    collectives (the group's message stream cannot be trusted; a new generation's group is needed)."""
    import threading

    from tests.unit.commgroups import fresh_groups
    from unbroken.comm import squeeze
    from unbroken.comm.group import CollectiveError
    from unbroken.comm.transport import Transport

    real = squeeze.squeeze

    def damaged(t):
        msg = real(t)
        msg[-5] ^= 0xFF
        return msg

    monkeypatch.setattr(squeeze, "squeeze", damaged)
    world, pgs, out = 3, fresh_groups(3), {}
    plan = Pattern(kind="pipelined", order=(0, 1, 2), split=(1, 0, 1), pieces=2, squeeze=(1,))
    seq = next(_seq)

    def body(r):
        tp = Transport(pgs[r], rank=r, world=world, timeout_s=3.0)
        try:
            allreduce(tp, torch.randn(3000), plan, seq)
            out[r] = ("ok", tp)
        except CollectiveError as e:
            out[r] = (str(e), tp)

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert not any(t.is_alive() for t in threads)
    for owner in (0, 2):  # rank 1's rows reach the owners damaged
        why, tp = out[owner]
        assert "damaged message from rank 1" in why
        with pytest.raises(CollectiveError, match="already failed"):
            tp.begin()


@settings(max_examples=10, deadline=None)
@given(world=st.integers(2, 6), sizes=st.lists(st.integers(1, 400), min_size=2, max_size=5),
       dtypes=st.lists(st.sampled_from(DTYPES), min_size=5, max_size=5), seed=st.integers(0, 2**31),
       data=st.data())
def test_collectives_in_a_row_on_one_transport_give_the_reference_bits(world, sizes, dtypes, seed, data):
    """The receive buffers (Transport.scratch) are reused from one collective to the next, at sizes and
    dtypes that grow and shrink: every result still has the reference's bits."""
    runs = [(_inputs(world, n, dtypes[k], seed + k), data.draw(patterns(world))) for k, n in enumerate(sizes)]
    want = [_run(world, xs, None) for xs, _ in runs]
    seq0 = next(_seq) * 100

    def body(tp, r):
        out = []
        for k, (xs, p) in enumerate(runs):
            t = xs[r].clone()
            allreduce(tp, t, p, seq0 + k, timed=bool(k % 2))
            out.append(t)
        return out

    got = on_ranks(world, body)
    for k in range(len(runs)):
        for r in range(world):
            assert torch.equal(got[r][k].view(torch.uint8), want[k][r].view(torch.uint8)), (runs[k][1], k, r)

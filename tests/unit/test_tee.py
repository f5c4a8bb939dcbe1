"""--tee (runtime/tee.py): parsing the selection, splitting log bytes into lines, following
log files under the rank each process holds now."""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.runtime.tee import ALL, LineSplitter, Tee, check_tee_ranks, parse_tee, prefixed


@pytest.mark.parametrize("text,want", [("0", frozenset({0})), (" 0, 3 ", frozenset({0, 3})), ("all", ALL),
                                       ("ALL", ALL), ("none", frozenset())])
def test_parse_tee(text, want):
    assert parse_tee(text) == want


@pytest.mark.parametrize("text", ["", "x", "1,,2", "-1", "1.5", "0;3", "all,0"])
def test_parse_tee_refuses_bad_values_naming_the_flag(text):
    with pytest.raises(ValueError, match=r"--tee must be 'all', 'none' or rank numbers.*e\.g\. --tee 0,3"):
        parse_tee(text)


def test_a_rank_the_job_does_not_have_is_refused():
    with pytest.raises(ValueError, match=r"--tee names rank 4 but the job has ranks 0\.\.3"):
        check_tee_ranks("0,4", 4)
    check_tee_ranks("all", 4)
    check_tee_ranks("3", 4)


def _pieces(b: bytes, m: int) -> list[bytes]:
    return [b[i:i + m] for i in range(0, len(b), m)]


def _reference(data: bytes, m: int) -> list[bytes]:
    """Every newline-terminated line (cut into pieces of m bytes), then the partial last one."""
    *complete, tail = data.split(b"\n")
    return [p for line in complete for p in (_pieces(line, m) or [b""])] + _pieces(tail, m)


_TEXT = st.lists(st.sampled_from([b"a", b"bc", b"\n", b"\r\n", b"\xc3\xa9", b"\xff", b" "]), max_size=80).map(b"".join)


@settings(max_examples=300, deadline=None)
@given(data=_TEXT, cuts=st.lists(st.integers(0, 200), max_size=12), m=st.sampled_from([1, 2, 3, 7, 64 * 1024]))
def test_any_chunking_of_the_bytes_gives_the_same_lines(data, cuts, m):
    bounds = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    split = LineSplitter(max_line=m)
    got = []
    for a, b in zip(bounds, bounds[1:]):
        got += split.feed(data[a:b])
    got += split.flush()
    assert got == _reference(data, m)
    assert prefixed(3, got) == prefixed(3, _reference(data, m))


def test_prefixed_drops_a_crlf_cr_and_replaces_bad_utf8():
    assert prefixed(2, [b"x\r", b"\xc3\xa9\xff", b""]) == "[rank 2] x\n[rank 2] \xe9\ufffd\n[rank 2] \n"


class _Console:
    def __init__(self) -> None:
        self.text, self.lock = "", threading.Lock()

    def write(self, text: str) -> None:
        with self.lock:
            self.text += text

    def wait_for(self, needle: str, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        while needle not in self.text:
            assert time.monotonic() < deadline, f"{needle!r} not written within {timeout_s}s: {self.text!r}"
            time.sleep(0.01)


def _append(log_dir, proc: str, data: bytes) -> None:
    with open(log_dir / f"{proc}.log", "ab") as f:
        f.write(data)


def test_the_prefix_follows_the_rank_and_a_leaving_process_is_flushed(tmp_path):
    con = _Console()
    tee = Tee(tmp_path, "0", node=0, write=con.write, poll_s=0.02)
    tee.follow(0, {0: "n0-w0", 1: "n0-w1"})
    tee.start()
    try:
        _append(tmp_path, "n0-w1", b"rank one\n")
        _append(tmp_path, "n0-w0", b"first\npart")
        con.wait_for("[rank 0] first\n")
        _append(tmp_path, "n0-s0", b"shadow start\n")  # a standby shadow: not shown yet
        time.sleep(0.1)
        assert "part" not in con.text and "shadow" not in con.text
        tee.follow(1, {0: "n0-s0", 1: "n0-w1"})  # the shadow takes rank 0; n0-w0 died
        con.wait_for("[rank 0] shadow start\n")
        assert "[rank 0] part\n" in con.text  # the dead one's partial last line, under its old rank
        _append(tmp_path, "n0-w0", b"after\n")
        _append(tmp_path, "n0-s0", b"step 5\nlast")
        con.wait_for("[rank 0] step 5\n")
    finally:
        tee.stop()
    assert con.text.endswith("[rank 0] last\n")  # stop() flushes the final partial line
    assert "after" not in con.text and "rank one" not in con.text
    assert con.text.index("[rank 0] part") < con.text.index("[rank 0] shadow start")


def test_all_shows_this_node_s_processes_only(tmp_path):
    con = _Console()
    tee = Tee(tmp_path, "all", node=1, write=con.write, poll_s=0.02)
    for proc in ("n0-w0", "n1-w1", "n1-w2"):
        _append(tmp_path, proc, f"from {proc}\n".encode())
    tee.follow(0, {0: "n0-w0", 1: "n1-w1", 2: "n1-w2"})
    tee.start()
    tee.stop()
    assert sorted(con.text.splitlines()) == ["[rank 1] from n1-w1", "[rank 2] from n1-w2"]


def test_none_starts_no_thread_and_shows_nothing(tmp_path):
    con = _Console()
    _append(tmp_path, "n0-w0", b"hidden\n")
    tee = Tee(tmp_path, "none", node=0, write=con.write, poll_s=0.02)
    tee.follow(0, {0: "n0-w0"})
    tee.start()
    assert tee._thread is None
    tee.stop()
    assert con.text == ""


def test_a_broken_console_stops_the_tee_not_the_run(tmp_path):
    calls = []

    def broken(text: str) -> None:
        calls.append(text)
        raise BrokenPipeError(32, "Broken pipe")

    tee = Tee(tmp_path, "0", node=0, write=broken, poll_s=0.02)
    tee.follow(0, {0: "n0-w0"})
    tee.start()
    _append(tmp_path, "n0-w0", b"one\n")
    deadline = time.monotonic() + 5
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    _append(tmp_path, "n0-w0", b"two\n")
    tee.stop()
    assert calls == ["[rank 0] one\n"]  # tried once, then no more writes


def test_stop_returns_within_its_timeout_while_the_console_blocks(tmp_path):
    release = threading.Event()
    tee = Tee(tmp_path, "0", node=0, write=lambda text: release.wait(10), poll_s=0.02)
    _append(tmp_path, "n0-w0", b"stuck\n")
    tee.follow(0, {0: "n0-w0"})
    tee.start()
    thread = tee._thread
    time.sleep(0.1)  # the thread is now inside write()
    t0 = time.monotonic()
    tee.stop(timeout_s=0.3)
    assert time.monotonic() - t0 < 2
    release.set()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_a_follower_node_learns_generations_from_the_store(tmp_path):
    import torch.distributed as dist

    from unbroken.runtime import membership

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    con = _Console()
    tee = Tee(tmp_path, "1", node=1, write=con.write, poll_s=0.02)
    membership.publish(store, membership.Generation(0, {0: "n0-w0", 1: "n1-w1"}, (), "start"))
    membership.publish(store, membership.Generation(1, {0: "n0-w0", 1: "n1-s0"}, (1,), "sigkill@rank1"))
    _append(tmp_path, "n1-s0", b"replacement\n")
    tee.follow(0, {0: "n0-w0", 1: "n1-w1"})
    tee.follow_store(store)
    tee.start()
    tee.stop()
    assert con.text == "[rank 1] replacement\n"

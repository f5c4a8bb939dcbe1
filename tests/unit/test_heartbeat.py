"""The heartbeat rides out store errors (issue 12, item 8).

It used to return on the first RuntimeError; the supervisor then saw no heartbeats and
killed a healthy worker as hung. `beat_until_unreachable` runs here on a fake clock.
"""
from __future__ import annotations

import time

import pytest

from unbroken.runtime.context import beat_until_unreachable

pytestmark = pytest.mark.timeout(30)


class _Stop(BaseException):
    """Ends the otherwise endless loop once the test has seen enough."""


class _Rig:
    """A fake store connection, clock and sleep; `fail` says which send attempts raise."""

    def __init__(self, fail, *, stop_after_beats: int = 3) -> None:
        self.fail, self.stop_after = fail, stop_after_beats
        self.t, self.attempts, self.beats, self.connects = 0.0, 0, [], 0
        self.sleeps: list[float] = []

    def send(self, client) -> None:
        self.attempts += 1
        if self.fail(self.attempts):
            raise RuntimeError("Connection reset by peer")  # what a TCPStore client raises
        self.beats.append((self.t, client))
        if len(self.beats) >= self.stop_after:
            raise _Stop

    def connect(self):
        self.connects += 1
        return f"client{self.connects}"

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.t += s

    def run(self, **kw):
        kw = {"interval_s": 0.1, "give_up_s": 60.0, **kw}
        return beat_until_unreachable(self.send, self.connect, "client0", sleep=self.sleep,
                                      clock=lambda: self.t, **kw)


def test_beats_resume_after_failures_with_a_growing_capped_backoff_and_a_reconnect():
    rig = _Rig(lambda n: 2 <= n <= 8)  # one beat, seven failed attempts, then the store is back
    with pytest.raises(_Stop):
        rig.run()
    assert [c for _, c in rig.beats] == ["client0", "client7", "client7"]  # a fresh client after the outage
    assert rig.connects == 7  # one reconnect before each retry
    backoff = rig.sleeps[1:8]
    assert backoff == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0])
    assert rig.sleeps[8:] == pytest.approx([0.1])  # back to the normal interval once beating again


def test_a_failed_reconnect_is_one_more_failed_attempt():
    rig = _Rig(lambda n: n == 1)
    calls = {"n": 0}
    real_connect = rig.connect

    def flaky_connect():
        calls["n"] += 1
        if calls["n"] <= 2:
            raise RuntimeError("connect() timed out")
        return real_connect()

    rig.connect = flaky_connect
    with pytest.raises(_Stop):
        rig.run()
    assert [c for _, c in rig.beats] == ["client1"] * 3
    assert rig.sleeps[:3] == pytest.approx([0.1, 0.2, 0.4])


def test_the_backoff_cap_is_never_below_the_interval():
    rig = _Rig(lambda n: n <= 4, stop_after_beats=1)
    with pytest.raises(_Stop):
        rig.run(interval_s=2.0)
    assert rig.sleeps == pytest.approx([2.0, 2.0, 2.0, 2.0])


def test_a_sustained_outage_gives_up_after_the_limit_and_returns_the_error():
    rig = _Rig(lambda n: n >= 3)  # two beats, then the store never answers again
    err = rig.run(give_up_s=10.0)
    assert isinstance(err, RuntimeError) and len(rig.beats) == 2
    first_failure = rig.beats[-1][0] + 0.1
    assert 10.0 <= rig.t - first_failure < 10.0 + 1.0  # gives up within one capped backoff of the limit


def test_a_brief_outage_shorter_than_the_limit_never_gives_up():
    # Failing for 9 s of a 10 s budget, twice, with a beat between: the budget restarts after a beat.
    rig = _Rig(lambda n: n not in (1, 12, 23), stop_after_beats=3)
    with pytest.raises(_Stop):
        rig.run(give_up_s=10.0)
    assert len(rig.beats) == 3


class _Proxy:
    """A TCP forwarder between store clients and the store; `cut()` resets every connection
    through it (the store looks gone to the client), later connections go through again."""

    def __init__(self, port: int) -> None:
        import socket
        import threading

        self._target, self._conns, self._lock = ("127.0.0.1", port), [], threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while True:
            try:
                a, _ = self._listener.accept()
                b = socket.create_connection(self._target, timeout=5)
            except OSError:
                return
            with self._lock:
                self._conns += [a, b]
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pump(src, dst) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.close()
            except OSError:
                pass

    def cut(self) -> None:
        import socket

        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self._listener.close()
        self.cut()


def test_the_real_heartbeat_thread_survives_a_broken_store_connection():
    import json
    from datetime import timedelta

    import torch.distributed as dist

    from unbroken.config import RunConfig
    from unbroken.runtime.context import ProcessContext

    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    proxy = _Proxy(master.port)
    try:
        cfg = RunConfig(heartbeat_s=0.02, hang_timeout_s=2.0, collective_timeout_s=30.0)
        ctx = ProcessContext(proc="w0", role="worker", rank=0, node=0, run_dir=None, config=cfg, store=None,
                             host="127.0.0.1", port=proxy.port, events=None, faults=None)
        thread = ctx.start_heartbeat()
        master.wait(["hb/w0"], timedelta(seconds=10))
        ctx.set_phase("after-cut", step=7)
        proxy.cut()  # the heartbeat's next put fails: it used to return here, for good
        deadline = time.monotonic() + 20
        while json.loads(master.get("hb/w0")).get("phase") != "after-cut":
            assert time.monotonic() < deadline, "no heartbeat after the store connection broke"
            assert thread.is_alive(), "the heartbeat thread died on a store error"
            time.sleep(0.01)
        assert thread.is_alive()
    finally:
        proxy.close()


def test_heartbeats_go_to_the_node_store_the_supervisor_names_else_to_the_job_store(monkeypatch):
    from unbroken.runtime import node_heartbeats

    node = node_heartbeats.host(5.0)
    assert node._listener.getsockname()[0] == "127.0.0.1"  # loopback only, like the job's store
    monkeypatch.setenv(node_heartbeats.ENV, str(node.port))
    client = node_heartbeats.connect(5.0, fallback=lambda: pytest.fail("the job's store was used"))
    client.set("hb/n0-w1", "beat")
    assert node.store.get("hb/n0-w1") == b"beat"
    monkeypatch.delenv(node_heartbeats.ENV)
    job = object()
    assert node_heartbeats.connect(5.0, fallback=lambda: job) is job

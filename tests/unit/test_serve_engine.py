"""Continuous batching: a request's tokens do not depend on who shares its batch or when it joined;
requests whose adapters find no free slot wait and are served later."""
import pytest
import torch

from unbroken.serve.adapters import RequestError, write_adapter
from unbroken.serve.config import ConfigError, ServeConfig, serve_model
from unbroken.serve.engine import Engine, Request, encode

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("adapters")
    for i, r in enumerate((4, 8, 16, 8)):
        write_adapter(d, f"a{i}", model=serve_model(), rank=r, seed=i, std=0.2)
    return d


def _alone(engine, adapter, prompt, n):
    r = engine.submit(Request(adapter, encode(prompt), n))
    engine.run_until_idle()
    return r.out


def test_batched_and_joining_requests_decode_as_if_alone(adapter_dir):
    e = Engine(ServeConfig(max_batch=4, slots=2), adapter_dir)
    jobs = [("a0", "hello", 6), ("a1", "the quick brown", 4), (None, "xy", 5), ("a2", "abc", 7), ("a3", "zz top", 3)]
    want = [_alone(e, *j) for j in jobs]
    reqs = [e.submit(Request(a, encode(p), n)) for a, p, n in jobs[:2]]
    e.step()
    e.step()  # the first two are mid-way when the others arrive
    reqs += [e.submit(Request(a, encode(p), n)) for a, p, n in jobs[2:]]
    e.run_until_idle()
    assert [r.out for r in reqs] == want
    assert e.cache.evictions > 0 and e.metrics.tokens == 2 * sum(n for *_, n in jobs)


def test_requests_wait_for_a_slot_instead_of_failing(adapter_dir):
    e = Engine(ServeConfig(max_batch=8, slots=1), adapter_dir)
    reqs = [e.submit(Request(f"a{i}", encode("hi"), 3)) for i in range(3)]
    e.step()
    assert len(e.running) == 1 and len(e.waiting) == 2  # one slot: the others queue
    e.run_until_idle()
    assert all(len(r.out) == 3 for r in reqs) and e.cache.loads == 3


def test_bad_requests_are_refused_with_a_status(adapter_dir):
    e = Engine(ServeConfig(max_waiting=1), adapter_dir)
    with pytest.raises(RequestError, match="longer than the context"):
        e.submit(Request("a0", encode("x" * 60), 10))
    with pytest.raises(RequestError, match="unknown adapter"):
        e.submit(Request("nope", encode("x"), 1))
    e.submit(Request("a0", encode("x"), 1))
    with pytest.raises(RequestError, match="over its memory limit") as err:
        e.submit(Request("a0", encode("x"), 1))
    assert err.value.status == 429
    e.run_until_idle()
    assert e.metrics.requests["a0"] == 1


def test_config_over_memory_is_a_config_error():
    with pytest.raises(ConfigError, match="over memory_mb"):
        ServeConfig(slots=64, max_rank=64, memory_mb=8)


def test_an_engine_fault_fails_its_batch_and_the_engine_goes_on(adapter_dir):
    import threading
    import time

    e = Engine(ServeConfig(), adapter_dir)
    model, done = e.model, []
    finished = threading.Semaphore(0)

    def boom(idx):
        raise RuntimeError("boom")

    e.model = boom
    stop = threading.Event()
    t = threading.Thread(target=e.serve, args=(stop,))
    t.start()
    try:
        on_done = lambda r: (done.append(r), finished.release())  # noqa: E731
        e.submit(Request("a0", encode("hi"), 2, on_done=on_done))
        assert finished.acquire(timeout=10)
        e.model = model
        e.submit(Request("a0", encode("hi"), 2, on_done=on_done))
        assert finished.acquire(timeout=10)
    finally:
        stop.set()
        t.join(10)
    assert done[0].error.status == 500 and "boom" in str(done[0].error)
    assert done[1].error is None and len(done[1].out) == 2 and e.cache.resident() == ["a0"]


def test_the_engine_logs_what_the_twin_is_fitted_to(adapter_dir):
    """Every iteration: rows, padded length, largest rank, loads, wall and CPU seconds (CPU <= wall,
    both > 0); every admission: the hand-off delay and, for an idle engine, its wake-up."""
    e = Engine(ServeConfig(max_batch=4, slots=2), adapter_dir)
    e.submit(Request("a0", encode("hello"), 3))
    e.run_until_idle()
    e.submit(Request("a1", encode("abc"), 2))
    e.submit(Request("a2", encode("zz"), 2))
    e.run_until_idle()
    want = [(1, 5, 4, 1), (1, 6, 4, 0), (1, 7, 4, 0), (2, 3, 16, 2), (2, 4, 16, 0)]  # rows, length, rank, loads
    assert [rec[:4] for rec in e.iteration_log] == want
    assert all(0 < rec[5] <= rec[4] * 1.05 + 1e-4 for rec in e.iteration_log)
    assert [rec[6] == 0 for rec in e.iteration_log] == [True, False, False, True, False]  # after idleness
    assert len(e.admission_log) == 3 and all(d >= 0 and w is not None and w >= 0 for d, w in e.admission_log)
    assert e.logs()["iterations_total"] == 5 and e.logs()["admissions_total"] == 3


def test_a_log_and_its_count_are_read_together(adapter_dir):
    """GET /v1/iterations slices by the counts: read while the engine runs, a count never runs ahead
    of its log (it did when the count was the engine's iteration counter)."""
    import threading
    import time

    e = Engine(ServeConfig(max_batch=4, slots=2), adapter_dir)
    stop = threading.Event()
    t = threading.Thread(target=e.serve, args=(stop,), daemon=True)
    t.start()
    try:
        reqs = [e.submit(Request(f"a{i % 3}", encode("abc"), 12)) for i in range(8)]
        deadline = time.monotonic() + 30
        reads = 0
        while any(len(r.out) < r.max_tokens and r.error is None for r in reqs):
            assert time.monotonic() < deadline, "the engine did not finish 8 short requests within 30 s"
            snap = e.logs()
            reads += 1
            assert snap["iterations_total"] == len(snap["iterations"])
            assert snap["admissions_total"] == len(snap["admissions"])
            # A reader that never lets go of the GIL starves the engine: each torch call in an
            # iteration waits a switch interval (5 ms) for it, and 8 requests took minutes.
            time.sleep(0.0002)
        assert [r.error for r in reqs] == [None] * 8 and reads >= 2
    finally:
        stop.set()
        t.join(10)
    assert not t.is_alive()

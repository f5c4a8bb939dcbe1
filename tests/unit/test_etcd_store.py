"""The etcd store adapter keeps torch.distributed.Store's semantics (runtime/etcd_store.py), and the
leader role moves by compare_set to the lowest survivor (runtime/failover.py). The adapter's tests
need `etcd` and the etcd3gw client (skipped with the reason without them); the URL and failover
tests run anywhere (failover over an in-process HashStore)."""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from unbroken.runtime import etcd_cluster, failover, lease
from unbroken.runtime.etcd_store import EtcdSpec, EtcdStore, StoreUrlError
from unbroken.runtime.options import LaunchError

pytestmark = pytest.mark.timeout(120)
needs_etcd = pytest.mark.skipif(etcd_cluster.missing_reason() is not None,
                                reason=f"etcd store: {etcd_cluster.missing_reason()}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if etcd_cluster.missing_reason():
        pytest.skip(etcd_cluster.missing_reason())
    with etcd_cluster.running(etcd_cluster.scratch_dir("unbroken-unit-etcd", tmp_path_factory.mktemp("etcd"))) as members:
        yield members


@pytest.fixture
def store(cluster, request):
    return EtcdStore(etcd_cluster.url(cluster, request.node.name), timeout_s=10)


def test_the_url_names_endpoints_and_a_prefix_and_bad_ones_say_how_to_write_it():
    spec = EtcdSpec.parse("etcd://10.0.0.1:2379,10.0.0.2:2381/job7")
    assert spec.endpoints == (("10.0.0.1", 2379), ("10.0.0.2", 2381)) and spec.prefix == "/job7/"
    assert EtcdSpec.parse("etcd://h:1").prefix == "/unbroken/"
    for bad in ("tcp://h:1", "etcd://", "etcd://h", "etcd://h:0", "etcd://h:x/j"):
        with pytest.raises(StoreUrlError, match="etcd://"):
            EtcdSpec.parse(bad)


@needs_etcd
def test_wait_times_out_with_a_store_error_and_wakes_when_the_key_lands(store):
    t = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="wait timeout"):
        store.wait(["never"], timedelta(seconds=0.4))
    assert 0.4 <= time.monotonic() - t < 5
    threading.Timer(0.3, lambda: EtcdStore(store.spec, timeout_s=10).set("late", "v")).start()
    store.wait(["late"], timedelta(seconds=10))
    assert store.get("late") == b"v"


@needs_etcd
def test_compare_set_follows_tcpstore(store):
    assert store.compare_set("k", "", "a") == b"a"  # missing + empty expected: created
    assert store.compare_set("k", "x", "b") == b"a"  # wrong expected: unchanged, current value
    assert store.compare_set("k", "a", "b") == b"b"
    assert store.compare_set("missing", "x", "y") == b"x"  # missing + non-empty expected: TCPStore's answer
    assert not store.check(["missing"])


@needs_etcd
def test_add_is_atomic_across_clients(store):
    def bump():
        s = EtcdStore(store.spec, timeout_s=10)
        for _ in range(10):
            s.add("n", 1)
    threads = [threading.Thread(target=bump) for _ in range(4)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert store.add("n", 0) == 40 and store.get("n") == b"40"


@needs_etcd
def test_check_delete_num_keys_and_prefixes_keep_jobs_apart(store):
    store.set("a", b"\x00\xff")
    assert store.get("a") == b"\x00\xff" and store.check(["a"]) and not store.check(["a", "b"])
    child = store.prefixed("gen0/world")
    child.set("a", "other")
    assert store.get("a") == b"\x00\xff" and child.get("a") == b"other"
    assert store.num_keys() == 2
    assert store.delete_key("a") and not store.delete_key("a") and not store.check(["a"])


@needs_etcd
def test_read_many_is_one_read_of_many_keys_past_etcds_transaction_limit(store):
    keys = [f"done/{r}" for r in range(150)]  # etcd takes at most 128 operations per transaction
    for r in range(0, 150, 7):
        store.set(keys[r], str(r))
    got = store.read_many(keys + ["missing"])
    assert got == [str(r).encode() if r % 7 == 0 else None for r in range(150)] + [None]
    assert not store.check(keys) and store.check(keys[::7])


@needs_etcd
def test_a_gloo_group_rendezvous_through_the_store(store):
    import torch

    out = []

    def rank(r):
        pg = dist.ProcessGroupGloo(EtcdStore(store.spec, timeout_s=10).prefixed("pg"), r, 2, timedelta(seconds=30))
        x = torch.full((3,), float(r + 1))
        pg.allreduce([x]).wait()
        out.append(x.tolist())
    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert out == [[3.0] * 3, [3.0] * 3]


@needs_etcd
def test_the_store_survives_the_loss_of_the_member_it_talks_to(tmp_path):
    with etcd_cluster.running(etcd_cluster.scratch_dir("unbroken-unit-etcd-kill", tmp_path)) as members:
        s = EtcdStore(etcd_cluster.url(members, "k"), timeout_s=20)
        s.set("before", "1")
        etcd_cluster.kill_member(members[0])
        assert s.add("n", 1) == 1 and s.get("before") == b"1"


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_the_lowest_survivor_claims_the_leader_role_once_and_the_old_leader_is_deposed():
    store, clock = dist.HashStore(), _Clock()
    store.set(failover.LEADER_KEY, "0")
    w1 = failover.LeaderWatch(1, 3, lease_s=1.0, clock=clock)
    w2 = failover.LeaderWatch(2, 3, lease_s=1.0, clock=clock)
    for w in (w1, w2):
        assert w.poll(store) is None
    failover.check_still_leader(store, 0)
    for _ in range(3):  # node 0 stops renewing; nodes 1 and 2 keep on
        clock.t += 0.6
        lease.renew(store, 1)
        lease.renew(store, 2)
        assert w2.poll(store) is None  # node 1 is alive and lower: node 2 never claims
        won = w1.poll(store)
        if won:
            break
    assert won is not None and won[0] == 0 and won[1] > 1.0
    assert store.get(failover.LEADER_KEY) == b"1" and w1.poll(store) is None and w2.poll(store) is None
    with pytest.raises(LaunchError, match="node 1 leads"):
        failover.check_still_leader(store, 0)


def test_a_throwaway_cluster_leaves_a_small_dev_shm_for_the_fallback(tmp_path, monkeypatch):
    # CI's container gave /dev/shm 64 MB: every member panicked preallocating its 64 MB WAL
    free = {"bytes": 64 << 20}
    monkeypatch.setattr(etcd_cluster.shutil, "disk_usage", lambda _p: type("U", (), {"free": free["bytes"]})())
    assert etcd_cluster.scratch_dir("c", tmp_path).parent == tmp_path
    free["bytes"] = 4 << 30
    expected = tmp_path if not etcd_cluster.Path("/dev/shm").is_dir() else etcd_cluster.Path("/dev/shm")
    assert etcd_cluster.scratch_dir("c", tmp_path).parent == expected


def test_a_member_that_exits_at_start_is_reported_with_its_logged_reason(tmp_path):
    log = tmp_path / "m0.log"
    log.write_text('{"level":"warn","msg":"failed to preallocate"}\n'
                   '{"level":"panic","msg":"failed to create WAL","error":"no space left on device"}\n'
                   "panic: failed to create WAL\n\tgoroutine 1\n")
    assert etcd_cluster._log_reason(log) == "failed to create WAL: no space left on device"
    log.write_text("plain text\nlast words\n")
    assert etcd_cluster._log_reason(log) == "last words"


@needs_etcd
def test_members_killed_at_start_are_named_with_their_signal_and_the_cluster_starts_again(tmp_path, monkeypatch,
                                                                                        capsys):
    real = etcd_cluster.etcd_binary()
    fake = tmp_path / "etcd"  # the first start's members ($4: --data-dir) die by SIGKILL before logging
    fake.write_text(f"#!/bin/sh\ncase \"$4\" in *-again/*) exec {real} \"$@\";; esac\nkill -9 $$\n")
    fake.chmod(0o755)
    monkeypatch.setattr(etcd_cluster, "etcd_binary", lambda: str(fake))
    with etcd_cluster.running(tmp_path / "c") as members:
        assert EtcdStore(etcd_cluster.url(members, "again"), timeout_s=10).add("n", 1) == 1
    err = capsys.readouterr().err
    assert "killed by SIGKILL" in err and "log empty" in err and "starting it again" in err
    assert not (tmp_path / "c").exists() and not (tmp_path / "c-again").exists()


@needs_etcd
def test_members_read_as_alive_when_proc_does_not_show_them(tmp_path, monkeypatch):
    """In a container /proc can belong to another pid namespace (CI read three live members as dead):
    the members this process started answer from their Popen, not from /proc."""
    real_path = etcd_cluster.Path

    def no_proc(p, *a):
        if str(p).startswith("/proc/"):
            return real_path("/proc/no-such-pid") / "x"
        return real_path(p, *a)

    monkeypatch.setattr(etcd_cluster, "Path", no_proc)
    with etcd_cluster.running(real_path(tmp_path) / "c") as members:
        assert all(etcd_cluster._alive(m.pid) for m in members)
        assert EtcdStore(etcd_cluster.url(members, "ns"), timeout_s=10).add("n", 2) == 2
    assert not any(etcd_cluster._alive(m.pid) for m in members)

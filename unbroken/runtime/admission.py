"""How a node gets into the job: the store, the code it runs, the join token, node 0's config.

Node 0 hosts the store (listening on exactly the address asked for), publishes what code it
runs (runtime/codeid.py), judges every other node's join attempt (runtime/auth.py) and
publishes the config and whether the job resumes; a joining node connects, refuses to join
if it runs other code, proves it knows the token and takes node 0's config.
"""
from __future__ import annotations

import json
import time
from datetime import timedelta

import torch.distributed as dist

from unbroken.config import RunConfig
from unbroken.fsutil import atomic_write_json
from unbroken.runtime import auth, codeid, membership
from unbroken.runtime.options import LaunchError, LaunchOptions


def open_store(opts: LaunchOptions) -> tuple[dist.Store, int, object]:
    """(store, port, listening socket or None): node 0 hosts it, a joiner connects and joins."""
    leader = opts.node_rank == 0
    listener = None
    if opts.store is not None:
        return _open_replicated(opts), 0, None
    try:
        if leader:
            store, listener = membership.listen_store(opts.host, opts.port, timeout_s=30)
        else:
            store = membership.connect_store(opts.host, opts.port, timeout_s=30)
    except (RuntimeError, OSError) as e:
        if leader:
            raise LaunchError(f"cannot listen on {opts.host}:{opts.port} ({str(e).splitlines()[0][:120]}); "
                              "the port is probably in use: choose another with --port, or omit it") from None
        raise LaunchError(f"cannot reach node 0's store at {opts.host}:{opts.port}; start node 0 first "
                          "and check --host/--port") from None
    if leader:
        store.set("code", json.dumps(codeid.identity(opts.script)))
        store.set("token_required", "1" if opts.token else "0")
    else:
        _join(store, opts)
    return store, (store.port if leader else opts.port), listener


def _open_replicated(opts: LaunchOptions) -> dist.Store:
    """The etcd cluster named by --store (runtime/etcd_store.py): node 0 claims the job's prefix."""
    from unbroken.runtime.etcd_store import EtcdStore

    store = EtcdStore(opts.store, timeout_s=30)
    try:
        taken = store.check(["code"])
    except RuntimeError as e:
        raise LaunchError(f"cannot reach the etcd cluster {opts.store} ({str(e).splitlines()[0][:160]}); "
                          "start it (unbroken store start --dir DIR) and check --store") from None
    if opts.node_rank == 0:
        if taken:
            raise LaunchError(f"the store prefix {store.spec.prefix!r} of {opts.store} already holds a job's keys: "
                              "give this job its own prefix (etcd://HOSTS/NEW-NAME)")
        store.set("code", json.dumps(codeid.identity(opts.script)))
        store.set("token_required", "1" if opts.token else "0")
        store.set("leader", "0")  # runtime/failover.py: who leads; a survivor takes it over by compare_set
    else:
        _join(store, opts)
    return store


def _join(store: dist.Store, opts: LaunchOptions) -> None:
    store.wait(["code", "token_required"], timedelta(seconds=30))
    why = codeid.mismatch(codeid.identity(opts.script), json.loads(store.get("code")), opts.node_rank)
    if why:
        n = store.add(f"mismatch/{opts.node_rank}/count", 1)
        store.set(f"mismatch/{opts.node_rank}/{n}", why)  # node 0 records it (wait_for_nodes)
        raise LaunchError(why)
    if store.get("token_required").decode() == "1":
        try:
            auth.request_join(store, token=opts.token or "", node=opts.node_rank, timeout_s=30)
        except (auth.JoinRefused, TimeoutError) as e:
            raise LaunchError(str(e)) from None
    else:
        store.set(f"joined/{opts.node_rank}", "1")


def agree_on_config(store: dist.Store, cfg: RunConfig, opts: LaunchOptions, events) -> tuple[RunConfig, bool]:
    """Node 0's config is the job's, and whether it resumes: joiners take both (and write the
    config where their workers read it). Returns (config, resume)."""
    if opts.node_rank == 0:
        store.set("resume", "1" if opts.resume else "0")  # joiners resume when node 0 does
        store.set("config", json.dumps(cfg.to_dict()))
        return cfg, opts.resume
    store.wait(["config"], timedelta(seconds=30))
    theirs = RunConfig.from_dict(json.loads(store.get("config")))
    if theirs != cfg:
        events.emit("warning", message=f"node {opts.node_rank}: using node 0's config (it differs from this "
                                       "node's flags/file)")
    atomic_write_json(opts.run_dir / "config.json", theirs.to_dict())
    return theirs, store.get("resume") == b"1"


def wait_for_nodes(store: dist.Store, opts: LaunchOptions, events, timeout_s: float = 120.0) -> set[int]:
    """Node 0: admit every other node, by its token's proof (auth.JoinGate) or its word without one."""
    if opts.nnodes == 1:
        return set()
    gate = auth.JoinGate(store, token=opts.token, nnodes=opts.nnodes, events=events) if opts.token else None
    joined: set[int] = set()
    mismatches = {n: 0 for n in range(1, opts.nnodes)}  # per node: refusals already recorded
    deadline = time.monotonic() + timeout_s
    while len(joined) < opts.nnodes - 1:
        _record_mismatches(store, mismatches, events)
        if gate is not None:
            gate.poll()
            joined = set(gate.admitted)
        else:
            joined = {n for n in range(1, opts.nnodes) if store.check([f"joined/{n}"])}
        if time.monotonic() > deadline:
            raise LaunchError(f"only {len(joined) + 1} of {opts.nnodes} nodes joined within {timeout_s:.0f}s")
        time.sleep(0.05)
    return joined


def _record_mismatches(store: dist.Store, seen: dict[int, int], events) -> None:
    """A node that runs other code refused itself: say so in node 0's events, once per attempt."""
    for n, k in seen.items():
        count = store.add(f"mismatch/{n}/count", 0)
        for i in range(k + 1, count + 1):
            if store.check([f"mismatch/{n}/{i}"]):
                events.emit("join_refused", node=n, attempt=i, failures=i, retry_after_s=0,
                            why=store.get(f"mismatch/{n}/{i}").decode(errors="replace")[:400])
                seen[n] = i

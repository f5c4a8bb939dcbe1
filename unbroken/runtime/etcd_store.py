"""A `torch.distributed.Store` over an etcd v3 cluster (client: etcd3gw, etcd's HTTP/JSON gateway).

The job's keys live under one prefix per job (`etcd://h1:p1,h2:p2,h3:p3/PREFIX`). Semantics follow
TCPStore's, which the runtime and gloo's rendezvous rely on: `get` and `wait` block until the key
exists (or the timeout: DistStoreError), `add` is an atomic counter stored as decimal text,
`compare_set` with an empty expected value creates a missing key. Atomicity comes from etcd
transactions (compare on a key's mod revision); a wait is one watch from the revision the keys were
found missing at, so a key written in between is never missed. A request that cannot reach its
member (refused, timed out) is retried on the next endpoint: the store survives any one member.
"""
from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

_REQUEST_S = 3.0  # one HTTP request to one member; past this, the next member is tried
_ADD_TRIES = 1000  # compare-and-swap retries of one add under contention
_TXN_OPS = 100  # reads per transaction: etcd refuses more than --max-txn-ops (default 128) in one


class StoreUrlError(ValueError):
    """A --store value that names no usable etcd cluster."""


@dataclass(frozen=True)
class EtcdSpec:
    endpoints: tuple[tuple[str, int], ...]
    prefix: str

    @staticmethod
    def parse(text: str) -> "EtcdSpec":
        """`etcd://host:port[,host:port...][/prefix]`."""
        example = "e.g. etcd://127.0.0.1:2379,127.0.0.1:2381,127.0.0.1:2383/myjob"
        if not text.startswith("etcd://"):
            raise StoreUrlError(f"--store {text!r} is not an etcd URL; {example} (omit --store for node 0's TCPStore)")
        hosts, _, prefix = text[len("etcd://"):].partition("/")
        endpoints = []
        for part in filter(None, hosts.split(",")):
            host, sep, port = part.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise StoreUrlError(f"--store {text!r}: {part!r} is not host:port; {example}")
            endpoints.append((host.strip("[]"), int(port)))
        if not endpoints:
            raise StoreUrlError(f"--store {text!r} names no endpoint; {example}")
        return EtcdSpec(tuple(endpoints), "/" + (prefix.strip("/") or "unbroken") + "/")

    def url(self) -> str:
        return "etcd://" + ",".join(f"{h}:{p}" for h, p in self.endpoints) + self.prefix.rstrip("/")


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else bytes(data)).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


class EtcdStore(dist.Store):
    def __init__(self, spec: EtcdSpec | str, *, timeout_s: float = 300.0) -> None:
        super().__init__()
        import etcd3gw  # the optional dependency: imported when an etcd store is asked for

        self.spec = EtcdSpec.parse(spec) if isinstance(spec, str) else spec
        self._errors = (etcd3gw.exceptions.ConnectionFailedError, etcd3gw.exceptions.ConnectionTimeoutError)
        self._timeout_exc = etcd3gw.exceptions.WatchTimedOut
        self._clients = [etcd3gw.client(host=h, port=p, timeout=_REQUEST_S) for h, p in self.spec.endpoints]
        self._at = 0  # the endpoint in use; moves on when it stops answering
        self._timeout = timedelta(seconds=timeout_s)
        self._children: list[EtcdStore] = []

    # --- transport ----------------------------------------------------------------
    def _call(self, fn):
        """fn(client) on the current endpoint; on a connection failure, the next ones, until the timeout."""
        deadline = time.monotonic() + self._timeout.total_seconds()
        last = None
        while True:
            for _ in range(len(self._clients)):
                try:
                    return fn(self._clients[self._at])
                except self._errors as e:
                    last = e
                    self._at = (self._at + 1) % len(self._clients)
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"no etcd member of {self.spec.url()} answered within "
                                          f"{self._timeout.total_seconds():.0f}s: {last}")
            time.sleep(0.1)

    def _key(self, key: str) -> str:
        return _b64(self.spec.prefix + key)

    def _txn(self, compare: list, success: list, failure: list = ()) -> dict:
        body = {"compare": compare, "success": success, "failure": list(failure)}
        return self._call(lambda c: c.transaction(body))

    def _read(self, keys: list[str]) -> tuple[list[dict | None], int]:
        """Each key's kv (None if missing) and the store revision they were read at: one request per
        _TXN_OPS keys (the revision is the first request's: a write after it is never missed by a wait)."""
        kvs, revision = [], None
        for i in range(0, max(1, len(keys)), _TXN_OPS):
            res = self._txn([], [{"request_range": {"key": self._key(k)}} for k in keys[i:i + _TXN_OPS]])
            for r in res.get("responses", []):
                found = r.get("response_range", {}).get("kvs") or []
                kvs.append(found[0] if found else None)
            revision = int(res["header"]["revision"]) if revision is None else revision
        return kvs, revision

    # --- the Store API ------------------------------------------------------------
    def set(self, key: str, value) -> None:
        self._txn([], [{"request_put": {"key": self._key(key), "value": _b64(value)}}])

    def get(self, key: str) -> bytes:
        [kv], _ = self._read([key])
        if kv is None:
            self.wait([key])
            [kv], _ = self._read([key])
        return _unb64(kv.get("value", ""))

    def read_many(self, keys: list[str]) -> list[bytes | None]:
        """Each key's value, None where missing, in one request (per _TXN_OPS keys): a tick's reads at once."""
        kvs, _ = self._read(list(keys))
        return [None if kv is None else _unb64(kv.get("value", "")) for kv in kvs]

    def check(self, keys: list[str]) -> bool:
        kvs, _ = self._read(list(keys))
        return all(kv is not None for kv in kvs)

    def add(self, key: str, amount: int) -> int:
        k = self._key(key)
        for _ in range(_ADD_TRIES):
            [kv], _ = self._read([key])
            now = int(_unb64(kv["value"])) if kv is not None and kv.get("value") else 0
            if amount == 0:
                return now
            same = ({"key": k, "target": "MOD", "result": "EQUAL", "mod_revision": kv["mod_revision"]}
                    if kv is not None else {"key": k, "target": "CREATE", "result": "EQUAL", "create_revision": 0})
            if self._txn([same], [{"request_put": {"key": k, "value": _b64(str(now + amount))}}]).get("succeeded"):
                return now + amount
        raise dist.DistStoreError(f"add({key!r}) lost {_ADD_TRIES} compare-and-swap races in a row")

    def compare_set(self, key: str, expected_value, desired_value) -> bytes:
        """TCPStore's rule: set `desired` if the key holds `expected` (or is missing and `expected` is
        empty); return the value the key holds afterwards (`expected` itself if it is still missing)."""
        k, expected = self._key(key), _b64(expected_value)
        cond = ({"key": k, "target": "CREATE", "result": "EQUAL", "create_revision": 0} if not expected_value
                else {"key": k, "target": "VALUE", "result": "EQUAL", "value": expected})
        res = self._txn([cond], [{"request_put": {"key": k, "value": _b64(desired_value)}}],
                        [{"request_range": {"key": k}}])
        if res.get("succeeded"):
            return desired_value.encode() if isinstance(desired_value, str) else bytes(desired_value)
        found = res["responses"][0].get("response_range", {}).get("kvs") or []
        if not found:
            return expected_value.encode() if isinstance(expected_value, str) else bytes(expected_value)
        return _unb64(found[0].get("value", ""))

    def delete_key(self, key: str) -> bool:
        res = self._txn([], [{"request_delete_range": {"key": self._key(key)}}])
        return int(res["responses"][0].get("response_delete_range", {}).get("deleted", 0)) > 0

    def num_keys(self) -> int:
        start = self.spec.prefix.encode()
        end = start[:-1] + bytes([start[-1] + 1])
        res = self._call(lambda c: c.post(c.get_url("/kv/range"), json={
            "key": _b64(start), "range_end": _b64(end), "count_only": True}))
        return int(res.get("count", 0))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        timeout = self._timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            kvs, rev = self._read(list(keys))
            missing = [k for k, kv in zip(keys, kvs) if kv is None]
            if not missing:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise dist.DistStoreError(f"wait timeout after {timeout.total_seconds():.1f}s for keys {missing} "
                                          f"in {self.spec.url()}")
            # from the revision they were missing at: a write in between is delivered, not lost
            try:
                self._call(lambda c: c.watch_once(self.spec.prefix + missing[0], timeout=min(left, 30.0),
                                                  start_revision=rev + 1))
            except self._timeout_exc:
                pass  # re-read: the deadline decides

    def prefixed(self, prefix: str) -> "EtcdStore":
        """This store's keys under `prefix`, like dist.PrefixStore (which cannot wrap a Python store:
        its calls into it find no Python method). The child is kept alive here: C++ (a gloo group)
        holds only its C++ half, and the methods defined here live in the Python object."""
        child = EtcdStore(EtcdSpec(self.spec.endpoints, self.spec.prefix + prefix.strip("/") + "/"),
                          timeout_s=self._timeout.total_seconds())
        self._children.append(child)
        return child

    # timeouts as TCPStore exposes them (PrefixStore and callers may read or change them)
    @property
    def timeout(self) -> timedelta:
        return self._timeout

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

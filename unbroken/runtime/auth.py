"""Join token: a node's supervisor proves it knows the job's token before it may join.

Node 0 publishes a random nonce; a joiner answers HMAC-SHA256(token, nonce|node);
node 0 compares in constant time and answers ok/denied. The token itself never
crosses the wire.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import time

import torch.distributed as dist


class JoinRefused(PermissionError):
    pass


def _answer(token: str, nonce: str, node: int) -> str:
    return hmac.new(token.encode(), f"{nonce}|{node}".encode(), hashlib.sha256).hexdigest()


def publish_nonce(store: dist.Store) -> None:
    store.set("auth/nonce", secrets.token_hex(16))


def request_join(store: dist.Store, *, token: str, node: int, timeout_s: float) -> None:
    """Joiner side: answer the challenge and wait for node 0's verdict."""
    nonce = store.get("auth/nonce").decode()
    store.set(f"auth/join/{node}", _answer(token, nonce, node))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if store.check([f"auth/verdict/{node}"]):
            if store.get(f"auth/verdict/{node}").decode() == "ok":
                return
            raise JoinRefused(f"node 0 refused node {node}: wrong join token; pass the job's token "
                              "with --token or UNBROKEN_TOKEN")
        time.sleep(0.02)
    raise TimeoutError(f"node 0 did not answer node {node}'s join request within {timeout_s:.0f}s")


def verify_joins(store: dist.Store, *, token: str, nnodes: int, verdicts: dict[int, bool]) -> None:
    """Node 0 side: judge every pending join request (call repeatedly)."""
    nonce = store.get("auth/nonce").decode()
    for node in range(1, nnodes):
        if node in verdicts or not store.check([f"auth/join/{node}"]):
            continue
        ok = hmac.compare_digest(store.get(f"auth/join/{node}").decode(), _answer(token, nonce, node))
        verdicts[node] = ok
        store.set(f"auth/verdict/{node}", "ok" if ok else "denied")

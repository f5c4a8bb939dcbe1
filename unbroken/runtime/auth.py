"""Join token: a node's supervisor proves it knows the job's token before it may join.

Every join attempt is a fresh challenge–response, so one wrong token costs one attempt,
not the node's place in the job:

  joiner   a = add("auth/attempts/N", 1)                 ask for attempt a
  node 0   set("auth/challenge/N/a", random nonce)       once the node's backoff allows
  joiner   set("auth/answer/N/a", HMAC(token, nonce|N|a))
  node 0   set("auth/verdict/N/a", "ok" | "denied")      constant-time compare

The token never crosses the wire and an answer is good for one challenge only. After a
wrong answer node 0 waits before it issues that node's next challenge (0.5 s, doubling up
to 30 s): guessing is rate-limited, and each refusal is logged. The store itself is not
authenticated (see the README's trust boundary).
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass, field

import torch.distributed as dist

_BACKOFF_S, _MAX_BACKOFF_S = 0.5, 30.0
_ANSWER_TIMEOUT_S = 30.0  # a challenge nobody answered is dropped after this


class JoinRefused(PermissionError):
    pass


def _answer(token: str, nonce: str, node: int, attempt: int) -> str:
    return hmac.new(token.encode(), f"{nonce}|{node}|{attempt}".encode(), hashlib.sha256).hexdigest()


def _wait_for(store: dist.Store, key: str, deadline: float) -> bytes | None:
    while time.monotonic() < deadline:
        if store.check([key]):
            return store.get(key)
        time.sleep(0.02)
    return None


def request_join(store: dist.Store, *, token: str, node: int, timeout_s: float) -> None:
    """Joiner side: take an attempt, answer its challenge, wait for node 0's verdict."""
    attempt = store.add(f"auth/attempts/{node}", 1)
    deadline = time.monotonic() + timeout_s
    nonce = _wait_for(store, f"auth/challenge/{node}/{attempt}", deadline)
    if nonce is not None:
        store.set(f"auth/answer/{node}/{attempt}", _answer(token, nonce.decode(), node, attempt))
        verdict = _wait_for(store, f"auth/verdict/{node}/{attempt}", deadline)
        if verdict == b"ok":
            return
        if verdict == b"denied":
            raise JoinRefused(f"node 0 refused node {node}: wrong join token; pass the job's token "
                              "with --token-file or UNBROKEN_TOKEN")
        if verdict == b"taken":
            raise JoinRefused(f"node 0 already admitted a node {node}: check --node-rank")
    raise TimeoutError(f"node 0 did not answer node {node}'s join request within {timeout_s:.0f}s "
                       "(after wrong tokens node 0 waits up to 30 s between attempts)")


@dataclass
class _NodeState:
    seen: int = 0  # attempts taken so far (the store's counter when last read)
    judged: int = 0  # attempts challenged and judged or being judged
    failures: int = 0
    not_before: float = 0.0  # monotonic time of the next challenge (backoff after a failure)
    pending: dict[int, tuple[str, float]] = field(default_factory=dict)  # attempt -> (nonce, issued at)


class JoinGate:
    """Node 0 side: issue challenges, judge answers, rate-limit failures (call `poll` often)."""

    def __init__(self, store: dist.Store, *, token: str, nnodes: int, events) -> None:
        self.store, self.token, self.events = store, token, events
        self.nodes = {n: _NodeState() for n in range(1, nnodes)}
        self.admitted: set[int] = set()

    def poll(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for node, st in self.nodes.items():
            st.seen = self.store.add(f"auth/attempts/{node}", 0)
            self._judge_answers(node, st, now)
            if st.judged < st.seen and not st.pending and now >= st.not_before:
                st.judged += 1
                if node in self.admitted:
                    self.store.set(f"auth/verdict/{node}/{st.judged}", "taken")
                    continue
                nonce = secrets.token_hex(16)
                st.pending[st.judged] = (nonce, now)
                self.store.set(f"auth/challenge/{node}/{st.judged}", nonce)

    def _judge_answers(self, node: int, st: _NodeState, now: float) -> None:
        for attempt, (nonce, issued) in list(st.pending.items()):
            key = f"auth/answer/{node}/{attempt}"
            if not self.store.check([key]):
                if now - issued > _ANSWER_TIMEOUT_S:  # the joiner went away: free the slot
                    del st.pending[attempt]
                    self.store.set(f"auth/verdict/{node}/{attempt}", "expired")
                continue
            del st.pending[attempt]
            ok = hmac.compare_digest(self.store.get(key).decode(), _answer(self.token, nonce, node, attempt))
            self.store.set(f"auth/verdict/{node}/{attempt}", "ok" if ok else "denied")
            if ok:
                self.admitted.add(node)
                self.events.emit("node_joined", node=node, attempt=attempt, failures=st.failures)
                continue
            st.failures += 1
            wait = min(_BACKOFF_S * 2 ** (st.failures - 1), _MAX_BACKOFF_S)
            st.not_before = now + wait
            self.events.emit("join_refused", node=node, attempt=attempt, failures=st.failures,
                             retry_after_s=wait, why="wrong join token")


def read_token_file(path) -> str:
    """The token from a file only its owner can read (0600 or stricter); ValueError otherwise."""
    import os

    from unbroken.fsutil import readable_by_others

    try:
        st = os.stat(path)
        text = open(path, encoding="utf-8").read().strip()
    except OSError as e:
        raise ValueError(f"cannot read --token-file {path}: {e.strerror}") from None
    if problem := readable_by_others(path, st):
        raise ValueError(f"--token-file {problem}")
    if not text:
        raise ValueError(f"--token-file {path} is empty; write the job's token into it")
    return text

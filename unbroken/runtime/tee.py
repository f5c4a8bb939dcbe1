"""`--tee`: the selected ranks' output on the console, each line prefixed `[rank N]`.

Workers and shadows write to RUN_DIR/logs/PROC.log (runtime/procs.py), never to a pipe:
a console that is slow or not read cannot block training. A `Tee` follows those files
from the offset it has read (a daemon thread polling every `poll_s`), splits complete
lines and writes them prefixed with the rank the process holds *now*: the supervisor
calls `follow(generation)` after each one, so a shadow that takes rank 0 is shown as
[rank 0] (from the start of its log). A process that leaves the generation (it died) is
flushed once more, partial last line included, under its old rank, then forgotten.
`stop()` flushes everything left and joins the thread (with a timeout). Only this node's
processes are followed (n{node}-...); every write happens on the thread, so a console
that blocks never holds up the supervisor.
"""
from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Callable

ALL = "all"
_READ_MAX = 1 << 20  # bytes read from one log per poll (the rest on the next one)


def parse_tee(text: str) -> str | frozenset[int]:
    """'all', 'none' (no rank) or a comma list of ranks like '0,3'; ValueError otherwise."""
    t = text.strip().lower()
    if t == ALL:
        return ALL
    if t == "none":
        return frozenset()
    items = [s.strip() for s in t.split(",")]
    if not all(s.isdigit() for s in items):
        raise ValueError(f"--tee must be 'all', 'none' or rank numbers separated by commas, got {text!r}; "
                         "e.g. --tee 0,3")
    return frozenset(int(s) for s in items)


def check_tee_ranks(text: str, world_size: int) -> None:
    """Refuse a --tee list naming a rank the job does not have."""
    sel = parse_tee(text)
    bad = sorted(r for r in sel if r >= world_size) if sel != ALL else []
    if bad:
        raise ValueError(f"--tee names rank {bad[0]} but the job has ranks 0..{world_size - 1}; "
                         f"e.g. --tee 0 or --tee all")


class LineSplitter:
    """Bytes in (any chunking), complete lines out; a line longer than `max_line` bytes comes
    out in pieces of `max_line` (a progress bar that never prints a newline stays bounded)."""

    def __init__(self, max_line: int = 64 * 1024) -> None:
        self.max_line = max_line
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        buf, out, pos, m = self._buf, [], 0, self.max_line
        buf += data
        while True:
            i = buf.find(b"\n", pos, pos + m + 1)
            if i >= 0:
                out.append(bytes(buf[pos:i]))
                pos = i + 1
            elif len(buf) - pos > m:  # m + 1 bytes known without a newline: cut here
                out.append(bytes(buf[pos:pos + m]))
                pos += m
            else:
                break
        del buf[:pos]
        return out

    def flush(self) -> list[bytes]:
        """The final partial line, if any."""
        rest = bytes(self._buf)
        self._buf.clear()
        return [rest] if rest else []


def prefixed(rank: int, lines: list[bytes]) -> str:
    """`[rank N] line` per line (decoded as UTF-8, a CRLF's CR dropped), newline-terminated."""
    return "".join(f"[rank {rank}] " + ln.removesuffix(b"\r").decode("utf-8", "replace") + "\n" for ln in lines)


class _Follower:
    """One log file: the offset read so far and the partial line after it."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.split = path, 0, LineSplitter()

    def read(self, *, to_end: bool) -> list[bytes]:
        lines: list[bytes] = []
        try:
            with open(self.path, "rb") as f:
                while True:
                    f.seek(self.offset)
                    data = f.read(_READ_MAX)
                    self.offset += len(data)
                    lines += self.split.feed(data)
                    if not to_end or len(data) < _READ_MAX:
                        return lines
        except FileNotFoundError:  # not started yet (or another node's)
            return lines


class Tee:
    """The supervisor's console view of its selected ranks (`selection`: --tee); it owns the
    thread: start() after generation 0 is known, follow() after each generation, stop() last."""

    def __init__(self, log_dir: Path, selection: str, *, node: int, write: Callable[[str], None],
                 poll_s: float = 0.1) -> None:
        self.log_dir, self.node, self.write, self.poll_s = log_dir, node, write, poll_s
        self.selection = parse_tee(selection)
        self._lock = threading.Lock()
        self._ranks: dict[str, int] = {}  # proc -> rank, this node's selected members
        self._retiring: dict[str, int] = {}  # procs that left the generation: flushed once more
        self._files: dict[str, _Follower] = {}  # the thread's own
        self._gen = -1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._broken = False  # the console refused a write: stop writing, keep the run going

    @property
    def enabled(self) -> bool:
        return self.selection == ALL or bool(self.selection)

    def follow(self, gen: int, members: dict[int, str]) -> None:
        """Generation `gen` maps rank -> proc: show each selected local proc under its rank."""
        mine = {p: r for r, p in members.items() if p.startswith(f"n{self.node}-")
                and (self.selection == ALL or r in self.selection)}
        with self._lock:
            for proc, rank in self._ranks.items():
                if mine.get(proc) != rank:
                    self._retiring[proc] = rank
            self._ranks, self._gen = mine, max(self._gen, gen)

    def follow_store(self, store) -> None:
        """A node other than 0 learns generations from the store (the leader calls follow())."""
        from unbroken.runtime import membership

        g = membership.latest_gen(store) if self.enabled else -1
        if g > self._gen:
            self.follow(g, membership.read_generation(store, g, timeout_s=5).members)

    def start(self) -> None:
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="unbroken-tee", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Flush every remaining line (partial last lines too) and join the thread."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=timeout_s)  # a console that blocks: the daemon thread is abandoned
        self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._pass(final=False)
        self._pass(final=True)

    def _pass(self, *, final: bool) -> None:
        with self._lock:
            retiring, self._retiring = self._retiring, {}
            current = dict(self._ranks)
        out = [self._take(p, r, to_end=True, partial=True) for p, r in retiring.items()]
        out += [self._take(p, r, to_end=final, partial=final) for p, r in current.items()]
        self._emit("".join(out))

    def _take(self, proc: str, rank: int, *, to_end: bool, partial: bool) -> str:
        f = self._files.get(proc) or self._files.setdefault(proc, _Follower(self.log_dir / f"{proc}.log"))
        lines = f.read(to_end=to_end)
        if partial:
            lines += f.split.flush()
        return prefixed(rank, lines)

    def _emit(self, text: str) -> None:
        if not text or self._broken:
            return
        try:
            self.write(text)
        except (OSError, ValueError):  # closed or broken console (e.g. a pipe whose reader left)
            self._broken = True


def stream_writer(stream=None) -> Callable[[str], None]:
    """Write (and flush) to `stream`, sys.stdout (as it is now) by default."""
    out = stream or sys.stdout

    def write(text: str) -> None:
        out.write(text)
        out.flush()
    return write

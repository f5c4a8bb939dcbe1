"""`ChildWake`: sleep until a child process exits or a timeout passes, whichever comes first.

The supervisor used to poll its children every 10 ms; each tick costs CPU on the cores the
workers train on. SIGCHLD writes a byte to a pipe (`signal.set_wakeup_fd`), so the loop can
sleep for its whole bookkeeping period and still see an exit at once. Where signals cannot
be installed (not the main thread) it falls back to short sleeps. `poke()` wakes it from another
thread (a store watch that saw a fault record land).
"""
from __future__ import annotations

import os
import select
import signal
import threading

FALLBACK_TICK_S = 0.01


class ChildWake:
    def __init__(self) -> None:
        self._r = self._w = None
        self._old_fd = self._old_handler = None
        self._lock = threading.Lock()  # poke (any thread) never writes to a descriptor close() gave back
        if threading.current_thread() is not threading.main_thread():
            return
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._old_handler = signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler makes the wakeup fd fire
        self._old_fd = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)

    def wait(self, timeout_s: float) -> None:
        """Block until a SIGCHLD arrived (since the last wait) or timeout_s passed."""
        timeout_s = max(0.0, timeout_s)
        if self._r is None:
            select.select([], [], [], min(timeout_s, FALLBACK_TICK_S))
            return
        ready, _, _ = select.select([self._r], [], [], timeout_s)
        if ready:
            try:
                while os.read(self._r, 512):
                    pass
            except BlockingIOError:
                pass

    def poke(self) -> None:
        """Wake the current or next `wait` (from any thread)."""
        with self._lock:
            if self._w is not None:
                try:
                    os.write(self._w, b"\0")
                except BlockingIOError:
                    pass  # the pipe is full: a wake-up is pending anyway

    def close(self) -> None:
        if self._r is None:
            return
        with self._lock:
            self._close()

    def _close(self) -> None:
        signal.set_wakeup_fd(self._old_fd if self._old_fd is not None else -1)
        signal.signal(signal.SIGCHLD, self._old_handler if self._old_handler is not None else signal.SIG_DFL)
        os.close(self._r)
        os.close(self._w)
        self._r = self._w = None

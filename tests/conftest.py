"""Suite-wide settings: hypothesis runs derandomized, so CI sees the same examples every run;
a process a test leaves behind is killed after it and named in the session's summary (every
process the suite starts carries UNBROKEN_TEST_SESSION in its environment: that is how they are
found, orphans and forked children included); the test process leaves without interpreter
teardown (see pytest_unconfigure)."""
import os
import signal
import sys
import time

import pytest
from hypothesis import settings

settings.register_profile("unbroken", derandomize=True, deadline=None, print_blob=True)
settings.load_profile("unbroken")

_status = {"code": 0}
_leaks: list[str] = []


def pytest_sessionfinish(session, exitstatus):
    _status["code"] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """In-process TCPStores and gloo groups (unit tests of the heartbeat, fault log, fence)
    keep native threads that may abort in their C++ destructors at interpreter teardown
    ("terminate called without an active exception", exit 134) after every test passed.
    The runtime's own processes skip teardown for the same reason (runtime/launch.py);
    so does the test process, with the session's exit status."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_status["code"])


# --- leaked processes: every process the suite starts carries this tag in its environment ---
_TAG = "UNBROKEN_TEST_SESSION"
_LEAK_WAIT_S = 10.0


def pytest_configure(config):
    os.environ[_TAG] = str(os.getpid())


def _tagged_pids() -> set[int]:
    """Live processes (not zombies) whose environment carries this session's tag."""
    needle = f"{_TAG}={os.environ.get(_TAG, '')}".encode()
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.add(int(entry))
        except OSError:
            continue
    found.discard(os.getpid())
    return {p for p in found if not _session_helper(p)}


def _session_helper(pid: int) -> bool:
    """multiprocessing's resource tracker that this test process started: it lives for the session."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return ppid == os.getpid() and b"resource_tracker" in f.read()
    except (OSError, ValueError):
        return False


def _describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        return f"{pid} {cmd[:160]}"
    except OSError:
        return f"{pid} (gone)"


@pytest.fixture(autouse=True)
def _no_leaked_processes(request):
    """Processes a test left behind (not its fixtures') are killed after it, so that the next test
    starts clean (an orphan killing stale pids once took down another test's etcd members)."""
    before = _tagged_pids()
    yield
    deadline = time.monotonic() + _LEAK_WAIT_S
    while (left := _tagged_pids() - before) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left:
        described = [_describe(p) for p in sorted(left)]
        _leaks.append(f"{request.node.nodeid}: {'; '.join(described)}")
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def pytest_terminal_summary(terminalreporter):
    if _leaks:
        terminalreporter.section("processes left behind by tests (killed)")
        for line in _leaks:
            terminalreporter.write_line(line[:400])

"""A local 3-member etcd cluster on loopback ports: started into a directory, stopped and reaped from it.

`unbroken store start --dir D` runs one `etcd` per member (Debian's `etcd-server`), each in a
session of its own so that it outlives the command and no job's process group takes it down;
`D/cluster.json` records the members' pids, ports and the store URL (`etcd://...`) to pass to
`unbroken run --store`. `unbroken store stop --dir D` stops them (SIGTERM, then SIGKILL) and waits
until every pid is gone. The raft timings are shortened (heartbeat 50 ms, election 500 ms) so a lost
member's successor is elected well within a node lease.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

STATE = "cluster.json"
_HEARTBEAT_MS, _ELECTION_MS = 50, 500
# members this process started, by pid: their state comes from the Popen (waitpid), never from /proc,
# which can lag an exec (an empty cmdline) or belong to another pid namespace in a container (CI saw
# all three live members read as dead there)
_CHILDREN: dict[int, subprocess.Popen] = {}


class ClusterError(RuntimeError):
    """The cluster cannot be started or stopped as asked."""


class MembersExited(ClusterError):
    """Members exited while the cluster started; the message names how each ended and what it logged."""


@dataclass(frozen=True)
class Member:
    name: str
    client_port: int
    peer_port: int
    pid: int
    host: str = "127.0.0.1"  # its address (a node's namespace address in the multi-node tests)

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"


def etcd_binary() -> str | None:
    return shutil.which("etcd")


def missing_reason() -> str | None:
    """Why a local cluster cannot run here (None: it can)."""
    if etcd_binary() is None:
        return "no `etcd` binary: install it (Debian: apt-get install etcd-server)"
    try:
        import etcd3gw  # noqa: F401
    except ImportError:
        return "no etcd client: pip install etcd3gw"
    return None


def url(members: list[Member], prefix: str = "") -> str:
    return "etcd://" + ",".join(m.endpoint for m in members) + (f"/{prefix.strip('/')}" if prefix else "")


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def start(directory: Path, *, members: int = 3, base_port: int = 0, timeout_s: float = 30.0,
          hosts: list[str] | None = None, prefixes: list[list[str]] | None = None) -> list[Member]:
    """Start `members` etcd processes with their data under `directory`; return once the cluster answers.

    By default every member listens on loopback (free ports). `hosts` gives each member an address of
    its own (then every member uses ports base_port or 2379 / +1, as on separate machines) and
    `prefixes` a command prefix each (e.g. `ip netns exec NS`: the member lives in a node's namespace)."""
    if reason := missing_reason():
        raise ClusterError(reason)
    if hosts is not None and len(hosts) != members or prefixes is not None and len(prefixes) != members:
        raise ClusterError(f"{members} members need {members} hosts and prefixes (got {hosts}, {prefixes})")
    directory = directory.resolve()
    if (directory / STATE).exists():
        raise ClusterError(f"{directory} already holds a cluster ({STATE}); stop it first: unbroken store stop "
                           f"--dir {directory}")
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    if hosts is not None:
        ports = [base_port or 2379, (base_port or 2379) + 1] * members
    else:
        hosts = ["127.0.0.1"] * members
        ports = [base_port + i for i in range(2 * members)] if base_port else _free_ports(2 * members)
    names = [f"m{i}" for i in range(members)]
    peers = ",".join(f"{n}=http://{hosts[i]}:{ports[2 * i + 1]}" for i, n in enumerate(names))
    started: list[Member] = []
    try:
        for i, name in enumerate(names):
            c, p, h = ports[2 * i], ports[2 * i + 1], hosts[i]
            log = open(directory / f"{name}.log", "ab")
            proc = subprocess.Popen(
                [*(prefixes[i] if prefixes else []), etcd_binary(), "--name", name, "--data-dir", str(directory / name),
                 "--listen-client-urls", f"http://{h}:{c}", "--advertise-client-urls", f"http://{h}:{c}",
                 "--listen-peer-urls", f"http://{h}:{p}", "--initial-advertise-peer-urls",
                 f"http://{h}:{p}", "--initial-cluster", peers, "--initial-cluster-state", "new",
                 "--initial-cluster-token", f"unbroken-{os.getpid()}-{ports[0]}", "--heartbeat-interval",
                 str(_HEARTBEAT_MS), "--election-timeout", str(_ELECTION_MS), "--logger", "zap",
                 "--log-level", "warn"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
            log.close()
            _CHILDREN[proc.pid] = proc
            started.append(Member(name, c, p, proc.pid, h))
        _write_state(directory, started)
        _wait_healthy(started, directory, timeout_s)
    except BaseException:
        _stop_members(started)
        (directory / STATE).unlink(missing_ok=True)
        raise
    return started


def _write_state(directory: Path, members: list[Member]) -> None:
    tmp = directory / (STATE + ".tmp")
    tmp.write_text(json.dumps({"members": [asdict(m) for m in members], "url": url(members)}, indent=1))
    os.replace(tmp, directory / STATE)


def read_state(directory: Path) -> list[Member]:
    path = directory / STATE
    if not path.exists():
        raise ClusterError(f"no cluster in {directory} (no {STATE}); start one: unbroken store start --dir {directory}")
    return [Member(**m) for m in json.loads(path.read_text())["members"]]


def _log_reason(path: Path) -> str:
    """The first error/fatal/panic message in an etcd (zap JSON) log, else its last line."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"log unreadable: {e}"
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("level") in ("error", "fatal", "panic", "dpanic"):
            return f"{entry.get('msg', '')}: {entry.get('error', '')}"[:200]
    return (lines[-1][:200] if lines else "log empty")


def _wait_healthy(members: list[Member], directory: Path, timeout_s: float) -> None:
    """Every member answers and one write goes through (a quorum elected a leader)."""
    import etcd3gw

    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        dead = [m for m in members if not _alive(m.pid)]
        if dead:
            ended = ", ".join(f"{m.name} ({_exit_status(m.pid)})" for m in dead)
            raise MembersExited(f"etcd member(s) {ended} exited at start: {_log_reason(directory / f'{dead[0].name}.log')}"
                                f" (log: {directory}/{dead[0].name}.log)")
        try:
            for m in members:
                etcd3gw.client(host=m.host, port=m.client_port, timeout=2).status()
            etcd3gw.client(host=members[0].host, port=members[0].client_port, timeout=2).put("/unbroken-health", "1")
            return
        except Exception as e:  # noqa: BLE001 - not up yet: retry until the deadline
            last = f"{type(e).__name__}: {e}"
            time.sleep(0.1)
    raise ClusterError(f"the etcd cluster did not become healthy within {timeout_s:.0f}s ({last[:200]})")


def _exit_status(pid: int) -> str:
    """How an exited member ended: an exit code or the signal (known for members this process started)."""
    proc = _CHILDREN.get(pid)
    if proc is None:
        return "exit status unknown: not this process's child"
    code = proc.poll()
    if code is None:
        return "still running"
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def _alive(pid: int) -> bool:
    """`pid` is still one of our etcd processes (not exited, not a zombie, not a reused number).

    A member this process started answers from its Popen (which also reaps it); any other pid (a
    cluster started by an earlier `unbroken store start`) from a signal 0 and /proc, where a cmdline
    that names another program means the number was reused."""
    proc = _CHILDREN.get(pid)
    if proc is not None:
        return proc.poll() is None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # another user's process: the number was reused
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (FileNotFoundError, ProcessLookupError):
        return True  # signal 0 reached it; this /proc does not show it (another pid namespace)
    return stat.rsplit(")", 1)[1].split()[0] != "Z" and (not cmd or b"etcd" in cmd)


def _reap(pid: int) -> None:
    """Collect a member this process started once it has exited; another process's members
    (`unbroken store stop`) are their own parent's to reap."""
    proc = _CHILDREN.get(pid)
    if proc is not None:
        proc.poll()


def _stop_members(members: list[Member], grace_s: float = 5.0) -> None:
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        live = [m for m in members if _alive(m.pid)]
        for m in live:
            try:
                os.kill(m.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            for m in live:
                _reap(m.pid)
            if not any(_alive(m.pid) for m in live):
                break
            time.sleep(0.05)
    left = [m.pid for m in members if _alive(m.pid)]
    for m in members:
        if m.pid not in left:
            _CHILDREN.pop(m.pid, None)
    if left:
        raise ClusterError(f"etcd pid(s) {left} did not exit after SIGKILL")


def stop(directory: Path, *, keep_data: bool = False) -> list[Member]:
    """Stop the cluster recorded in `directory`; its data is removed unless `keep_data`."""
    directory = directory.resolve()
    members = read_state(directory)
    _stop_members(members)
    (directory / STATE).unlink()
    if not keep_data:
        for m in members:
            shutil.rmtree(directory / m.name, ignore_errors=True)
    return members


def kill_member(member: Member) -> None:
    """SIGKILL one member (tests: a node's etcd member lost with the node)."""
    if _alive(member.pid):
        os.kill(member.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while _alive(member.pid) and time.monotonic() < deadline:
        _reap(member.pid)
        time.sleep(0.02)


# each member preallocates a 64 MB WAL segment (and may hold a spare) plus its bbolt file
_SCRATCH_BYTES_PER_MEMBER = 192 << 20


def scratch_dir(name: str, fallback: Path, members: int = 3) -> Path:
    """A directory for a throwaway cluster: on tmpfs (/dev/shm, where fsync costs nothing) if it has room
    for `members` members (containers often give /dev/shm only 64 MB), else under `fallback`."""
    shm = Path("/dev/shm")
    roomy = shm.is_dir() and shutil.disk_usage(shm).free >= members * _SCRATCH_BYTES_PER_MEMBER
    return (shm if roomy else fallback) / f"{name}-{os.getpid()}"


@contextmanager
def running(directory: Path, **kwargs):
    """A cluster for the length of a `with` block (tests, benchmarks): started in `directory`,
    yielding its members; stopped and the directory removed after, also on failure. A throwaway cluster
    whose members exit at start is started once more in a fresh directory on fresh ports, with the first
    attempt's reason on stderr (CI once saw all three members end at start with empty logs)."""
    try:
        members = start(directory, **kwargs)
    except MembersExited as first:
        shutil.rmtree(directory, ignore_errors=True)
        print(f"unbroken: etcd throwaway cluster: {first}; starting it again", file=sys.stderr, flush=True)
        directory = directory.with_name(directory.name + "-again")
        members = start(directory, **kwargs)
    try:
        yield members
    finally:
        stop(directory)
        shutil.rmtree(directory, ignore_errors=True)

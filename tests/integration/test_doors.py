"""The doors of a job (issue 14): where the store listens, where the token goes, who may read
the run directory. (A wrong join token, then the right one: test_cli.py's two-node test.)"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.procs import reap
from .conftest import SMALL, _procs_of, run_cli

pytestmark = pytest.mark.timeout(300)


def _listening(pid: int) -> list[str]:
    """'addr:port' of every TCP socket process `pid` listens on (from /proc/net/tcp{,6})."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, width in (("tcp", 8), ("tcp6", 32)):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] != "0A" or cols[9] not in inodes:  # 0A = LISTEN
                continue
            addr, port = cols[1].split(":")
            raw = bytes.fromhex(addr)
            if width == 8:
                host = socket.inet_ntop(socket.AF_INET, raw[::-1])
            else:  # four little-endian 32-bit words
                host = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
            found.append(f"{host}:{int(port, 16)}")
    return found


def _started(run_dir: Path) -> dict[int, str]:
    """pid -> role, from the supervisor's process_started events so far."""
    try:
        lines = (run_dir / "events.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return {}
    events = [json.loads(line) for line in lines if line.strip().endswith("}")]
    return {e["fields"]["pid"]: e["fields"]["role"] for e in events if e.get("kind") == "process_started"}


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(kv.decode(errors="replace").split("=", 1) for kv in raw if b"=" in kv)


@pytest.mark.parametrize("fork_server", ["1", pytest.param("0", marks=pytest.mark.slow)])  # "1": the default start
def test_the_store_listens_on_loopback_only_and_workers_never_see_the_token(tmp_path, fork_server):
    """With the fork server (the default) a child's /proc/PID/environ is the server's start
    environment: the token must be in no process of the job. Started the exec way, each child's
    own environment is there to read: its role, slot and node size too."""
    run_dir = (tmp_path / "r").resolve()
    env = {**os.environ, "UNBROKEN_TOKEN": "s3cret-token", "UNBROKEN_FORK_SERVER": fork_server}
    args = list(SMALL)
    args[args.index("--steps") + 1] = "30"
    args += ["--checkpoint-every", "10"]
    cmd = [sys.executable, "-m", "unbroken.cli", "run", "--run-dir", str(run_dir), "--no-progress", "--json", *args]
    sup = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        listening, children, shadows, everyone = [], {}, {}, {}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and sup.poll() is None and (len(children) < 4 or not shadows):
            try:
                listening = _listening(sup.pid) or listening  # (an exited, unreaped process lists none)
                seen = {p: _environ(p) for p in _procs_of(run_dir) if p != sup.pid}
                everyone.update(seen)
                if fork_server == "1":  # roles from the supervisor's events; environments all the server's
                    started = _started(run_dir)
                    children = {p: e for p, e in seen.items() if started.get(p) == "worker"}
                    shadows = {p: e for p, e in seen.items() if started.get(p) == "shadow"}
                    continue
                children = {p: e for p, e in seen.items() if e.get("UNBROKEN_ROLE") == "worker"}
                shadows = {p: e for p, e in seen.items() if e.get("UNBROKEN_ROLE") == "shadow"}
            except OSError:
                pass
            time.sleep(0.2)
        out, err = sup.communicate(timeout=240)
    finally:
        reap([sup])
    assert sup.returncode == 0, err[-2000:]
    assert listening, "the supervisor's listening socket was not seen"
    assert all(a.startswith("127.0.0.1:") for a in listening), listening
    assert len(children) == 4, "the workers were not seen while they ran"
    for pid, env_of in everyone.items():
        assert "UNBROKEN_TOKEN" not in env_of, f"process {pid} of the job inherited the join token"
    if fork_server == "1":
        assert len(everyone) >= 6, everyone.keys()  # the fork server, 4 workers and a shadow
        return
    # torchrun's variables: every process knows its node's size and its slot, shadows too (issue 15)
    assert sorted(e["LOCAL_RANK"] for e in children.values()) == ["0", "1", "2", "3"]
    assert [e["LOCAL_RANK"] for e in shadows.values()] == ["0"]  # the pool's first shadow: slot 0
    assert {e["LOCAL_WORLD_SIZE"] for e in [*children.values(), *shadows.values()]} == {"4"}
    assert json.loads(out)["ok"]
    # what the job wrote is its owner's alone: files 0600, directories 0700
    modes = {p.relative_to(run_dir).as_posix(): p.stat().st_mode & 0o777 for p in [run_dir, *run_dir.rglob("*")]}
    assert any(name.startswith("checkpoints/") for name in modes) and "job.key" in modes
    assert {n: m for n, m in modes.items() if m & 0o077} == {}


def test_a_token_file_readable_by_others_is_refused(tmp_path):
    f = tmp_path / "token"
    f.write_text("tok\n")
    f.chmod(0o644)
    p = run_cli(tmp_path / "r", *SMALL, "--token-file", str(f), check=False)
    assert p.returncode == 2 and "readable by other users" in p.stderr and "chmod 600" in p.stderr
    assert "Traceback" not in p.stderr and not (tmp_path / "r").exists()

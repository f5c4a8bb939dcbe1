"""The fork server (runtime/zygote.py) as the supervisor's ProcessTable uses it: children forked
with their own environment, argv, cwd and log; exit codes as Popen reports them; nothing left
behind when the table stops or the server dies; the exec way when the server is off or gone."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from unbroken.config import RunConfig
from unbroken.runtime.procs import FORK_SERVER_ENV, ProcessTable, fork_server
from unbroken.runtime.zygote import Forked

SCRIPT = """
import os, sys, time
print("argv", sys.argv[1:], "rank", os.environ.get("RANK"), "cwd", os.getcwd(),
      "stdin", sys.stdin.read(), "token", os.environ.get("UNBROKEN_TOKEN"), flush=True)
if os.environ.get("SLEEP"):
    time.sleep(float(os.environ["SLEEP"]))
sys.exit(int(os.environ.get("CODE", "0")))
"""


@pytest.fixture
def table(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(RunConfig().to_dict()))
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    monkeypatch.setenv("UNBROKEN_TOKEN", "secret")
    warnings: list[str] = []
    base = {"UNBROKEN_RUN_DIR": str(run_dir)}
    t = ProcessTable(run_dir, base, [str(script), "x", "--y"], warn=warnings.append,
                     server=fork_server(base, warnings.append))
    t.warnings = warnings
    yield t
    t.stop_all(grace_s=1.0)


def _log(t: ProcessTable, proc: str) -> str:
    return (t.run_dir / "logs" / f"{proc}.log").read_text()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_a_forked_child_runs_the_script_with_its_own_env_argv_and_exit_code(table):
    c = table.start("worker0", "worker", {"RANK": "3", "CODE": "7"})
    assert isinstance(c.popen, Forked)
    assert c.popen.wait(timeout=30) == 7
    out = _log(table, "worker0")
    assert "argv ['x', '--y'] rank 3" in out and f"cwd {os.getcwd()}" in out
    assert "stdin  token None" in out  # stdin is /dev/null; the supervisor's secret is not passed on
    assert not table.warnings


def test_a_killed_child_reads_as_minus_the_signal_and_stop_all_reaps_the_rest(table):
    c = table.start("worker0", "worker", {"RANK": "0", "SLEEP": "60"})
    s = table.start("shadow0", "shadow", {"SLEEP": "60"})
    deadline = time.time() + 30
    while "argv" not in _log(table, "worker0") and time.time() < deadline:
        time.sleep(0.05)
    table.kill(c)
    assert c.poll() == -signal.SIGKILL
    server = table.server._popen
    table.stop_all(grace_s=0.5)
    assert s.poll() is not None and not _alive(s.pid)
    assert server.poll() is not None  # the server itself is reaped too


def test_children_die_with_the_server_and_the_table_falls_back_to_exec(table):
    c = table.start("worker0", "worker", {"RANK": "0", "SLEEP": "60"})
    table.server._popen.kill()
    assert c.popen.wait(timeout=10) == -signal.SIGKILL
    deadline = time.time() + 10
    while _alive(c.pid) and time.time() < deadline:
        time.sleep(0.05)
    assert not _alive(c.pid)
    d = table.start("worker1", "worker", {"RANK": "1", "CODE": "3"})
    assert not isinstance(d.popen, Forked) and d.popen.wait(timeout=60) == 3
    assert table.warnings and "exec way" in table.warnings[0]


def test_the_exec_way_when_the_server_is_off(tmp_path, monkeypatch):
    monkeypatch.setenv(FORK_SERVER_ENV, "0")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps(RunConfig().to_dict()))
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    base = {"UNBROKEN_RUN_DIR": str(run_dir)}
    t = ProcessTable(run_dir, base, [str(script)], server=fork_server(base, print))
    try:
        assert t.server is None
        c = t.start("worker0", "worker", {"RANK": "0", "CODE": "4"})
        assert c.popen.wait(timeout=60) == 4
    finally:
        t.stop_all()


def test_a_run_command_line_names_its_run_directory_for_the_early_server(tmp_path):
    from unbroken.runtime.prestart import run_dir_in

    assert run_dir_in(["unbroken", "run", "--steps", "3", "--run-dir", str(tmp_path / "r")]) == str(tmp_path / "r")
    assert run_dir_in(["unbroken", "run", f"--run-dir={tmp_path}/r", "--resume", str(tmp_path / "old")]) == \
        str(tmp_path / "old")  # --resume wins, as in the command
    assert run_dir_in(["unbroken", "run", "--steps", "3"]) is None  # the default run dir is chosen later
    assert run_dir_in(["unbroken", "bench", "--run-dir", "x"]) is None and run_dir_in(["unbroken"]) is None


def test_the_early_server_is_taken_for_its_run_directory_and_closed_for_another(tmp_path, monkeypatch):
    from unbroken.runtime import prestart

    monkeypatch.setenv("UNBROKEN_TOKEN", "secret")
    prestart.early(["unbroken", "run", "--run-dir", str(tmp_path / "a")])
    server = prestart._early
    assert server is not None and "UNBROKEN_TOKEN" not in server.env
    assert prestart.take({"UNBROKEN_RUN_DIR": str(tmp_path / "b")}) is None  # another run: closed
    assert server._popen.poll() is not None
    prestart.early(["unbroken", "run", "--run-dir", str(tmp_path / "a")])
    got = prestart.take({"UNBROKEN_RUN_DIR": str(tmp_path / "a")})
    try:
        assert got is not None and prestart.take({"UNBROKEN_RUN_DIR": str(tmp_path / "a")}) is None  # taken once
        got.wait_ready()
    finally:
        got.close()
    monkeypatch.setenv(FORK_SERVER_ENV, "0")
    prestart.early(["unbroken", "run", "--run-dir", str(tmp_path / "a")])
    assert prestart._early is None

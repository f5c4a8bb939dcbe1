"""The process tree a node fault acts on (runtime/faults.py): `_descendants` and `supervisor_pid`."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.procs import reap
from unbroken.runtime import faults

pytestmark = pytest.mark.timeout(30)

# a child that starts a grandchild (both sleep) and prints the grandchild's pid
_TREE = ("import subprocess, sys, time; g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
         "print(g.pid, flush=True); time.sleep(60)")


def test_descendants_lists_children_before_grandchildren_and_nothing_outside_the_tree():
    child = subprocess.Popen([sys.executable, "-c", _TREE], stdout=subprocess.PIPE, text=True, start_new_session=True)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        grandchild = int(child.stdout.readline())
        below_child = faults._descendants(child.pid)
        assert below_child == [grandchild]
        below_us = faults._descendants(os.getpid())
        assert child.pid in below_us and grandchild in below_us and other.pid in below_us
        assert below_us.index(child.pid) < below_us.index(grandchild)
        assert faults._descendants(grandchild) == []
    finally:
        reap([child], group=True)
        reap([other])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and grandchild in faults._descendants(os.getpid()):
        time.sleep(0.05)  # killed with the child's session: gone, or an orphan re-parented away from us
    assert grandchild not in faults._descendants(os.getpid())


def test_supervisor_pid_is_the_named_one_else_the_parent(monkeypatch):
    monkeypatch.setenv(faults.SUPERVISOR_ENV, "4242")
    assert faults.supervisor_pid() == 4242
    monkeypatch.delenv(faults.SUPERVISOR_ENV)
    assert faults.supervisor_pid() == os.getppid()

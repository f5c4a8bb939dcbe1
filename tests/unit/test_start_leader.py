"""tests/procs.py start_leader: node 0 on a port someone else took in the meantime is started again elsewhere."""
import socket
import subprocess
import sys

import pytest

import tests.procs as procs

SERVER = ("import socket, sys, time\n"
          "s = socket.socket(); s.bind(('127.0.0.1', int(sys.argv[1])))\n"  # OSError: Address already in use
          "s.listen(1); time.sleep(60)\n")


def _start(port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SERVER, str(port)], stderr=subprocess.PIPE, text=True)


def test_a_port_taken_before_node_0_binds_it_is_retried_on_another(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        ports = iter([taken.getsockname()[1], procs.free_port()])
        monkeypatch.setattr(procs, "free_port", lambda: next(ports))
        node0, port = procs.start_leader(_start)
        try:
            assert port != taken.getsockname()[1] and procs._listens(node0.pid, port)
            assert not procs._listens(node0.pid, taken.getsockname()[1])
        finally:
            procs.reap([node0])


def test_node_0_failing_for_another_reason_is_reported_with_its_stderr():
    def broken(port):
        return subprocess.Popen([sys.executable, "-c", "import sys; sys.exit('bad flag --x')"],
                                stderr=subprocess.PIPE, text=True)

    with pytest.raises(AssertionError, match="bad flag --x"):
        procs.start_leader(broken)

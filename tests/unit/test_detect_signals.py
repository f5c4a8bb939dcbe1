"""Signals: heartbeat payloads, host readings, process state, the nvidia-smi probe."""
from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unbroken.detect.signals import (HealthProbe, Heartbeat, NvidiaSmiProbe, parse_meminfo, parse_nvidia_smi,
                                     read_host_signals, read_proc_state)

finite = st.floats(min_value=0, max_value=1e6, allow_nan=False)


@settings(max_examples=50, deadline=None)
@given(rank=st.none() | st.integers(0, 1023), node=st.integers(0, 127), step=st.integers(0, 10**9),
       phase=st.sampled_from(["forward", "backward", "allreduce", "init"]), t=finite,
       step_s=st.none() | finite, wait_s=st.none() | finite)
def test_heartbeat_roundtrips_through_its_payload(rank, node, step, phase, t, step_s, wait_s):
    hb = Heartbeat(proc="w1", rank=rank, node=node, step=step, phase=phase, time=t, step_s=step_s, wait_s=wait_s)
    assert Heartbeat.decode(hb.encode()) == hb
    if step_s is not None:
        assert 0 <= hb.busy_s <= step_s


@pytest.mark.parametrize("kw, msg", [({"proc": ""}, "proc"), ({"step": -1}, "step"),
                                     ({"step_s": float("nan")}, "step_s"), ({"wait_s": -1.0}, "wait_s")])
def test_heartbeat_rejects_bad_values_naming_the_field(kw, msg):
    base = dict(proc="w0", rank=0, node=0, step=1, phase="forward", time=1.0)
    with pytest.raises(ValueError, match=msg):
        Heartbeat(**(base | kw))


def test_heartbeat_decode_rejects_garbage():
    with pytest.raises(ValueError, match="not a heartbeat"):
        Heartbeat.decode(b'{"proc": "w0"}')
    with pytest.raises(ValueError, match="not a heartbeat"):
        Heartbeat.decode(b"\x00{")


def test_parse_meminfo_reads_available_and_total():
    avail, total = parse_meminfo("MemTotal:       2097152 kB\nMemFree: 10 kB\nMemAvailable:    1048576 kB\n")
    assert (avail, total) == (1.0, 2.0)
    assert parse_meminfo("garbage\n") == (None, None)


def test_host_signals_measure_the_filesystem_of_a_not_yet_created_dir(tmp_path):
    s = read_host_signals(tmp_path / "ckpt" / "not" / "yet")
    assert s.disk_free_gb is not None and s.disk_free_gb > 0
    assert set(s.event_fields()) == {"load", "mem_available_gb", "disk_free_gb"}
    if Path("/proc/meminfo").exists():
        assert 0 < s.mem_available_gb <= s.mem_total_gb


@pytest.fixture
def sleeper():
    p = subprocess.Popen(["sleep", "30"])
    yield p
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=10)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")
def test_read_proc_state_sees_a_stopped_process(sleeper):
    os.kill(sleeper.pid, signal.SIGSTOP)
    for _ in range(200):
        if read_proc_state(sleeper.pid) == "T":
            break
        time.sleep(0.01)
    assert read_proc_state(sleeper.pid) == "T"
    assert read_proc_state(os.getpid()) in ("R", "S")
    assert read_proc_state(2**22 + 7) is None


def _fake_smi(tmp_path: Path, body: str) -> str:
    exe = tmp_path / "fake-smi"
    exe.write_text(f"#!{sys.executable}\nimport sys, time\n{body}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(exe)


def test_nvidia_smi_probe_skips_cleanly_without_the_tool():
    probe = NvidiaSmiProbe(executable="nvidia-smi-definitely-absent")
    assert isinstance(probe, HealthProbe)
    assert probe.probe() is None
    assert "not found" in probe.skipped_reason


def test_nvidia_smi_probe_judges_a_healthy_and_a_sick_gpu(tmp_path):
    out = "0, 41, 1024, 143771, 0\\n1, 95, 10, 143771, 2\\n2, 40, [N/A], 143771, [N/A]\\n"
    probe = NvidiaSmiProbe(executable=_fake_smi(tmp_path, f"print('{out}', end='')"), max_temp_c=90)
    r = probe.probe()
    assert r is not None and not r.ok and len(r.gpus) == 3
    assert r.problems == ("GPU 1: 2 uncorrected ECC errors", "GPU 1: 95 C is above 90 C")
    assert r.gpus[2]["memory.used"] is None


@pytest.mark.parametrize("body, expect", [
    ("sys.stderr.write('NVIDIA-SMI has failed because it could not communicate with the driver\\n'); sys.exit(9)",
     "exited 9: NVIDIA-SMI has failed"),
    ("time.sleep(30)", "did not answer"),
    ("print('', end='')", "listed no GPUs"),
    ("print('0, 41')", "unexpected nvidia-smi line"),
])
def test_nvidia_smi_probe_reports_failures_without_raising(tmp_path, body, expect):
    # only the hanging fake should meet the timeout; the others may start slowly on a busy machine
    r = NvidiaSmiProbe(executable=_fake_smi(tmp_path, body), timeout_s=0.5 if "sleep" in body else 30).probe()
    assert r is not None and not r.ok and expect in r.problems[0]


def test_parse_nvidia_smi_accepts_a_healthy_fleet():
    r = parse_nvidia_smi("0, 35, 0, 81559, 0\n1, 36, 0, 81559, 0\n", max_temp_c=90)
    assert r.ok and r.problems == () and [g["index"] for g in r.gpus] == [0, 1]


@pytest.mark.parametrize("kw", [{"timeout_s": 0}, {"max_temp_c": -1}])
def test_nvidia_smi_probe_config_is_validated(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        NvidiaSmiProbe(**kw)

"""`unbroken bench multinode --only node-loss|node0-loss|store-cost`: whole-node loss, measured on real runs.

node-loss: a 2-node x 2-rank job on loopback (two supervisors, node 0's TCPStore); node 1's whole
process group (supervisor, workers, shadows) SIGKILLed after step `kill_step`; the job finishes on
node 0's shadows. Its final weights' sha256 is compared with the failure-free run of the same
config; `path` and `recovery_s` are the run's own (summary.json's recovery record).
node0-loss: the same job on the replicated store (a local 3-member etcd cluster); node 0's whole
process group SIGKILLed with its etcd member; node 1 takes the leader role over.
store-cost: the same single-node job (4 ranks, one rank SIGKILLed mid-run) on TCPStore and on the
etcd store, interleaved over rounds: mean steady step time and recovery time of each, and the requests
the etcd members served during each run (a count from their /metrics: not a timing, stable on a busy host).
Each section is written into multinode.json beside what is there (its own commit with it).
"""
from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from unbroken.bench.common import free_port, job_events, steady_step_times
from unbroken.events import read_events
from unbroken.fsutil import atomic_write_json
from unbroken.provenance import git_commit
from unbroken.runtime import etcd_cluster

JOB = ["--n-layer", "2", "--n-embd", "64", "--batch-size", "4", "--world-size", "4", "--chunk-kb", "16",
       "--parity-group", "2", "--checkpoint-every", "4", "--shadows", "2"]
_TIMEOUT_S = 600.0
_LEASE = "node_lease_s = 8.0\n"  # etcd: each store call is an HTTP round trip


def _cmd(run_dir: Path, config: Path, steps: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "unbroken.cli", "run", "--run-dir", str(run_dir), "--no-progress", "--json",
            "--tee", "none", "--config", str(config), *JOB, "--steps", str(steps), *extra]


def _start(cmd: list[str]) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PET_", "MASTER_", "UNBROKEN_"))}
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)


def _step_reached(run_dir: Path, step: int) -> bool:
    ev = run_dir / "events.jsonl"
    return ev.exists() and any(e.kind == "step" and e.fields.get("step", 0) >= step for e in read_events(run_dir))


def _summary(p: subprocess.Popen, what: str) -> dict:
    out, err = p.communicate(timeout=_TIMEOUT_S)
    if p.returncode != 0:
        raise RuntimeError(f"{what} failed (exit {p.returncode}): {err.strip().splitlines()[-3:]}")
    return json.loads(out)


def two_nodes(root: Path, config: Path, steps: int, *, store: str | None = None, kill: int | None = None,
              kill_step: int = 4, on_kill=lambda: None) -> dict:
    """One 2x2 job (shared run directory); `kill`: the node whose process group is SIGKILLed after
    `kill_step`. Returns the summary of the node that finishes (node 0 unless it was killed)."""
    run_dir = root / "run"
    where = ["--store", store] if store else ["--port", str(free_port())]
    procs = []
    try:
        for node in (0, 1):
            procs.append(_start(_cmd(run_dir, config, steps, "--nnodes", "2", "--node-rank", str(node),
                                     "--token", "bench", *where)))
            time.sleep(1.0)  # node 0 claims the store first
        if kill is not None:
            deadline = time.monotonic() + _TIMEOUT_S
            while not _step_reached(run_dir, kill_step):
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise RuntimeError(f"step {kill_step} not reached; see {run_dir}")
                time.sleep(0.05)
            os.killpg(procs[kill].pid, signal.SIGKILL)
            on_kill()
        survivor = 1 if kill == 0 else 0
        summary = _summary(procs[survivor], f"node {survivor}")
        for n, p in enumerate(procs):
            if n != survivor and n != kill:
                _summary(p, f"node {n}")
        return {**summary, "run_dir": str(run_dir)}
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)


def _incident(summary: dict, reference: dict) -> dict:
    recs = [r for r in summary.get("recoveries", []) if r.get("complete")]
    return {"path": ",".join(sorted({r["path"] for r in recs})) or None,
            "recovery_s": recs[0]["recovery_s"] if recs else None, "recoveries": len(recs),
            "steps_lost": summary.get("steps_lost"),
            "weights_match": summary.get("weights_sha256") == reference.get("weights_sha256"),
            "ok": bool(summary.get("ok"))}


def measure_node_loss(*, steps: int = 12, log=print) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "job.toml"
        config.write_text(_LEASE)
        log("node-loss: failure-free 2x2 reference")
        ref = two_nodes(Path(tmp) / "ref", config, steps)
        log("node-loss: node 1 SIGKILLed")
        got = two_nodes(Path(tmp) / "kill", config, steps, kill=1)
    return {**_incident(got, ref), "layout": "2x2", "steps": steps, "store": "tcp"}


@contextmanager
def _with_etcd():
    """(a temporary directory, the lease config in it, a 3-member etcd cluster), torn down after."""
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "job.toml"
        config.write_text(_LEASE)
        with etcd_cluster.running(etcd_cluster.scratch_dir("unbroken-bench-etcd", Path(tmp))) as members:
            yield Path(tmp), config, members


def measure_node0_loss(*, steps: int = 12, log=print) -> dict:
    with _with_etcd() as (tmp, config, members):
        log("node0-loss: failure-free 2x2 reference (etcd store)")
        ref = two_nodes(tmp / "ref", config, steps, store=etcd_cluster.url(members, "ref"))
        log("node0-loss: node 0 and its etcd member SIGKILLed")
        got = two_nodes(tmp / "kill", config, steps, store=etcd_cluster.url(members, "kill"), kill=0,
                        on_kill=lambda: etcd_cluster.kill_member(members[0]))
        elected = [e.fields for e in read_events(Path(got["run_dir"])) if e.kind == "leader_elected"]
    inc = _incident(got, ref)
    return {**inc, "survived": inc["ok"] and bool(elected), "leader_elected": elected, "layout": "2x2",
            "steps": steps, "store": "etcd (3 members, one lost with node 0)"}


def _one_node(run_dir: Path, config: Path, steps: int, store: str | None) -> dict:
    extra = ["--inject", f"sigkill:rank=2,step={steps // 2},phase=optimizer"]
    s = _summary(_start(_cmd(run_dir, config, steps, *extra, *(["--store", store] if store else []))), "store-cost run")
    recs = [r for r in s.get("recoveries", []) if r.get("complete")]
    times = steady_step_times(job_events(run_dir))
    return {"mean_step_s": statistics.fmean(times), "recovery_s": recs[0]["recovery_s"] if recs else None}


def _cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes have used so far."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
    return total / tick


def _etcd_requests(members) -> dict[str, int]:
    """gRPC requests the members have served so far, by method (Range, Txn, Put, Watch, ...): every
    client request, the JSON gateway's included, is one (their /metrics, `grpc_server_started_total`)."""
    out: dict[str, int] = {}
    for m in members:
        with urllib.request.urlopen(f"http://{m.endpoint}/metrics", timeout=5) as r:
            text = r.read().decode()
        for line in text.splitlines():
            if line.startswith("grpc_server_started_total{") and (found := re.search(r'grpc_method="(\w+)"', line)):
                out[found.group(1)] = out.get(found.group(1), 0) + int(float(line.rsplit(" ", 1)[1]))
    return out


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def measure_store_cost(*, steps: int = 16, rounds: int = 3, log=print) -> dict:
    """Each run also records the CPU the etcd members used while it ran (`etcd_cpu_s`, 0 for
    TCPStore runs): on a 2-core box that CPU is taken from the ranks; on a cluster the members
    run on their own cores."""
    runs: dict[str, list[dict]] = {"tcp": [], "etcd": []}
    with _with_etcd() as (tmp, config, members):
        for r in range(rounds):
            for kind in ("tcp", "etcd"):
                log(f"store-cost: {kind} round {r + 1}/{rounds}")
                store = etcd_cluster.url(members, f"cost{r}") if kind == "etcd" else None
                before, calls = _cpu_s([m.pid for m in members]), _etcd_requests(members)
                run = _one_node(tmp / f"{kind}{r}", config, steps, store)
                served = _delta(_etcd_requests(members), calls)
                runs[kind].append({**run, "etcd_cpu_s": _cpu_s([m.pid for m in members]) - before,
                                   "etcd_requests": served, "etcd_requests_total": sum(served.values())})
    mean = {k: {f: statistics.fmean(x[f] for x in v if x[f] is not None) for f in ("mean_step_s", "recovery_s")}
            for k, v in runs.items()}
    return {"job": "1 node x 4 ranks, rank 2 SIGKILLed mid-run", "steps": steps, "rounds": rounds, "runs": runs,
            "mean": mean, "per_step_s": mean["etcd"]["mean_step_s"] - mean["tcp"]["mean_step_s"],
            "etcd_cpu_s_per_run": {k: statistics.fmean(x["etcd_cpu_s"] for x in v) for k, v in runs.items()},
            "etcd_requests_per_run": {k: statistics.fmean(x["etcd_requests_total"] for x in v) for k, v in runs.items()},
            "per_recovery_s": mean["etcd"]["recovery_s"] - mean["tcp"]["recovery_s"]}


def write_sections(sections: dict, path: Path) -> None:
    """Each section into multinode.json with its own commit; every other key kept."""
    data = json.loads(path.read_text()) if path.exists() else {}
    for key, res in sections.items():
        data[key] = {**res, **git_commit()}
    atomic_write_json(path, data)

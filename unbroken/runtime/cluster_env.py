"""A node's place in the job from its launcher's environment: torchrun, Kubernetes/TorchX, Slurm.

`unbroken run` on each node needs the node count, this node's index and node 0's address
and port. Flags win; then torchrun's variables (NNODES, NODE_RANK or GROUP_RANK,
MASTER_ADDR, MASTER_PORT, WORLD_SIZE); then the PET_* variables through which Kubeflow's
PyTorchJob and TorchX hand torchrun its arguments (PET_NNODES, PET_NODE_RANK,
PET_MASTER_ADDR, PET_MASTER_PORT, PET_NPROC_PER_NODE); then Slurm's (SLURM_NNODES,
SLURM_NODEID, the first host of SLURM_JOB_NODELIST; the port from SLURM_JOB_ID, so every
node of one allocation agrees on it without being told).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

SLURM_PORT_BASE, SLURM_PORT_SPAN = 15000, 20000  # port = base + SLURM_JOB_ID % span


class ClusterEnvError(ValueError):
    """A launcher variable that cannot be used (not a number, an empty node list, ...)."""


@dataclass(frozen=True)
class NodePlace:
    """What the environment says; None: it says nothing (the flag's or the built-in default applies)."""

    nnodes: int | None = None
    node_rank: int | None = None
    host: str | None = None
    port: int | None = None
    world_size: int | None = None
    source: str = "none"  # which launcher's variables were used: torchrun, pet, slurm, none


def _int(env: Mapping[str, str], name: str) -> int | None:
    v = env.get(name)
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError:
        raise ClusterEnvError(f"environment variable {name}={v!r} is not an integer; unset it or fix it") from None


def _first(*values):
    return next((v for v in values if v is not None), None)


def from_env(env: Mapping[str, str]) -> NodePlace:
    """Each field from the first launcher family that sets it (torchrun, then PET_*, then Slurm)."""
    slurm_nodes = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    slurm_job = _int(env, "SLURM_JOB_ID")
    slurm = {"nnodes": _int(env, "SLURM_NNODES") or _int(env, "SLURM_JOB_NUM_NODES"),
             "node_rank": _int(env, "SLURM_NODEID"),
             "host": first_host(slurm_nodes) if slurm_nodes else None,
             "port": SLURM_PORT_BASE + slurm_job % SLURM_PORT_SPAN if slurm_job is not None else None}
    pet_nproc, pet_nnodes = _int(env, "PET_NPROC_PER_NODE"), _pet_nnodes(env)
    pet = {"nnodes": pet_nnodes, "node_rank": _int(env, "PET_NODE_RANK"), "host": env.get("PET_MASTER_ADDR") or None,
           "port": _int(env, "PET_MASTER_PORT"),
           "world_size": pet_nproc * pet_nnodes if pet_nproc and pet_nnodes else None}
    torchrun = {"nnodes": _int(env, "NNODES"), "node_rank": _first(_int(env, "NODE_RANK"), _int(env, "GROUP_RANK")),
                "host": env.get("MASTER_ADDR") or None, "port": _int(env, "MASTER_PORT"),
                "world_size": _int(env, "WORLD_SIZE")}
    families = (("torchrun", torchrun), ("pet", pet), ("slurm", slurm))
    fields = {k: _first(*(f.get(k) for _, f in families)) for k in ("nnodes", "node_rank", "host", "port", "world_size")}
    used = [name for name, f in families if any(v is not None for v in f.values())]
    return NodePlace(**fields, source="+".join(used) or "none")


def _pet_nnodes(env: Mapping[str, str]) -> int | None:
    """PET_NNODES is torchrun's --nnodes: a number or MIN:MAX (elastic); a fixed job uses MAX."""
    v = env.get("PET_NNODES")
    if not v:
        return None
    lo, _, hi = v.partition(":")
    try:
        return int(hi or lo)
    except ValueError:
        raise ClusterEnvError(f"environment variable PET_NNODES={v!r} is neither N nor MIN:MAX") from None


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_hostlist(spec: str) -> list[str]:
    """Slurm's compressed host list, e.g. `gpu[01-03,07],login1` or `rack[1-2]-n[1-2]`, in order."""
    hosts: list[str] = []
    for part in _split_top(spec.strip(), ","):
        if part:
            hosts.extend(_expand_one(part, spec))
    if not hosts:
        raise ClusterEnvError(f"SLURM_JOB_NODELIST={spec!r} names no host; is this a Slurm allocation?")
    return hosts


def first_host(spec: str) -> str:
    return expand_hostlist(spec)[0]


def _split_top(s: str, sep: str) -> list[str]:
    """Split at `sep` outside brackets."""
    out, depth, cur = [], 0, []
    for ch in s:
        depth += (ch == "[") - (ch == "]")
        if ch == sep and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur))
    return out


def _expand_one(part: str, spec: str) -> list[str]:
    i = part.find("[")
    if i < 0:
        if "]" in part:
            raise ClusterEnvError(f"host list {spec!r}: unmatched ']' in {part!r}")
        return [part]
    j = part.find("]", i)
    if j < 0:
        raise ClusterEnvError(f"host list {spec!r}: unmatched '[' in {part!r}")
    head, body, tail = part[:i], part[i + 1:j], part[j + 1:]
    rests = _expand_one(tail, spec) if tail else [""]
    out = []
    for item in body.split(","):
        m = _RANGE.match(item.strip())
        if not m:
            raise ClusterEnvError(f"host list {spec!r}: {item!r} is not N or N-M")
        a, b = m.group(1), m.group(2) or m.group(1)
        if int(b) < int(a):
            raise ClusterEnvError(f"host list {spec!r}: range {item!r} runs backwards")
        width = len(a) if a.startswith("0") else 0  # gpu[01-10] keeps the zero padding
        for n in range(int(a), int(b) + 1):
            out.extend(f"{head}{n:0{width}d}{rest}" for rest in rests)
    return out

"""A wiring of our own: N network namespaces on one bridge, each link shaped with `tc tbf`.

Rank r lives in namespace `<prefix>r` with address 10.<net>.0.<r+1>/24 on a veth whose other
end joins the bridge `<prefix>br`. A link's rate shapes both directions: `tbf` on the
namespace end (what r sends) and on the bridge end (what r receives). These kernels have no
netem, so a wiring is bandwidths only (latency is what the kernel and gloo give). Only the
addresses inside namespaces this harness creates are ever used. Needs root (CAP_NET_ADMIN);
`available()` says why not when it cannot run.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from typing import Sequence

from unbroken.runtime.procs import kill_pids

_IP_TIMEOUT_S = 10.0


class NetnsError(RuntimeError):
    """A namespace, link or qdisc could not be set up (the message names the command)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Wiring:
    """A named wiring: per rank, its link's rate in Mbit/s (None = unshaped)."""

    name: str
    rates_mbit: tuple[float | None, ...]

    def __post_init__(self) -> None:
        if len(self.rates_mbit) < 1:
            raise ValueError(f"wiring {self.name!r} has no ranks")
        for r in self.rates_mbit:
            if r is not None and not r > 0:
                raise ValueError(f"wiring {self.name!r}: link rate {r!r} Mbit/s must be > 0 (or None = unshaped)")

    @property
    def world(self) -> int:
        return len(self.rates_mbit)

    @classmethod
    def uniform(cls, name: str, world: int, rate_mbit: float | None) -> "Wiring":
        return cls(name=name, rates_mbit=(rate_mbit,) * world)

    @classmethod
    def one_slow(cls, name: str, world: int, fast_mbit: float | None, slow_mbit: float, slow_rank: int = 1) -> "Wiring":
        rates = [fast_mbit] * world
        rates[slow_rank % world] = slow_mbit
        return cls(name=name, rates_mbit=tuple(rates))


def available() -> str | None:
    """None when this process can build namespaces; otherwise the reason it cannot."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN); run as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    return None


def _run(cmd: Sequence[str]) -> None:
    try:
        out = subprocess.run(list(cmd), capture_output=True, text=True, timeout=_IP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise NetnsError(f"`{' '.join(cmd)}` did not finish within {_IP_TIMEOUT_S:g} s") from None
    if out.returncode != 0:
        raise NetnsError(f"`{' '.join(cmd)}` failed: {out.stderr.strip() or out.stdout.strip()}")


def _tbf(dev: str, rate_mbit: float, netns: str | None) -> list[str]:
    """A token bucket at `rate_mbit`: burst ~ 10 ms of traffic (at least 16 KB), 100 ms of queue."""
    burst = max(16 * 1024, int(rate_mbit * 1e6 / 8 * 0.01))
    prefix = ["ip", "netns", "exec", netns] if netns else []
    return prefix + ["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate_mbit}mbit",
                     "burst", str(burst), "latency", "100ms"]


class Netns:
    """Build a wiring on enter, tear every namespace, link and the bridge down on exit."""

    def __init__(self, wiring: Wiring, *, prefix: str | None = None, net: int | None = None,
                 host_address: bool = False) -> None:
        why = available()
        if why:
            raise NetnsError(why)
        self.wiring = wiring
        self.prefix = prefix or f"ub{os.getpid() % 100000}"
        self.net = net if net is not None else 200 + os.getpid() % 50  # 10.<net>.0.0/24, ours alone
        if len(self.prefix) > 8:
            raise ValueError(f"namespace prefix {self.prefix!r} is over 8 characters (interface names are <= 15)")
        self.bridge = f"{self.prefix}br"
        # with host_address the bridge itself takes 10.<net>.0.254: the calling (root) namespace can
        # reach the namespaces' addresses (a test's health checks of services living in them)
        self.host_address = f"10.{self.net}.0.254" if host_address else None
        self._made: list[tuple[str, str]] = []  # what to delete, newest last: ("ns"|"link", name)

    def namespace(self, rank: int) -> str:
        return f"{self.prefix}n{rank}"

    def address(self, rank: int) -> str:
        return f"10.{self.net}.0.{rank + 1}"

    def interface(self, rank: int) -> str:
        """The veth inside rank's namespace (what GLOO_SOCKET_IFNAME names)."""
        return "eth0"

    def exec_prefix(self, rank: int) -> list[str]:
        """Prefix a command with this to run it inside rank's namespace."""
        return ["ip", "netns", "exec", self.namespace(rank)]

    def env(self, rank: int) -> dict[str, str]:
        """What a process in rank's namespace needs so gloo uses the wiring's link."""
        return {"GLOO_SOCKET_IFNAME": self.interface(rank)}

    def __enter__(self) -> "Netns":
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        _run(["ip", "link", "add", self.bridge, "type", "bridge"])
        self._made.append(("link", self.bridge))
        _run(["ip", "link", "set", self.bridge, "up"])
        if self.host_address:
            _run(["ip", "addr", "add", f"{self.host_address}/24", "dev", self.bridge])
        for r, rate in enumerate(self.wiring.rates_mbit):
            ns, outer = self.namespace(r), f"{self.prefix}v{r}"
            _run(["ip", "netns", "add", ns])
            self._made.append(("ns", ns))
            _run(["ip", "link", "add", outer, "type", "veth", "peer", "name", "eth0", "netns", ns])
            self._made.append(("link", outer))
            _run(["ip", "link", "set", outer, "master", self.bridge, "up"])
            inside = ["ip", "netns", "exec", ns]
            _run(inside + ["ip", "link", "set", "lo", "up"])
            _run(inside + ["ip", "addr", "add", f"{self.address(r)}/24", "dev", "eth0"])
            _run(inside + ["ip", "link", "set", "eth0", "up"])
            if rate is not None:
                _run(_tbf("eth0", rate, ns))  # what rank r sends
                _run(_tbf(outer, rate, None))  # what rank r receives

    def kill_all(self, rank: int) -> list[int]:
        """SIGKILL every process living in rank's namespace (a whole node's sudden death); their pids."""
        out = subprocess.run(["ip", "netns", "pids", self.namespace(rank)], capture_output=True, text=True,
                             timeout=_IP_TIMEOUT_S).stdout.split()
        return kill_pids([int(p) for p in out])

    def set_rate(self, rank: int, rate_mbit: float) -> None:
        """Change rank's link rate (both directions) while the wiring is up: `tc qdisc replace`."""
        if not rate_mbit > 0:
            raise ValueError(f"link rate must be > 0 Mbit/s, got {rate_mbit!r}")
        _run(_tbf("eth0", rate_mbit, self.namespace(rank)))
        _run(_tbf(f"{self.prefix}v{rank}", rate_mbit, None))

    def close(self) -> None:
        """Delete what was made (namespaces take their veth ends with them); never raises."""
        while self._made:
            kind, name = self._made.pop()
            cmd = ["ip", "netns", "del", name] if kind == "ns" else ["ip", "link", "del", name]
            try:
                subprocess.run(cmd, capture_output=True, timeout=_IP_TIMEOUT_S)
            except (OSError, subprocess.TimeoutExpired):
                pass

"""Flow statistics: transfers -> a moving estimate of each directed link's bandwidth -> congestion.

The network model is a switch with one link per rank, each way: ("up", r) carries what rank r
sends, ("down", r) what it receives (a rack switch; the bench wiring's bridge + veth + tbf).
A pair's rate is min(up_i, down_j). One collective's transfers give one observation per link:
the peak of the summed rates of the flows on it that were in flight at the same instant (a
flow's rate = bytes / (end - start), start = when both ends had posted it). The peak, not the
mean: a fast rank's link is idle while it waits for a slow peer, and that says nothing about
the fast link.

Each link's estimate is the median of its last `FlowConfig.window` observations (one outlier,
a rank descheduled on a shared host, moves nothing; a real change shows within window//2 + 1
collectives), with a baseline (the highest estimate seen) and a congestion flag with
hysteresis: set when the estimate falls below `congested_below` x baseline, cleared only above
`clear_above` x baseline. (The adaptive all-reduce plans against the fleet's rate instead,
comm/adaptive.py `slow_links`, with the same thresholds: a maximum over time is inflated by a
token bucket's burst.)
Pure logic: no clocks, no I/O; comm/adaptive.py feeds it.
"""
from __future__ import annotations

import dataclasses
import statistics
from typing import Iterable, NamedTuple

Link = tuple[str, int]  # ("up" | "down", rank)


@dataclasses.dataclass(frozen=True, kw_only=True)
class FlowConfig:
    window: int = 3  # observations the moving median is taken over
    congested_below: float = 0.6  # congested when estimate < this x baseline
    clear_above: float = 0.8  # not congested again only when estimate > this x baseline
    # a link under this x the fleet's rate but not congested: shared with traffic of another job,
    # the adaptive all-reduce spreads its bytes over direct flows (comm/adaptive.py `contended`)
    contended_below: float = 0.85
    uncontended_above: float = 0.95  # a contended link is not contended again only above this x the fleet's rate
    # Smaller flows say more about buffers (a token bucket's burst, socket buffers) than about the
    # link: 1.4 MB flows measured 161..638 MB/s on 125 MB/s links. Short flows are kept: a flow
    # that ended fast is the evidence that its two links are fast (dropping them left only the
    # flows to a slow peer, and every link looked slow).
    min_bytes: int = 1 << 20
    min_seconds: float = 2e-3  # thread wake-up jitter
    stale_after: int = 5  # a link without observations in this many collectives is unknown again

    def __post_init__(self) -> None:
        if not isinstance(self.window, int) or self.window < 1:
            raise ValueError(f"FlowConfig window must be an integer >= 1 (observations), got {self.window!r}")
        if not 0 < self.congested_below < self.clear_above <= 1:
            raise ValueError("FlowConfig needs 0 < congested_below < clear_above <= 1 (hysteresis), got "
                             f"{self.congested_below!r} and {self.clear_above!r}")
        if not self.congested_below < self.contended_below <= 1:
            raise ValueError(f"FlowConfig needs congested_below < contended_below <= 1, got {self.congested_below!r} "
                             f"and {self.contended_below!r}")
        if not self.contended_below < self.uncontended_above <= 1:
            raise ValueError("FlowConfig needs contended_below < uncontended_above <= 1 (hysteresis), got "
                             f"{self.contended_below!r} and {self.uncontended_above!r}")
        if not isinstance(self.stale_after, int) or self.stale_after < 1:
            raise ValueError(f"FlowConfig stale_after must be an integer >= 1 (collectives), got {self.stale_after!r}")
        if self.min_bytes < 0 or self.min_seconds < 0:
            raise ValueError(f"FlowConfig min_bytes/min_seconds must be >= 0, got {self.min_bytes}, {self.min_seconds}")


class Flow(NamedTuple):
    src: int
    dst: int
    nbytes: int
    start: float
    end: float


class LinkEstimate:
    """One directed link's moving bandwidth estimate (bytes/s), baseline and congestion flag."""

    def __init__(self, cfg: FlowConfig) -> None:
        self.cfg = cfg
        self.recent: list[float] = []
        self.rate: float | None = None
        self.baseline = 0.0
        self.congested = False
        self.samples = 0

    def observe(self, rate: float, weight: int = 1) -> bool:
        """Fold in one observation, counted `weight` times; True when the congestion flag changed."""
        if not rate > 0:
            raise ValueError(f"a link observation must be a rate > 0 bytes/s, got {rate!r}")
        if not isinstance(weight, int) or weight < 1:
            raise ValueError(f"an observation's weight must be an integer >= 1, got {weight!r}")
        self.recent = [*self.recent, *[rate] * weight][-self.cfg.window:]
        self.rate = statistics.median(self.recent)
        self.baseline = max(self.baseline, self.rate)
        self.samples += 1
        was = self.congested
        if self.congested:
            self.congested = self.rate <= self.cfg.clear_above * self.baseline
        else:
            self.congested = self.rate < self.cfg.congested_below * self.baseline
        return was != self.congested


class FlowTable:
    """Every link's estimate; `observe_flows` takes one collective's flows. A link that carried no
    measurable flow for `stale_after` collectives is forgotten (a pattern that spares a slow link
    stops measuring it: forgetting lets the planner try it again once it may have recovered)."""

    def __init__(self, cfg: FlowConfig | None = None) -> None:
        self.cfg = cfg or FlowConfig()
        self.links: dict[Link, LinkEstimate] = {}
        self.tick = 0  # collectives observed
        self._seen: dict[Link, int] = {}

    def observe(self, link: Link, rate: float, weight: int = 1) -> bool:
        est = self.links.setdefault(link, LinkEstimate(self.cfg))
        self._seen[link] = self.tick
        return est.observe(rate, weight)

    def observe_flows(self, flows: Iterable[Flow], *, weight: int = 1) -> list[tuple[Link, bool]]:
        """Fold in one collective's flows, each link's reading counted `weight` times; the links whose
        congestion flag changed, with the new flag (a forgotten congested link counts as cleared)."""
        self.tick += 1
        changed = []
        for link, rate in sorted(peak_rates(flows, self.cfg).items()):
            if self.observe(link, rate, weight):
                changed.append((link, self.links[link].congested))
        for link in sorted(k for k, t in self._seen.items() if self.tick - t >= self.cfg.stale_after):
            del self._seen[link]
            if self.links.pop(link).congested:
                changed.append((link, False))
        return changed

    def rate(self, link: Link) -> float | None:
        est = self.links.get(link)
        return est.rate if est else None

    def congested(self) -> list[Link]:
        return sorted(k for k, v in self.links.items() if v.congested)


def fleet_rate(rates: Iterable[float], congested_below: float) -> float:
    """The fleet's typical uncongested rate, the reference a link is slow against: the median of
    the links above the widest gap in the sorted rates when that gap is a congestion's (the rate
    above it over the one below is at least 1 / congested_below) and at least half the links lie
    above it; else the median of all. With two slow ranks of four, four links of eight are slow,
    and the median of all fell between the two groups (71 MB/s between 45-53 and 91-150): the
    slow links read above 0.6x of it and were planned as fast ones. A single link above a gap is
    no fleet (one estimate inflated by a token bucket's burst would make every other link slow)."""
    xs = sorted(rates)
    if not xs:
        raise ValueError("fleet_rate needs at least one link rate")
    n, best, cut = len(xs), 1.0 / congested_below, None
    for i in range(1, n // 2 + 1):  # cut below xs[i]: n - i >= n / 2 links above it
        gap = xs[i] / xs[i - 1]
        if gap >= best:
            best, cut = gap, i
    return statistics.median(xs[cut:] if cut is not None else xs)


def peak_rates(flows: Iterable[Flow], cfg: FlowConfig) -> dict[Link, float]:
    """Per link: the highest sum of the rates of its flows in flight at one instant."""
    per: dict[Link, list[tuple[float, float, float]]] = {}
    for f in flows:
        secs = f.end - f.start
        if f.nbytes < cfg.min_bytes or secs < cfg.min_seconds:
            continue
        rate = f.nbytes / secs
        per.setdefault(("up", f.src), []).append((f.start, f.end, rate))
        per.setdefault(("down", f.dst), []).append((f.start, f.end, rate))
    return {link: _peak(spans) for link, spans in per.items()}


def _peak(spans: list[tuple[float, float, float]]) -> float:
    """Max over time of the summed rates of overlapping [start, end) spans (a sweep; ends before starts)."""
    edges = sorted([(s, 1, r) for s, _, r in spans] + [(e, 0, -r) for _, e, r in spans])
    level = best = 0.0
    for _, _, r in edges:
        level += r
        best = max(best, level)
    return best


def join(recvs: Iterable[tuple[int, int, int, int, float, float]],
         sends: Iterable[tuple[int, int, int, float]]) -> list[Flow]:
    """Flows from receiver records (src, dst, tag, nbytes, posted, ended) and sender records (src, dst,
    tag, posted): a flow starts when both ends had posted it (skew between ranks is not transfer time).
    Times are wall clocks of the ranks' hosts; a receive whose send is unknown starts at its own post."""
    posted = {(s, d, t): p for s, d, t, p in sends}
    return [Flow(s, d, n, max(p, posted.get((s, d, t), p)), e) for s, d, t, n, p, e in recvs]

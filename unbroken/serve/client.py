"""A bounded open-loop load generator: replays arrivals against a server or router over HTTP and
returns what each request measured (client-side end-to-end latency, server-side TTFT and queueing)."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp

from unbroken.serve.workload import Arrival

_TEXT = "the quick brown fox jumps over the lazy dog. "


@dataclass(frozen=True)
class Result:
    arrival: Arrival
    status: int
    sent: float  # seconds from the replay's start
    e2e_s: float  # client-side, HTTP included
    ttft_s: float | None
    queue_s: float | None
    tokens: int
    server_e2e_s: float | None = None  # the same request's latency inside the server


def prompt_of(n: int) -> str:
    return (_TEXT * (n // len(_TEXT) + 1))[:n]


def replay(url: str, arrivals: list[Arrival], *, timeout_s: float = 60.0, max_inflight: int = 256) -> list[Result]:
    """Send each arrival at its time (open loop, at most `max_inflight` outstanding); every request
    has a timeout, so this returns within the workload's length + timeout_s."""
    return asyncio.run(_replay(url, arrivals, timeout_s, max_inflight))


async def _replay(url: str, arrivals: list[Arrival], timeout_s: float, max_inflight: int) -> list[Result]:
    gate = asyncio.Semaphore(max_inflight)
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s),
                                     connector=aiohttp.TCPConnector(limit=max_inflight)) as session:
        async def one(a: Arrival) -> Result:
            await asyncio.sleep(max(0.0, a.t - (time.perf_counter() - t0)))
            async with gate:
                sent = time.perf_counter()
                body = {"model": a.adapter, "prompt": prompt_of(a.prompt_len), "max_tokens": a.gen_len}
                try:
                    async with session.post(url + "/v1/completions", json=body) as resp:
                        out = await resp.json()
                        status = resp.status
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    out, status = {}, 0
                e2e = time.perf_counter() - sent
            m = out.get("metrics", {}) if status == 200 else {}
            return Result(a, status, sent - t0, e2e, m.get("ttft_s"), m.get("queue_s"),
                          out.get("usage", {}).get("completion_tokens", 0) if status == 200 else 0, m.get("e2e_s"))

        return list(await asyncio.gather(*(one(a) for a in arrivals)))

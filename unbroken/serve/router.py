"""The fleet's router: POST /v1/completions goes to a server that hosts the request's adapter
(round-robin among its hosts) under a placement {adapter: [server urls]} that can be replaced."""
from __future__ import annotations

import itertools
import json
from collections import Counter

import aiohttp
from aiohttp import web

from unbroken.serve.api import error

FORWARD_TIMEOUT_S = 120.0
ROUTER = web.AppKey("router", object)


class Router:
    def __init__(self, placement: dict[str, list[str]]) -> None:
        self.set_placement(placement)
        self.sent: Counter[str] = Counter()
        self.session: aiohttp.ClientSession | None = None

    def set_placement(self, placement: dict[str, list[str]]) -> None:
        self.placement = {a: list(urls) for a, urls in placement.items()}
        self._turn = {a: itertools.cycle(urls) for a, urls in self.placement.items() if urls}

    def pick(self, adapter: str | None) -> str | None:
        turn = self._turn.get(adapter or "base")
        return next(turn) if turn else None


async def _forward(request: web.Request) -> web.Response:
    router: Router = request.app[ROUTER]
    raw = await request.read()
    try:
        body = json.loads(raw)
        adapter = body.get("adapter") or body.get("model")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return error(400, "the body is not a JSON object: send {\"model\": ..., \"prompt\": ..., \"max_tokens\": ...}")
    url = router.pick(adapter)
    if url is None:
        return error(404, f"no server hosts adapter {adapter!r}: place it (unbroken serve fleet --adapters ...)")
    router.sent[url] += 1
    try:
        async with router.session.post(url + "/v1/completions", data=raw,
                                       headers={"Content-Type": "application/json"}) as resp:
            return web.Response(body=await resp.read(), status=resp.status, content_type="application/json")
    except (aiohttp.ClientError, TimeoutError) as e:
        return error(502, f"server {url} did not answer ({type(e).__name__}); it may be down")


async def _metrics(request: web.Request) -> web.Response:
    router: Router = request.app[ROUTER]
    lines = ["# TYPE unbroken_router_requests_total counter"]
    lines += [f'unbroken_router_requests_total{{server="{u}"}} {n}' for u, n in sorted(router.sent.items())]
    return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


def build_router_app(router: Router) -> web.Application:
    app = web.Application()
    app[ROUTER] = router
    app.add_routes([web.post("/v1/completions", _forward), web.get("/metrics", _metrics)])
    app.cleanup_ctx.append(_session)
    return app


async def _session(app: web.Application):
    router: Router = app[ROUTER]
    router.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=FORWARD_TIMEOUT_S),
                                           connector=aiohttp.TCPConnector(limit=512))
    yield
    await router.session.close()

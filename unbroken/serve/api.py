"""The HTTP API of one server (aiohttp): OpenAI-style POST /v1/completions with `model`/`adapter`,
GET /v1/models, GET /metrics (Prometheus text), GET /health. Bad requests get a 4xx JSON error and
the server goes on serving the others."""
from __future__ import annotations

import asyncio
import json
import threading
import time

from aiohttp import web

from unbroken.serve.adapters import RequestError, valid_name
from unbroken.serve.engine import Engine, Request, encode

REQUEST_TIMEOUT_S = 120.0
ENGINE = web.AppKey("engine", Engine)


def error(status: int, message: str) -> web.Response:
    kind = "not_found_error" if status == 404 else ("rate_limit_error" if status == 429 else "invalid_request_error")
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


def _parse(body: object, engine: Engine) -> Request:
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object with model, prompt and max_tokens")
    prompt, model = body.get("prompt"), body.get("model")
    if not isinstance(prompt, str):
        raise RequestError("prompt must be a string")
    adapter = body.get("adapter")
    if adapter is None and model not in (None, "base", engine.base):
        adapter = model  # OpenAI clients name the adapter as the model (as vLLM's multi-LoRA API does)
    if adapter is not None and not valid_name(adapter):
        raise RequestError(f"adapter {adapter!r} is not a valid name: use letters, digits, '_', '.', '-'")
    return Request(adapter, encode(prompt), body.get("max_tokens", 16))


async def completions(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return error(400, "the body is not JSON: send {\"model\": ..., \"prompt\": ..., \"max_tokens\": ...}")
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()
    try:
        req = _parse(body, engine)
        req.on_done = lambda r: loop.call_soon_threadsafe(lambda: done.done() or done.set_result(r))
        await loop.run_in_executor(None, engine.submit, req)  # may read an adapter's files
    except RequestError as e:
        return error(e.status, str(e))
    try:
        r = await asyncio.wait_for(done, REQUEST_TIMEOUT_S)
    except asyncio.TimeoutError:
        return error(504, f"request not finished within {REQUEST_TIMEOUT_S}s; the server is overloaded")
    if r.error is not None:
        return error(r.error.status, str(r.error))
    itl = [b - a for a, b in zip(r.times, r.times[1:])]
    return web.json_response({
        "id": f"cmpl-{r.id}", "object": "text_completion", "created": int(time.time()),
        "model": r.adapter or engine.base,
        "choices": [{"text": r.text(), "index": 0, "finish_reason": "length"}],
        "usage": {"prompt_tokens": r.prompt_len, "completion_tokens": len(r.out), "total_tokens": len(r.tokens)},
        "metrics": {"ttft_s": r.times[0] - r.arrival, "e2e_s": r.times[-1] - r.arrival,
                    "queue_s": r.start - r.arrival, "itl_s": sum(itl) / len(itl) if itl else 0.0}})


async def models(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    names = sorted(p.parent.name for p in engine.adapter_dir.glob("*/adapter_config.json"))
    return web.json_response({"object": "list", "data": [{"id": engine.base, "object": "model"}] +
                              [{"id": n, "object": "model", "parent": engine.base} for n in names]})


async def metrics(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    return web.Response(text=engine.metrics.render(engine), content_type="text/plain")


async def iterations(request: web.Request) -> web.Response:
    """The recent iterations [rows, padded length, largest rank, adapter loads, seconds, CPU seconds,
    seconds since the engine was last idle] and admissions [arrival to queued, idle engine's wake-up
    or null], the most recent last, with the counts of both since the start (a caller slices out what
    happened since its last look)."""
    return web.json_response(request.app[ENGINE].logs())


async def health(request: web.Request) -> web.Response:
    return web.json_response({"ok": True, "base": request.app[ENGINE].base})


def build_app(engine: Engine) -> web.Application:
    """The server's app; the engine thread runs while the app does (started and joined by it)."""
    app = web.Application(client_max_size=1 << 20)
    app[ENGINE] = engine
    app.add_routes([web.post("/v1/completions", completions), web.get("/v1/models", models),
                    web.get("/metrics", metrics), web.get("/health", health),
                    web.get("/v1/iterations", iterations)])
    app.cleanup_ctx.append(_engine_thread)
    return app


async def _engine_thread(app: web.Application):
    stop = threading.Event()
    t = threading.Thread(target=app[ENGINE].serve, args=(stop,), name="engine", daemon=True)
    t.start()
    yield
    stop.set()
    t.join(10)

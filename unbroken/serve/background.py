"""An aiohttp app served on loopback from a background thread (tests, the benchmark's router),
started and always stopped by its owner."""
from __future__ import annotations

import asyncio
import threading

from aiohttp import web


class BackgroundApp:
    """`with BackgroundApp(app, port) as url:` serves `app` at http://127.0.0.1:port until the block ends."""

    def __init__(self, app: web.Application, port: int, host: str = "127.0.0.1") -> None:
        self.app, self.port, self.host = app, port, host
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="http", daemon=True)
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __enter__(self) -> str:
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)
        except BaseException:
            self.__exit__()
            raise
        return self.url

    def __exit__(self, *exc) -> None:
        try:
            if self._runner is not None:
                asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
            self.loop.close()

    async def _start(self) -> None:
        self._runner = web.AppRunner(self.app)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()

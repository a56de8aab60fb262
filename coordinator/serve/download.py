"""`up`'s download phase: a Hugging Face repo's weights fetched into this machine's cache (the
nodes receive their shards from here, as from any folder), with progress in `up`'s log and on the
dashboard at the API's address, which answers with the download's state until the API itself
comes up (once the cluster has loaded). Ctrl-C, SIGTERM or the page's shutdown stop it; a second
`up` fetches only what is missing.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from aiohttp import web

from ...node.checkpoint import resolve_model_path
from ...node.hub import LogLines, Transfer
from ...proto.errors import ErrorKind
from .api import check_key, dashboard_file
from .api_error import ApiError
from .cluster import Member
from .config import ClusterConfig


async def fetch_weights(
    c: ClusterConfig, members: list[Member], api_key: str | None, stop: asyncio.Event
) -> Path:
    """The repo `c.model` in the cache: its snapshot folder, once every file is there."""
    page = DownloadPage(c, members, api_key, stop)
    await page.start()
    lines = LogLines(note=f"; progress on {page.url}/")

    def report(t: Transfer) -> None:  # on the hub's worker threads
        page.transfer = t
        lines(t)

    cancel = threading.Event()

    async def on_stop() -> None:
        await stop.wait()
        cancel.set()

    watch = asyncio.create_task(on_stop())
    try:
        return await asyncio.to_thread(resolve_model_path, c.model, report=report, cancel=cancel)
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        await page.close()


class DownloadPage:
    """The API's address while the model downloads: the dashboard, its status saying what has
    arrived, /health 503 with the same line, a 503 for everything else; the API key as the API
    asks it."""

    def __init__(
        self, c: ClusterConfig, members: list[Member], api_key: str | None, stop: asyncio.Event
    ):
        self.c, self.members, self.api_key, self.stop = c, members, api_key, stop
        self.transfer: Transfer | None = None  # replaced whole by the download's threads
        self.runner: web.AppRunner | None = None
        self.url = ""

    def reason(self) -> str:
        t = self.transfer
        return t.line() if t is not None else f"looking up {self.c.model} on the hub"

    def status(self) -> dict:
        t = self.transfer
        return {
            "state": "downloading",
            "reason": self.reason(),
            "model": self.c.model,
            "transport": self.c.transport,
            "queue_depth": 0,
            "running": 0,
            "waiting": 0,
            "download": {
                "repo": t.repo,
                "files": t.files,
                "total_bytes": t.total_bytes,
                "done_bytes": t.done_bytes,
                "elapsed_s": round(t.elapsed_s, 1),
            }
            if t is not None
            else None,
            "nodes": [
                {
                    "name": m.name,
                    "rank": m.rank,
                    "state": "waiting",  # for the model: nothing is loaded yet
                    "address": m.address,
                    "memory_bytes": m.memory_bytes,
                    "device": m.device,
                    "used_bytes": 0,
                    "budget_bytes": 0,
                    "experts": 0,
                    "last_seen_s": None,
                }
                for m in self.members
            ],
        }

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            check_key(request, self.api_key, self.c.api.metrics_auth)
            return await handler(request)
        except ApiError as exc:
            return exc.response()
        except web.HTTPException as exc:
            if exc.status == 404:  # any path of the API, before it is up
                return self._not_ready()
            raise

    def _not_ready(self) -> web.Response:
        error = ApiError(ErrorKind.NOT_READY, f"the cluster is not serving yet: {self.reason()}")
        error.retry_after_s = 10.0
        return error.response()

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response(self.status())

    async def _health(self, request: web.Request) -> web.Response:
        body = {"status": "downloading", "reason": self.reason(), "nodes": {}}
        return web.json_response(body, status=503)

    async def _experts(self, request: web.Request) -> web.Response:
        return web.json_response({"nodes": [m.name for m in self.members], "layers": []})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text="", content_type="text/plain")

    async def _dashboard(self, request: web.Request) -> web.StreamResponse:
        return dashboard_file(request)

    async def _shutdown(self, request: web.Request) -> web.Response:
        self.stop.set()
        return web.json_response({"stopping": True})

    async def start(self) -> None:
        app = web.Application(middlewares=[self._errors])
        app.add_routes(
            [
                web.get("/health", self._health),
                web.get("/metrics", self._metrics),
                web.get("/v1/cluster/status", self._status),
                web.get("/v1/cluster/experts", self._experts),
                web.get("/", self._dashboard),
                web.get("/dashboard/{name}", self._dashboard),
                web.post("/v1/cluster/shutdown", self._shutdown),
            ]
        )
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, self.c.api.host, self.c.api.port).start()
        port = self.runner.addresses[0][1]
        self.url = f"http://{self.c.api.host}:{port}"

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

"""The API's address while `up` starts: it answers from the moment the socket is bound until the API
itself takes the socket over, so a client of a coordinator that restarts (and adopts its nodes in
seconds) gets a 503 with Retry-After and the phase `up` is in, never a refused connection or a
silence. The dashboard, `/health` (503, the same line), the cluster's status (what is known yet:
the nodes once they answered, a download's progress) and the API key as the API asks it.
"""

from __future__ import annotations

import asyncio
import socket

from aiohttp import web

from ...proto.errors import ErrorKind
from .api import check_key, dashboard_file
from .api_error import ApiError
from .config import ClusterConfig
from .health import RETRY_AFTER_S

DOWNLOAD_RETRY_S = 10.0  # seconds a client is told to wait while the weights download (minutes)


class HoldingPage:
    """Serves `sock` until `close`; `say` changes what it answers (on the event loop's thread;
    `transfer`, a download's progress, is replaced whole by the hub's threads)."""

    def __init__(
        self, c: ClusterConfig, api_key: str | None, stop: asyncio.Event, sock: socket.socket
    ):
        self.c, self.api_key, self.stop, self.sock = c, api_key, stop, sock
        self.phase = "starting"  # starting | downloading | loading (adopting is loading)
        self.line = "starting"  # what `up` is doing, for people
        self.members: list = []  # serve/cluster.py Member, once the nodes answered
        self.transfer = None  # node/hub.py Transfer while a repo's weights download
        self.runner: web.AppRunner | None = None
        host, port = sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"

    def say(self, phase: str, line: str) -> None:
        self.phase, self.line = phase, line

    def reason(self) -> str:
        t = self.transfer
        if self.phase == "downloading":
            return t.line() if t is not None else f"looking up {self.c.model} on the hub"
        return self.line

    def status(self) -> dict:
        t = self.transfer
        return {
            "state": self.phase,
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
            if t is not None and self.phase == "downloading"
            else None,
            "nodes": [
                {
                    "name": m.name,
                    "rank": m.rank,
                    "state": "waiting",  # for the model: nothing is served yet
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
            if exc.status in (404, 405):  # any path of the API, before it is up
                return self._not_ready()
            raise

    def _not_ready(self) -> web.Response:
        error = ApiError(ErrorKind.NOT_READY, f"the cluster is not serving yet: {self.reason()}")
        error.retry_after_s = DOWNLOAD_RETRY_S if self.phase == "downloading" else RETRY_AFTER_S
        return error.response()

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response(self.status())

    async def _health(self, request: web.Request) -> web.Response:
        body = {"status": self.phase, "reason": self.reason(), "nodes": {}}
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
        # a duplicate of the socket: closing this page leaves `sock` listening for the API, and
        # a connection that arrives meanwhile waits in its backlog instead of being refused
        await web.SockSite(self.runner, self.sock.dup()).start()

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

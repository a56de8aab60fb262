"""A stream's keep-alives while its request waits for a recovering cluster (resume.KeepAlive), over
real HTTP on loopback: comments only while waiting, an error before any byte still an HTTP status,
one after the comments an event of the 200 stream."""

from __future__ import annotations

import asyncio

from aiohttp import ClientSession, web

from moe_cluster.coordinator.serve.requests import Outcome
from moe_cluster.coordinator.serve.resume import KEEPALIVE, KeepAlive

BEAT_S = 0.05


class Refused(Exception):
    pass


class FakeGeneration:
    """What KeepAlive drives: `start()` waits `wait_s` with outcome.waiting set (as Cluster.generate
    does while the cluster recovers), then succeeds or fails with the cluster's error."""

    def __init__(self, wait_s: float, fail: bool, waiting: bool = True):
        self.outcome = Outcome()
        self.wait_s, self.fail, self.waiting = wait_s, fail, waiting

    async def start(self) -> None:
        self.outcome.waiting = self.waiting
        await asyncio.sleep(self.wait_s)
        self.outcome.waiting = False
        if self.fail:
            self.outcome.error = Refused("cluster is degraded: node node-1 is down")
            raise Refused("503")


async def _serve(gen: FakeGeneration) -> tuple[int, bytes]:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        alive = KeepAlive(request, resp, gen.outcome, every_s=BEAT_S)
        try:
            await alive.start(gen)
        except Refused:
            return web.json_response({"error": "refused"}, status=503)
        try:
            if gen.outcome.error:
                await resp.write(f'data: {{"error": "{gen.outcome.error}"}}\n\n'.encode())
            else:
                await resp.write(b"data: token\n\n")
            await resp.write(b"data: [DONE]\n\n")
        finally:
            await alive.close()
        return resp

    app = web.Application()
    app.router.add_post("/", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        async with ClientSession() as session:
            async with session.post(f"http://127.0.0.1:{port}/") as r:
                return r.status, await r.read()
    finally:
        await runner.cleanup()


def test_a_stream_that_waits_gets_comments_then_its_tokens():
    status, body = asyncio.run(_serve(FakeGeneration(wait_s=8 * BEAT_S, fail=False)))
    assert status == 200
    assert body.count(KEEPALIVE) >= 3 and body.endswith(b"data: token\n\ndata: [DONE]\n\n"), body


def test_a_wait_that_runs_out_after_comments_ends_the_stream_with_the_error_event():
    status, body = asyncio.run(_serve(FakeGeneration(wait_s=8 * BEAT_S, fail=True)))
    assert status == 200 and body.startswith(KEEPALIVE), body
    assert body.endswith(
        b'data: {"error": "cluster is degraded: node node-1 is down"}\n\ndata: [DONE]\n\n'
    ), body


def test_an_error_before_any_comment_is_still_an_http_status():
    status, body = asyncio.run(_serve(FakeGeneration(wait_s=0.0, fail=True)))
    assert status == 503 and KEEPALIVE not in body, body


def test_no_comments_while_the_request_is_not_waiting_for_a_recovery():
    """A long prefill is not a recovery: the stream's head waits for its first token as before."""
    status, body = asyncio.run(_serve(FakeGeneration(wait_s=6 * BEAT_S, fail=False, waiting=False)))
    assert status == 200 and body == b"data: token\n\ndata: [DONE]\n\n", body

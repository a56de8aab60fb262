"""Requests that outlive a lost node: what a resumed request sends, and the stream's keep-alives.

A request's state is its token history, which the coordinator holds: the prompt, the tokens
streamed so far and its sampler (seed, and how many draws it made). Decoding is deterministic given
them, so when a node is lost the coordinator waits for the cluster to be ready again and sends the
prompt plus the streamed tokens as the prompt of a new request, with the tokens still due and the
sampler advanced past the draws already made; the client's stream goes on where it stopped
(`Cluster.generate`). While a stream waits (for a recovery, before or during its tokens) it gets
SSE comments so that clients and proxies do not time out.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace
from typing import AsyncIterator, Sequence

from aiohttp import web

from ...proto.records import GenerateRequest

# seconds: the slowest recovery measured (bench soak, a node SIGKILLed on a busy 2-vCPU machine:
# 8.7 s; 12.4 s for a stalled node at load 13) with some room
RECOVERY_WAIT_S = 15.0
MAX_RESUMES = 2  # resumes of one request; a cluster that keeps losing nodes fails it after these
KEEPALIVE_S = 1.0  # seconds between SSE comments while a stream waits
KEEPALIVE = b": keep-alive\n\n"  # an SSE comment: clients ignore it, proxies see traffic


def continuation(req: GenerateRequest, tokens: Sequence[int], attempt: int) -> GenerateRequest:
    """The request the nodes get for `attempt` (0: the first run; n: the n-th resume) once `tokens`
    were streamed: those tokens appended to the prompt (the prompt cache may hold the prefix), the
    tokens still due, and the sampler past the draws already made (one per streamed token). Each
    attempt has its own id on the nodes: the one before may still be ending there."""
    if attempt == 0:
        return req
    s = req.sampling
    if len(tokens) >= s.max_tokens:
        raise ValueError(
            f"request {req.request_id} has all its {s.max_tokens} tokens: nothing to resume"
        )
    sampling = replace(s, max_tokens=s.max_tokens - len(tokens), step=s.step + len(tokens))
    prediction = tuple(req.prediction)  # what is left of it, where the output followed it so far
    if prediction[: len(tokens)] == tuple(tokens):
        prediction = prediction[len(tokens) :]
    return replace(
        req,
        request_id=f"{req.request_id}.r{attempt}",
        prompt=(*req.prompt, *tokens),
        sampling=sampling,
        prediction=prediction,
    )


class KeepAlive:
    """SSE comments on `resp` every KEEPALIVE_S while `outcome.waiting` (the cluster recovers).

    `start(gen)` runs the generation's start (its wait for the first token); the first comment
    sends the response's head, so a request that then fails gets its error as a stream event
    (`gen.outcome.error`) rather than an HTTP status. Call `close()` when the response ends.
    """

    def __init__(self, request, resp, outcome, every_s: float = KEEPALIVE_S):
        self.request, self.resp, self.outcome, self.every_s = request, resp, outcome, every_s
        self._lock = asyncio.Lock()  # the head goes out once, before any write
        self._task: asyncio.Task | None = None

    async def start(self, gen) -> None:
        """`gen.start()`, then the response's head; errors before any byte are raised."""
        self._task = asyncio.create_task(self._beat(), name="keep-alive")
        try:
            await gen.start()
        except Exception:
            await self.close()
            if not self.resp.prepared or gen.outcome.error is None:
                raise
            return  # the head and comments went out: the stream ends with the error as an event
        except BaseException:
            await self.close()
            raise
        async with self._lock:
            await self.resp.prepare(self.request)

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            if not self.outcome.waiting:
                continue
            try:
                async with self._lock:
                    await self.resp.prepare(self.request)
                    await self.resp.write(KEEPALIVE)
            except (ConnectionError, RuntimeError):
                return  # the client left: the handler's next write says so

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


@contextlib.asynccontextmanager
async def event_stream(request: web.Request, gen) -> AsyncIterator[web.StreamResponse]:
    """The server-sent events response of generation `gen` (an API's stream writes its events to
    it): its head goes out once `gen` starts, comments while the cluster recovers (`KeepAlive`),
    and a client that leaves mid-stream stops the request."""
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    alive = KeepAlive(request, resp, gen.outcome)  # comments while the cluster recovers
    await alive.start(gen)  # errors before the first byte are still proper HTTP errors
    try:
        yield resp
    except (ConnectionResetError, asyncio.CancelledError):
        await gen.client_gone()
        raise
    finally:
        await alive.close()

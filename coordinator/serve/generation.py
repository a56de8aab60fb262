"""One request's generation as the API serves it: its tokens from the cluster made text
(detokenised, held back while a stop string may be forming, split into tool calls), its finish
reason, and its end on every node when the client goes or a stop string is reached."""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from typing import TYPE_CHECKING

from ...proto.errors import ErrorKind, MoeClusterError
from ...proto.records import GenerateRequest
from .api_error import INVALID, ApiError
from .requests import Outcome
from .tools import ToolCall, Tools, ToolSplitter

if TYPE_CHECKING:
    from .api import Api

logger = logging.getLogger(__name__)


class Generation:
    """One request's detokenisation, stop strings and bookkeeping around Cluster.generate."""

    def __init__(
        self, api: "Api", req: GenerateRequest, stops: list[str], tools: Tools | None = None
    ):
        self.api = api
        self.req = req
        self.stops = stops
        self.tools = tools
        self.parts: list[str | ToolCall] = []  # the output as text and tool calls (run)
        self.stop_hit: str | None = None  # the stop string that ended the output
        self.outcome = Outcome()
        self.text = ""
        self.finish_reason = "length"
        self.ttft: float | None = None
        self._detok = copy.copy(api.tokenizer.detokenizer)
        self._detok.reset()
        self._iter = None
        self._first = None
        self._t0 = time.perf_counter()
        self._sent = 0  # characters of text already handed out
        self._stopped = False
        self._counted = False  # in the metrics yet

    async def start(self) -> None:
        """Queue the request and wait for its first token (or its end), mapping failures to HTTP."""
        self._iter = self.api.cluster.generate(self.req, self.outcome).__aiter__()
        try:
            self._first = await self._iter.__anext__()
            self.ttft = time.perf_counter() - self._t0
        except StopAsyncIteration:
            self._first = None
            if self.outcome.error:  # failed before any token: still a proper HTTP error
                self._finish()
                raise self.failure() from None
        except MoeClusterError as exc:  # not ready, degraded, queue full: by its kind
            raise ApiError.of(exc) from None
        except asyncio.CancelledError:
            await self.client_gone()
            raise

    @property
    def reason(self) -> str:
        """The finish reason the client sees: a generation that ended after calling tools called
        them."""
        if self.finish_reason == "stop" and any(isinstance(p, ToolCall) for p in self.parts):
            return "tool_calls"
        return self.finish_reason

    async def stream_parts(self):
        """The output as it becomes final: text deltas and, where tools were offered, whole tool
        calls (each also kept in `parts`)."""
        splitter = (
            ToolSplitter(self.api.tokenizer, self.tools.rendered)
            if self.tools and self.tools.parsed
            else None
        )
        async for piece in self.pieces():
            for p in splitter.feed(piece) if splitter else [piece]:
                self.parts.append(p)
                yield p
        for p in splitter.finish() if splitter else []:
            self.parts.append(p)
            yield p

    async def pieces(self):
        """Text deltas as they become final (held back while a stop string might be forming)."""
        hold = max((len(s) for s in self.stops), default=1) - 1
        if self._first is not None:
            self._add(self._first)
            self._first = None
            piece = self._take(hold)
            if piece:
                yield piece
        if not self._stopped:
            async for token in self._iter:
                self._add(token)
                piece = self._take(hold)
                if piece:
                    yield piece
                if self._stopped:
                    break
        if self._stopped:
            await self.abort()
        else:
            self._detok.finalize()
            self.text = self._detok.text
        tail = self.text[self._sent :]
        self._sent = len(self.text)
        self._finish()
        if tail:
            yield tail

    def _add(self, token: int) -> None:
        self._detok.add_token(token)
        text = self._detok.text
        for s in self.stops:
            i = text.find(s, max(0, self._sent - len(s)))
            if i >= 0:
                self.text = text[:i]
                self.stop_hit = s
                self._stopped = True
                self.finish_reason = "stop"
                return
        self.text = text

    def _take(self, hold: int) -> str:
        end = len(self.text) - hold if self.stops and not self._stopped else len(self.text)
        if end <= self._sent:
            return ""
        piece = self.text[self._sent : end]
        self._sent = end
        return piece

    def _finish(self) -> None:
        if self._counted:
            return
        self._counted = True
        d = self.outcome.done
        if not self._stopped and self.finish_reason != "cancelled" and d is not None:
            self.finish_reason = "stop" if d.finish_reason == "stop" else "length"
        self.api.metrics.finished(self)

    def failure(self) -> ApiError:
        error = self.outcome.error
        if error.kind is ErrorKind.INVALID_INPUT:
            # The nodes refused what the coordinator let through (their own check, the second line):
            # their text names the node, its RPC status and the request, which is for the log.
            logger.warning("request %s refused by the nodes: %s", self.req.request_id, error)
            return ApiError(
                INVALID,
                "the request's parameters were refused by the cluster's nodes "
                "(the coordinator's log has their reason)",
            )
        return ApiError.of(error, "generation failed")

    async def run(self) -> tuple[str, Outcome]:
        await self.start()
        try:
            async for _ in self.stream_parts():
                pass
        except asyncio.CancelledError:
            await self.client_gone()
            raise
        if self.outcome.error:
            raise self.failure()
        return self.text, self.outcome

    async def client_gone(self) -> None:
        """The client went away (or gave up waiting): stop the request and count it as cancelled."""
        self.finish_reason = "cancelled"
        await self.abort()
        self._finish()

    async def abort(self) -> None:
        """Stop this request on every node (client gone, or a stop string reached)."""
        await self.api.cluster.cancel(self.req.request_id)
        if self._iter is not None:
            try:
                await self._iter.aclose()
            except (RuntimeError, MoeClusterError):  # already failed: reported through the outcome
                pass

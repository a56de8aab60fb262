"""The coordinator's HTTP API: the app, its routes and middlewares, and the runner whose connections
answer aiohttp's own errors in the API's shape.

Built on aiohttp. Errors use OpenAI's JSON shape (Anthropic's on /v1/messages), aiohttp's own parser
errors included. Requests run together in the nodes' batch, the rest wait in arrival order (the queue
depth is in /metrics and /v1/cluster/status); a client that goes away cancels its generation on every
node. The OpenAI requests are read in openai.py and answered in responses.py, Anthropic's in
anthropic.py; text becomes token ids in prompts.py; one request's generation is generation.py's.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError, HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

from ...common.worker import Worker
from ...proto.errors import ErrorKind, MoeClusterError, UserError, kind_from_http
from ...proto.records import GenerateRequest, Sampling, check_token_ids
from . import anthropic, openai, responses
from .api_error import INTERNAL_MESSAGE, INVALID, ApiError
from .cluster import Cluster
from .generation import Generation
from .json_body import parse_json
from .metrics import Metrics
from .prompts import Prompts
from .resume import event_stream
from .tools import FieldError, Tools, show

logger = logging.getLogger(__name__)


ANTHROPIC_PATHS = ("/v1/messages",)
DASHBOARD = (
    Path(__file__).resolve().parent / "dashboard"
)  # static files: no build step, nothing from outside
# The dashboard loads nothing but the coordinator's own files and data (it must work with no internet).
_DASHBOARD_HEADERS = {
    "Cache-Control": "no-cache",
    "Content-Security-Policy": "default-src 'self'; style-src 'self'; script-src 'self'",
}
MAX_BODY = 16 * 2**20  # bytes: cluster.yaml's api.max_body unless it says


@dataclass
class ServingOptions:
    model_id: str
    context_length: int
    default_max_tokens: int = 256
    api_key: str | None = field(default=None, repr=False)
    on_shutdown: Callable[[], None] | None = None
    vocab_size: int = (
        0  # rows of the model's token embedding: prompt ids must be below it (0: unchecked)
    )
    max_body: int = MAX_BODY  # bytes; larger bodies get 413
    metrics_auth: bool = False  # /metrics needs the API key too
    speculative: str = "off"  # serving.speculative: whether a request may ask for drafts
    draft_tokens: int = 4  # serving.draft_tokens: the most a request may ask for


def dashboard_file(request: web.Request) -> web.StreamResponse:
    """The dashboard's static files (its data comes from /v1/cluster/* and /metrics, with the key)."""
    name = request.match_info.get("name", "index.html")
    path = DASHBOARD / name
    if "/" in name or name.startswith(".") or not path.is_file():
        raise ApiError(ErrorKind.NOT_FOUND, f"no dashboard file {show(name)}")
    return web.FileResponse(path, headers=_DASHBOARD_HEADERS)


def check_key(request: web.Request, key: str | None, metrics_auth: bool) -> None:
    """Refuse a request without the API key, where the cluster has one: every /v1/ path, and
    /metrics with api.metrics_auth (the dashboard's files and /health are open)."""
    if key and (request.path.startswith("/v1/") or (metrics_auth and request.path == "/metrics")):
        given = request.headers.get("Authorization", "")
        # Anthropic's clients send the key as x-api-key, OpenAI's as a bearer token: either, anywhere
        token = (
            given[7:]
            if given.lower().startswith("bearer ")
            else request.headers.get("x-api-key", "")
        )
        if not token or not hmac.compare_digest(token.encode(), key.encode()):
            raise ApiError(
                ErrorKind.UNAUTHENTICATED,
                "missing or wrong API key (send 'x-api-key: <key>' or "
                "'Authorization: Bearer <key>')",
            )


# -- the connection: aiohttp's own errors in the API's shape ---------------------------------------

# Content-Encoding values a body may come in (aiohttp decodes gzip and deflate as it reads)
BODY_ENCODINGS = ("", "identity", "gzip", "deflate")
_REQUEST_LINE = re.compile(
    rb"(?:GET|POST|PUT|DELETE|PATCH|HEAD|OPTIONS) (/[!-~]*) HTTP/1\.[01]\r?\n"
)
# the start of a request line, finished or not: its target's first bytes tell an over-long URL (414)
# from an over-long header (431), which aiohttp's parser reports alike (LineTooLong, 400)
_LINE_START = re.compile(rb"(?:^|\n)(?:GET|POST|PUT|DELETE|PATCH|HEAD|OPTIONS) ([!-~]{1,32})")


def _unsupported_encoding(encoding: str | None = None) -> ApiError:
    what = (
        f"Content-Encoding {show(encoding)} is"
        if encoding is not None
        else "the body's Content-Encoding is"
    )
    error = ApiError(
        INVALID,
        f"{what} not supported: send the body as is, or compressed with gzip or deflate",
        code="unsupported_media_type",
    )
    error.status = 415
    return error


class _Connection(RequestHandler):
    """aiohttp's handler of one connection, answering its parser's own errors (a malformed header, a
    bad Content-Length or chunk size, an encoding it cannot decode) as JSON in the shape of the route
    the request line named; they never reach the app's middlewares."""

    _path = b""  # the path of the last request line seen on this connection
    _target = b""  # the first bytes of the target of the last request line begun on it

    def data_received(self, data: bytes) -> None:
        found = started = None
        for found in _REQUEST_LINE.finditer(data[:65536]):
            pass
        if found is not None:
            self._path = found.group(1)
        for started in _LINE_START.finditer(data[:65536]):
            pass
        if started is not None:
            self._target = started.group(1)
        super().data_received(data)

    def _too_long(self, exc: LineTooLong) -> ApiError:
        """414 for a request line past aiohttp's limit, 431 for a header field past it: the
        offending bytes it quotes start with the target (or the request line) or not."""
        line, limit = exc.args[:2]  # LineTooLong(line, limit, actual_size)
        line = bytes(line) if isinstance(line, (bytes, bytearray)) else str(line).encode()
        url = bool(self._target) and (
            line.startswith(self._target) or line.partition(b" ")[2].startswith(self._target)
        )
        error = ApiError(
            INVALID,
            f"the request's URL is longer than {limit} bytes"
            if url
            else f"a header field of the request is longer than {limit} bytes",
            code="uri_too_long" if url else "request_header_fields_too_large",
        )
        error.status = 414 if url else 431
        return error

    def handle_error(
        self,
        request,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        plain = super().handle_error(request, status, exc, message)  # logs it; raises when too late
        if isinstance(exc, ContentEncodingError):  # br or zstd, which aiohttp cannot decode here
            error = _unsupported_encoding()
        elif isinstance(exc, LineTooLong):
            error = self._too_long(exc)
        elif status >= 500:
            error = ApiError(ErrorKind.INTERNAL, INTERNAL_MESSAGE)
        else:
            error = ApiError(
                kind_from_http(status), f"malformed HTTP request: {message or plain.reason}"
            )
            error.status = status
        resp = error.response(self._path.decode("ascii").startswith(ANTHROPIC_PATHS))
        resp.force_close()
        return resp


class _Server(web.Server):
    def __call__(self) -> RequestHandler:
        return _Connection(self, loop=self._loop, **self._kwargs)


class ApiRunner(web.AppRunner):
    """web.AppRunner whose connections answer aiohttp's own errors in the API's shape (_Connection)."""

    async def _make_server(self) -> web.Server:
        s = await super()._make_server()
        return _Server(
            s.request_handler,
            request_factory=s.request_factory,
            handler_cancellation=s.handler_cancellation,
            loop=s._loop,
            **s._kwargs,
        )


# -- the app ---------------------------------------------------------------------------------


class Api:
    def __init__(
        self, cluster: Cluster, tokenizer, options: ServingOptions, metrics: Metrics | None = None
    ):
        self.cluster = cluster
        self.tokenizer = tokenizer
        self.options = options
        self.metrics = metrics or Metrics()
        self.created = int(time.time())
        self.worker: Worker | None = None  # started with the app, closed with it
        self.prompts = Prompts(tokenizer, options.context_length)  # used on the worker only

    def app(self) -> web.Application:
        app = web.Application(
            middlewares=[self._errors, self._auth], client_max_size=self.options.max_body
        )
        app.cleanup_ctx.append(self._worker_ctx)
        app.add_routes(
            [
                web.get("/health", self.health),
                web.get("/metrics", self.prometheus),
                web.get("/v1/models", self.models),
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat_completions),
                web.post("/v1/messages", self.messages),
                web.get("/v1/cluster/status", self.status),
                web.get("/v1/cluster/experts", self.experts),
                web.get("/", self.dashboard),
                web.get("/dashboard/{name}", self.dashboard),
                web.post("/v1/cluster/shutdown", self.shutdown),
            ]
        )
        return app

    async def _worker_ctx(self, app: web.Application):
        self.worker = Worker("api-worker")
        try:
            yield
        finally:
            self.worker.close()

    async def _json_body(self, request: web.Request) -> dict:
        """The body as a JSON object. Its chunks go to the worker as they came: joining 13 MB here
        would hold the event loop for ~10 ms."""
        limit, chunks, size = self.options.max_body, [], 0
        encoding = request.headers.get("Content-Encoding", "").strip().lower()
        if encoding not in BODY_ENCODINGS:
            raise _unsupported_encoding(encoding)
        # a compressed body's length says nothing of its size: the limit holds for what it decodes to
        # (aiohttp decodes it in bounded pieces as it is read: a zip bomb stops at the limit)
        compressed = encoding in ("gzip", "deflate")
        if not compressed and (request.content_length or 0) > limit:
            size = request.content_length
        else:
            try:
                async for chunk in request.content.iter_any():
                    size += len(chunk)
                    if size > limit:
                        break
                    chunks.append(chunk)
            except (RequestPayloadError, HttpProcessingError) as exc:
                what = f"is not valid {encoding} data" if compressed else "could not be read"
                raise ApiError(INVALID, f"request body {what} ({exc})") from None
        if size > limit:
            error = ApiError(
                INVALID,
                f"request body is larger than the limit of {limit} bytes "
                "(cluster.yaml api.max_body)",
                code="request_too_large",
            )
            error.status = 413
            raise error
        return await self.worker.call(lambda: parse_json(chunks or [b""]))

    def _check_ids(self, ids: list, param: str) -> None:
        try:  # with no vocabulary known, at least what the wire's uint32 can carry
            check_token_ids(ids, self.options.vocab_size or 2**32, param)
        except UserError as exc:
            raise ApiError(INVALID, str(exc), param=param) from None

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        shape = request.path.startswith(
            ANTHROPIC_PATHS
        )  # errors in Anthropic's shape there, OpenAI's elsewhere
        try:
            return await handler(request)
        except ApiError as exc:
            return exc.response(shape)
        except FieldError as exc:
            return ApiError(INVALID, str(exc), param=exc.param).response(shape)
        except web.HTTPException as exc:
            if exc.status >= 400:
                error = ApiError(kind_from_http(exc.status), exc.reason or "error")
                error.status = exc.status  # e.g. 405: aiohttp's own status, our shape
                return error.response(shape)
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as exc:  # noqa: BLE001 - typed errors by their kind; anything else is a bug, logged
            return ApiError.of(exc, f"{request.method} {request.path}").response(shape)

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        check_key(request, self.options.api_key, self.options.metrics_auth)
        return await handler(request)

    # -- simple endpoints ----------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        s = self.cluster.status()
        body = {
            "status": s["state"],
            "reason": s["reason"],
            "nodes": {n["name"]: n["state"] for n in s["nodes"]},
        }
        return web.json_response(body, status=200 if s["state"] == "ready" else 503)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.options.model_id,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "moe-cluster",
                    }
                ],
            }
        )

    async def status(self, request: web.Request) -> web.Response:
        # requests that ended well (not failed, not cancelled), as /metrics counts them
        return web.json_response(
            {
                **self.cluster.status(),
                "requests_completed": self.metrics.requests["ok"],
                "speculative": self.metrics.speculation(),
            }
        )

    async def experts(self, request: web.Request) -> web.Response:
        """Layers x experts: the router's selections and which nodes hold each (the dashboard's heat map)."""
        return web.json_response(self.cluster.experts())

    async def dashboard(self, request: web.Request) -> web.StreamResponse:
        return dashboard_file(request)

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(
            text=self.metrics.render(self.cluster), content_type="text/plain", charset="utf-8"
        )

    async def shutdown(self, request: web.Request) -> web.Response:
        if self.options.on_shutdown is not None:
            asyncio.get_running_loop().call_later(0.1, self.options.on_shutdown)
        return web.json_response({"ok": True, "message": "shutting down"})

    # -- generation ----------------------------------------------------------------------------

    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise ApiError(INVALID, "'model' must be a string", param="model")
        if model and model != self.options.model_id:
            raise ApiError(
                ErrorKind.NOT_FOUND,
                f"The model {show(model)} does not exist (this cluster serves "
                f"{self.options.model_id!r})",
                param="model",
                code="model_not_found",
            )

    def _check_context(self, prompt_ids: list[int], sampling: Sampling, chat: bool) -> None:
        ctx = self.options.context_length
        if len(prompt_ids) + sampling.max_tokens > ctx:
            raise ApiError(
                INVALID,
                f"This model's maximum context length is {ctx} tokens. However, you requested "
                f"{len(prompt_ids) + sampling.max_tokens} tokens ({len(prompt_ids)} in the "
                f"prompt, {sampling.max_tokens} for the completion).",
                param="max_tokens" if len(prompt_ids) < ctx else ("messages" if chat else "prompt"),
                code="context_length_exceeded",
            )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._json_body(request)
        self._check_model(body)
        req = await self.worker.call(lambda: openai.parse_completion(body, self.options))
        if isinstance(req.prompt, list):
            # the length first: it costs nothing, while a pass over 4 million ids stalls the loop 0.3 s
            self._check_context(req.prompt, req.sampling, chat=False)
            self._check_ids(
                req.prompt, "prompt"
            )  # names the first id that is not an int in [0, vocab)
            ids, stop_ids, predicted = await self._tokens(lambda: list(req.prompt), req)
        else:
            ids, stop_ids, predicted = await self._tokens(
                lambda: self.prompts.encode(req.prompt), req
            )
        if not req.echo:
            echoed = ""
        elif isinstance(req.prompt, str):
            echoed = req.prompt
        else:
            echoed = await self.worker.call(lambda: self.tokenizer.decode(ids))
        gen = self._generation(
            ids, req.sampling, req.stops, stop_ids, chat=False, speculation=(req, predicted)
        )
        return await self._serve(request, gen, req, chat=False, echo=echoed)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._json_body(request)
        self._check_model(body)
        req = await self.worker.call(lambda: openai.parse_chat(body, self.options))
        rendered = req.tools.rendered if req.tools else None
        ids, stop_ids, predicted = await self._tokens(
            lambda: self.prompts.render(list(req.messages), rendered, prefill=req.prefill), req
        )
        gen = self._generation(
            ids, req.sampling, req.stops, stop_ids, True, req.tools, speculation=(req, predicted)
        )
        return await self._serve(request, gen, req, chat=True)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """Anthropic's Messages API: the same rendering, generation and tool parsing as chat."""
        body = await self._json_body(request)
        self._check_model(body)
        vocab = self.options.vocab_size
        # a big body takes seconds to check
        req = await self.worker.call(lambda: anthropic.parse_request(body, vocab))
        rendered = req.tools.rendered if req.tools else None
        ids, stop_ids, _ = await self._tokens(
            lambda: self.prompts.render(req.messages, rendered, req.fields, req.prefill), req
        )
        gen = self._generation(
            ids, req.sampling, req.stops, stop_ids, True, req.tools, prefix="msg_"
        )
        model = self.options.model_id
        if not req.stream:
            _, outcome = await gen.run()
            return web.json_response(
                anthropic.message(
                    gen.req.request_id,
                    model,
                    gen.parts,
                    gen.reason,
                    gen.stop_hit,
                    (len(ids), len(outcome.tokens)),
                )
            )
        events = anthropic.EventStream(gen.req.request_id, model, len(ids))
        async with event_stream(request, gen) as resp:
            await resp.write(events.start())
            async for part in gen.stream_parts():
                await resp.write(events.part(part))
            if gen.outcome.error:
                e = gen.failure()
                await resp.write(events.error(e.status, e.message))
            else:
                await resp.write(events.end(gen.reason, gen.stop_hit, len(gen.outcome.tokens)))
        return resp

    async def _tokens(self, prompt: Callable[[], list[int]], req) -> tuple:
        """(prompt ids, each stop string's ids, the prediction's ids) of a request, made in one job
        on the worker: tokenizing holds the GIL, and a long text takes seconds."""

        def job() -> tuple:
            ids = prompt()
            return (
                ids,
                self.prompts.stop_ids(req.stops),
                self.prompts.prediction(getattr(req, "prediction", "")),
            )

        return await self.worker.call(job)

    def _generation(
        self,
        ids: list[int],
        sampling: Sampling,
        stops: tuple[str, ...],
        stop_ids: tuple[tuple[int, ...], ...],
        chat: bool,
        tools: Tools | None = None,
        prefix: str = "",
        speculation: tuple[openai.Request | None, tuple[int, ...]] = (None, ()),
    ) -> Generation:
        """A request checked against the context, the vocabulary and the cluster's state.
        `speculation`: the OpenAI request (its drafts per step) and its prediction's token ids."""
        self._check_context(ids, sampling, chat)
        self._check_ids(
            ids, "messages" if chat else "prompt"
        )  # a tokenizer larger than the embedding
        try:
            self.cluster.check_ready()
        except MoeClusterError as exc:
            raise ApiError.of(exc) from None
        rid = f"{prefix or ('chatcmpl-' if chat else 'cmpl-')}{uuid.uuid4().hex[:24]}"
        eos = tuple(self.tokenizer.eos_token_ids)
        asked, prediction = speculation
        req = GenerateRequest(
            rid,
            tuple(ids),
            sampling,
            eos,
            draft_tokens=asked.draft_tokens if asked is not None else None,
            prediction=prediction,
            stop_sequences=stop_ids,
        )
        return Generation(self, req, list(stops), tools)

    async def _serve(
        self, request: web.Request, gen: Generation, req: openai.Request, chat: bool, echo: str = ""
    ) -> web.StreamResponse:
        """An OpenAI answer, streamed or whole. `echo`: text put before a completion's own (the
        prompt, where the request asked for it)."""
        if req.stream:
            return await responses.stream(
                request, gen, chat, self.options.model_id, echo, req.include_usage
            )
        text, outcome = await gen.run()
        return web.json_response(
            responses.final(gen, echo + text, outcome, chat, self.options.model_id)
        )

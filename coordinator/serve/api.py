"""The coordinator's HTTP API: OpenAI-compatible completions and chat, health, metrics, cluster control.

Built on aiohttp. Errors use OpenAI's JSON shape (Anthropic's on /v1/messages), aiohttp's own parser
errors included. Requests run together in the nodes' batch, the rest wait in arrival order (the queue
depth is in /metrics and /v1/cluster/status); a client that goes away cancels its generation on every
node.
"""

from __future__ import annotations

import asyncio
import codecs
import copy
import hmac
import json
import json.scanner
import logging
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError, HttpProcessingError
from aiohttp.web_protocol import RequestHandler, RequestPayloadError

from ...proto.records import GenerateRequest, Sampling, check_token_ids
from ...proto.errors import KINDS, ErrorKind, MoeClusterError, UserError, kind_from_http
from .cluster import Cluster, Outcome
from .metrics import Metrics, prompt_tps
from .resume import KeepAlive
from .sampling import OPENAI_TEMPERATURE, json_kind, parse as sampling_of
from . import anthropic
from .tools import FieldError, ToolCall, Tools, ToolSplitter, history_tool_calls, parse_tools
from ...common.worker import Worker

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
INVALID = ErrorKind.INVALID_INPUT  # 400, naming the field in `param`
INTERNAL_MESSAGE = "internal error in the cluster (the coordinator's log has the details)"
MAX_BODY = 16 * 2**20  # bytes: cluster.yaml's api.max_body unless it says
# Bodies above this many bytes are read, decoded and parsed in pieces on the API's worker, so that no
# step holds the GIL for more than a millisecond or so and the event loop gets it every switch interval
# (5 ms). Done whole, 13 MB hold it for 60 ms on this VM (decode 9 ms, json's C string scanner 35 ms,
# the body's copy 9 ms), twice that under load. Small bodies take the C parser whole (under 2 ms).
BIG_BODY = 256 * 2**10
# A prefix cut inside a word may take a few more tokens than the same text whole: a prefix is only
# called too long past this many tokens over the context.
_CUT_MARGIN = 64
# Texts up to this many characters are tokenized in full (ids handed to Python in ~40 ms at most),
# so a too-long prompt's error gives its exact count; longer ones are counted short first.
_COUNT_FROM = 2**20
_PIECE = 2**16  # characters (or bytes) per step of a big body: ~0.1 ms each
_PLAIN = re.compile(r'[^"\\\x00-\x1f]*')  # a JSON string's characters that need no escape
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def _scanstring_in_pieces(s: str, end: int, strict: bool = True) -> tuple[str, int]:
    """json.decoder's scanstring (same result, same errors) that matches runs of plain characters at
    most _PIECE at a time: the C scanner holds the GIL through a whole 13 MB string (35 ms)."""
    begin, parts = end - 1, []
    while True:
        run = _PLAIN.match(s, end, end + _PIECE)
        parts.append(run.group())
        end = run.end()
        if end >= len(s):
            raise json.JSONDecodeError("Unterminated string starting at", s, begin)
        c = s[end]
        if c == '"':
            return "".join(parts), end + 1
        if c == "\\":
            if end + 1 == len(s):
                raise json.JSONDecodeError("Unterminated string starting at", s, begin)
            char, end = _escape(s, end + 1)
            parts.append(char)
        elif c < " ":  # a control character; otherwise the run stopped at _PIECE
            if strict:
                raise json.JSONDecodeError(f"Invalid control character {c!r} at", s, end)
            parts.append(c)
            end += 1


def _escape(s: str, at: int) -> tuple[str, int]:
    """The character of the escape whose letter is s[at], and where the string goes on, as
    json.decoder.py_scanstring reads it (a surrogate pair is two \\uXXXX escapes)."""
    letter = s[at]
    if letter != "u":
        if letter not in _ESCAPES:
            raise json.JSONDecodeError(f"Invalid \\escape: {letter!r}", s, at)
        return _ESCAPES[letter], at + 1
    uni = _hex4(s, at)
    if 0xD800 <= uni <= 0xDBFF and s[at + 5 : at + 7] == "\\u":
        low = _hex4(s, at + 6)
        if 0xDC00 <= low <= 0xDFFF:
            return chr(0x10000 + (((uni - 0xD800) << 10) | (low - 0xDC00))), at + 11
    return chr(uni), at + 5


def _hex4(s: str, at: int) -> int:
    digits = s[at + 1 : at + 5]
    if len(digits) == 4 and digits[1] not in "xX":
        try:
            return int(digits, 16)
        except ValueError:
            pass
    raise json.JSONDecodeError("Invalid \\uXXXX escape", s, at)


_FAST_JSON = json.JSONDecoder()
_SLOW_JSON = json.JSONDecoder()
_SLOW_JSON.parse_string = _scanstring_in_pieces
_SLOW_JSON.scan_once = json.scanner.py_make_scanner(
    _SLOW_JSON
)  # used only on the API's worker thread


def dashboard_file(request: web.Request) -> web.StreamResponse:
    """The dashboard's static files (its data comes from /v1/cluster/* and /metrics, with the key)."""
    name = request.match_info.get("name", "index.html")
    path = DASHBOARD / name
    if "/" in name or name.startswith(".") or not path.is_file():
        raise ApiError(ErrorKind.NOT_FOUND, f"no dashboard file {name!r}")
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


class ApiError(Exception):
    """An HTTP error in OpenAI's shape; the status, type and default code come from the kind (proto.errors.KINDS)."""

    def __init__(
        self, kind: ErrorKind, message: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        m = KINDS[kind]
        self.kind, self.status, self.message, self.type, self.param = (
            kind,
            m.http,
            message,
            m.type,
            param,
        )
        self.code = code or m.code
        self.retry_after_s: float | None = (
            None  # sent as Retry-After (a 503 of a lost node, of recovery)
        )

    @classmethod
    def of(cls, exc: BaseException, what: str = "") -> "ApiError":
        """A typed error as HTTP by its kind; a bug's text goes to the log only, never to the client."""
        kind = exc.kind if isinstance(exc, MoeClusterError) else ErrorKind.INTERNAL
        if kind is ErrorKind.INTERNAL:
            logger.error(
                "%sinternal error: %s: %s",
                f"{what}: " if what else "",
                type(exc).__name__,
                exc,
                exc_info=not isinstance(exc, MoeClusterError),
            )
            return cls(kind, f"{what}: {INTERNAL_MESSAGE}" if what else INTERNAL_MESSAGE)
        error = cls(kind, f"{what}: {exc}" if what else str(exc))
        error.retry_after_s = exc.retry_after_s
        return error

    def response(self, anthropic_shape: bool = False) -> web.Response:
        if anthropic_shape:
            body = anthropic.error_body(self.status, self.message)
        else:
            body = {
                "error": {
                    "message": self.message,
                    "type": self.type,
                    "param": self.param,
                    "code": self.code,
                }
            }
        headers = (
            {"Retry-After": str(math.ceil(self.retry_after_s))} if self.retry_after_s else None
        )
        return web.json_response(body, status=self.status, headers=headers)


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


# -- request parsing -------------------------------------------------------------------------


def _show(value: Any, limit: int = 60) -> str:
    """A value for an error message, cut short: the client sent it and may have sent megabytes."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _field(
    body: dict, name: str, types: tuple, default: Any = None, *, check=None, what: str = ""
) -> Any:
    if name not in body or body[name] is None:
        return default
    value = body[name]
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        raise ApiError(
            INVALID,
            f"'{name}' must be {what or ' or '.join(t.__name__ for t in types)} "
            f"(got {_show(value)})",
            param=name,
        )
    if check is not None and not check(value):
        raise ApiError(
            INVALID, f"'{name}' is out of range ({_show(value)}): must be {what}", param=name
        )
    return value


def parse_sampling(body: dict, default_max_tokens: int) -> tuple[Sampling, list[str], bool]:
    max_tokens = _field(
        body,
        "max_tokens",
        (int,),
        default_max_tokens,
        check=lambda v: v >= 1,
        what="an integer >= 1",
    )
    max_tokens = _field(
        body,
        "max_completion_tokens",
        (int,),
        max_tokens,
        check=lambda v: v >= 1,
        what="an integer >= 1",
    )
    sampling = sampling_of(body, max_tokens, OPENAI_TEMPERATURE)
    stop = body.get("stop")
    if stop is None:
        stops = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        stops = list(stop)
    else:
        raise ApiError(
            INVALID,
            f"'stop' must be a string or a list of up to 4 strings (got {_show(stop)})",
            param="stop",
        )
    stops = [s for s in stops if s]
    stream = _field(body, "stream", (bool,), False, what="a boolean")
    n = _field(body, "n", (int,), 1, check=lambda v: v == 1, what="1 (one choice per request)")
    del n
    return sampling, stops, stream


def speculation_figures(counters: dict, generated: int) -> dict:
    """A request's speculation as the client sees it: drafts verified and accepted, and the
    all-reduces its decoding paid per generated token (one per MoE layer per step)."""
    steps, layers = counters.get("decode_steps", 0.0), counters.get("moe_layers", 0.0)
    return {
        "drafted": int(counters.get("drafted", 0)),
        "accepted": int(counters.get("accepted", 0)),
        "decode_steps": int(steps),
        "allreduces_per_token": round(steps * layers / generated, 3) if generated else 0.0,
    }


def parse_speculation(body: dict, options: "ServingOptions") -> tuple[int | None, str | None]:
    """(drafts per step, predicted text) a request asks for: `draft_tokens` (this server's
    extension; 0 turns speculation off for the request) and OpenAI's `prediction` ({"type":
    "content", "content": text or text parts}), whose tokens the nodes draft from. A prediction
    only changes speed, never the output: it is taken whether or not the cluster speculates."""
    drafts = body.get("draft_tokens")
    if drafts is not None:
        limit = options.draft_tokens if options.speculative != "off" else 0
        if options.speculative == "off" and drafts != 0:
            raise ApiError(
                INVALID,
                "'draft_tokens' needs speculative decoding, which is off on this cluster "
                "(serving.speculative in cluster.yaml)",
                param="draft_tokens",
            )
        drafts = _field(
            body,
            "draft_tokens",
            (int,),
            None,
            check=lambda v: 0 <= v <= limit,
            what=f"an integer in [0, {limit}] (serving.draft_tokens)",
        )
    prediction = body.get("prediction")
    if prediction is None:
        return drafts, None
    if not (
        isinstance(prediction, dict)
        and prediction.get("type") == "content"
        and "content" in prediction
    ):
        raise ApiError(
            INVALID,
            "'prediction' must be {'type': 'content', 'content': <text>} "
            f"(got {_show(prediction)})",
            param="prediction",
        )
    text = text_content(prediction["content"], "prediction.content")
    _check_text(text, "prediction.content")
    return drafts, text


def _check_text(text: str, param: str) -> None:
    """JSON may carry lone surrogates ("\\ud800"), which no tokenizer takes (a TypeError deep inside)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(
            INVALID,
            f"'{param}' is not valid Unicode text: a lone surrogate at character {exc.start}",
            param=param,
        ) from None


def text_content(content: Any, param: str) -> str:
    """A message's content: a string, or text parts [{"type": "text", "text": ...}] (this model reads text only)."""
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not (
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                raise ApiError(
                    INVALID,
                    f"{param}[{j}] must be {{'type': 'text', 'text': <string>}} (got {_show(part)})",
                    param=param,
                )
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise ApiError(INVALID, f"{param} must be a string (got {_show(content)})", param=param)
    return content


def chat_message(m: Any, i: int) -> dict:
    """messages[i] of a chat request as the template reads it: role, text content, and an assistant's
    tool calls or a tool result's call id."""
    if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
        got = _show(m.get("role")) if isinstance(m, dict) else json_kind(m)
        raise ApiError(
            INVALID,
            f"messages[{i}] must have a role of system, user, assistant or tool (got {got})",
            param=f"messages[{i}].role",
        )
    content = m.get("content")
    calls = m.get("tool_calls") if m["role"] == "assistant" else None
    if content is None and calls:  # an assistant turn that only called tools
        content = ""
    out = {"role": m["role"], "content": text_content(content, f"messages[{i}].content")}
    if calls is not None:
        out["tool_calls"] = history_tool_calls(calls, f"messages[{i}].tool_calls")
    if m["role"] == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise ApiError(
                INVALID,
                f"messages[{i}].tool_call_id must be the id of the call this answers "
                f"(got {_show(call_id)})",
                param=f"messages[{i}].tool_call_id",
            )
        out["tool_call_id"] = call_id
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
    return out


def check_unsupported(body: dict) -> None:
    """Options this server cannot honour are refused, not silently ignored: the nodes send token ids
    only (no log-probabilities), and nothing constrains decoding to JSON."""
    if _field(body, "logprobs", (bool,), False, what="a boolean"):
        raise ApiError(INVALID, "'logprobs' is not supported by this server", param="logprobs")
    if _field(
        body, "top_logprobs", (int,), 0, check=lambda v: 0 <= v <= 20, what="an integer in [0, 20]"
    ):
        raise ApiError(
            INVALID, "'top_logprobs' is not supported by this server", param="top_logprobs"
        )
    fmt = body.get("response_format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is not None and kind != "text":
        what = (
            f"{kind!r} is not supported by this server (only 'text')"
            if isinstance(kind, str)
            else f"must be {{'type': 'text'}} (got {_show(fmt)})"
        )
        raise ApiError(INVALID, f"'response_format' {what}", param="response_format")


def check_unsupported_completion(body: dict) -> bool:
    """/v1/completions' options: those it cannot honour are refused, as chat refuses its own (no
    log-probabilities, one choice, no text after the insertion point); returns `echo`."""
    best_of, suffix = body.get("best_of"), body.get("suffix")
    refused = {
        "logprobs": body.get("logprobs") is not None,
        "best_of": best_of is not None and (isinstance(best_of, bool) or best_of != 1),
        "suffix": suffix is not None and suffix != "",
    }
    for name, bad in refused.items():
        if bad:
            raise ApiError(
                INVALID,
                f"'{name}' is not supported by this server (got {_show(body[name])})",
                param=name,
            )
    if body.get("response_format") is not None:
        check_unsupported({"response_format": body["response_format"]})
    return _field(body, "echo", (bool,), False, what="a boolean")


def call_json(call: ToolCall, index: int | None = None) -> dict:
    """A tool call in OpenAI's shape (with its index, in a stream)."""
    out = {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    return out if index is None else {"index": index, **out}


def parse_json(raw: bytes | list[bytes]) -> dict:
    """A request body (whole, or the chunks it arrived in) as a JSON object (UTF-8, -16 or -32, as
    json.loads reads bytes); runs on the API's worker. Whatever the content type says: clients such
    as curl -d send JSON as a form. A big body is decoded and parsed in pieces (see BIG_BODY)."""
    chunks = [raw] if isinstance(raw, bytes) else raw
    try:
        if sum(len(c) for c in chunks) <= BIG_BODY:
            whole = b"".join(chunks)
            body = _FAST_JSON.decode(whole.decode(json.detect_encoding(whole)))
        else:
            body = _SLOW_JSON.decode(_decode_in_pieces(chunks))
    except (
        ValueError,
        RecursionError,
    ) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        where = (
            f" (line {exc.lineno}, column {exc.colno}: {exc.msg})"
            if isinstance(exc, json.JSONDecodeError)
            else ""
        )
        raise ApiError(INVALID, f"request body is not valid JSON{where}") from None
    if not isinstance(body, dict):
        raise ApiError(INVALID, f"request body must be a JSON object (got {json_kind(body)})")
    return body


def _decode_in_pieces(chunks: list[bytes]) -> str:
    """The text of a body's chunks, decoded at most _PIECE bytes at a time."""
    head = b"".join(chunks)[:4] if len(chunks[0]) < 4 else chunks[0]
    decoder = codecs.getincrementaldecoder(json.detect_encoding(head))()
    texts = [
        decoder.decode(view[i : i + _PIECE])
        for view in map(memoryview, chunks)
        for i in range(0, len(view), _PIECE)
    ]
    texts.append(decoder.decode(b"", final=True))
    return "".join(texts)


# -- the connection: aiohttp's own errors in the API's shape ---------------------------------------

# Content-Encoding values a body may come in (aiohttp decodes gzip and deflate as it reads)
BODY_ENCODINGS = ("", "identity", "gzip", "deflate")
_REQUEST_LINE = re.compile(
    rb"(?:GET|POST|PUT|DELETE|PATCH|HEAD|OPTIONS) (/[!-~]*) HTTP/1\.[01]\r?\n"
)


def _unsupported_encoding(encoding: str | None = None) -> ApiError:
    what = (
        f"Content-Encoding {encoding!r} is"
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

    def data_received(self, data: bytes) -> None:
        found = None
        for found in _REQUEST_LINE.finditer(data[:65536]):
            pass
        if found is not None:
            self._path = found.group(1)
        super().data_received(data)

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
        self._count_tok = None  # the worker's own tokenizer for counting (see _counter)

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

    def _counter(self):
        """The fast tokenizer's Rust core, copied for the worker's counting (None: not a fast one)."""
        if self._count_tok is None:
            backend = getattr(
                getattr(self.tokenizer, "_tokenizer", None), "backend_tokenizer", None
            )
            if backend is None:
                self._count_tok = False  # every prompt is tokenized in full
            else:
                from tokenizers import Tokenizer

                self._count_tok = Tokenizer.from_str(backend.to_str())
                self._count_tok.no_padding()
                self._count_tok.no_truncation()
        return self._count_tok or None

    def _refuse_too_long(self, texts: list[str], param: str) -> None:
        """Refuse texts that cannot fit before tokenizing them in full. Tokenizing releases the GIL,
        but handing millions of ids to Python, and freeing them, holds it: 0.13 s per 3 MB of text
        (measured), 0.4 s for 13 MB, all of it a stall of the event loop. So prefixes are counted,
        doubling from `context` characters, until one is over the context or the text is done: no
        step hands Python more than a few times the context in ids."""
        ctx = self.options.context_length
        if sum(len(t) for t in texts) <= max(ctx, _COUNT_FROM) or self._counter() is None:
            return  # tokenized in full (the error gives the exact count), or no way to count short
        n = 0
        for text in texts:
            size = ctx
            while True:  # encode_batch releases the GIL while it works; encode holds it
                got = len(
                    self._counter().encode_batch([text[:size]], add_special_tokens=False)[0].ids
                )
                if n + got > ctx + _CUT_MARGIN or size >= len(text):
                    break
                size *= 2
            n += got
            if n > ctx + _CUT_MARGIN:
                raise ApiError(
                    INVALID,
                    f"This model's maximum context length is {ctx} tokens. However, your "
                    f"{param} alone is more than {ctx} tokens.",
                    param=param,
                    code="context_length_exceeded",
                )

    def _encode(self, prompt: str) -> list[int]:
        """Token ids of a text prompt (on the worker: a long prompt takes seconds)."""
        _check_text(prompt, "prompt")
        self._refuse_too_long([prompt], "prompt")
        tok = self.tokenizer
        return list(
            tok.encode(
                prompt,
                add_special_tokens=tok.bos_token is None or not prompt.startswith(tok.bos_token),
            )
        )

    def _render(
        self, messages: list[dict], tools: list[dict] | None = None, fields: tuple[dict, ...] = ()
    ) -> list[int]:
        """Token ids of a chat through the model's template, with the tools offered as mlx_lm.server
        hands them to it (on the worker). `fields`: per message, the request's own name of each key
        (errors name it); messages[i].<key> where it says nothing."""
        from jinja2 import TemplateError

        for i, m in enumerate(messages):
            names = fields[i] if fields else {}

            def at(key: str) -> str:
                return names.get(key, f"messages[{i}].{key}")

            _check_text(m["content"], at("content"))
            if (
                "tool_calls" in m
            ):  # arguments are objects now: the template writes them as JSON text
                _check_text(json.dumps(m["tool_calls"], ensure_ascii=False), at("tool_calls"))
            for key in ("tool_call_id", "name"):  # some templates write them too
                if key in m:
                    _check_text(m[key], at(key))
        if tools:
            _check_text(json.dumps(tools, ensure_ascii=False), "tools")
            if not self.tokenizer.has_tool_calling:
                logger.warning(
                    "tools offered, but mlx-lm knows no tool-call format for this model's tokenizer: "
                    "its calls come back as text"
                )
        self._refuse_too_long([m["content"] for m in messages], "messages")
        try:
            return list(
                self.tokenizer.apply_chat_template(
                    messages, tools=tools, add_generation_prompt=True, tokenize=True
                )
            )
        except (
            TemplateError
        ) as exc:  # the template refuses these messages; its text is meant for the user
            raise ApiError(
                INVALID, f"the chat template cannot render these messages: {exc}", param="messages"
            ) from None

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
            {**self.cluster.status(), "requests_completed": self.metrics.requests["ok"]}
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
                f"The model '{model}' does not exist (this cluster serves '{self.options.model_id}')",
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
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        sampling, stops, stream = parse_sampling(body, self.options.default_max_tokens)
        echo = check_unsupported_completion(body)
        speculation = await self._speculation(body)
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], (str, list)):
            # the length first: it costs nothing, while a pass over 4 million ids stalls the loop 0.3 s
            self._check_context(prompt, sampling, chat=False)
            self._check_ids(prompt, "prompt")  # names the first id that is not an int in [0, vocab)
            ids = list(prompt)
        elif isinstance(prompt, str) and prompt:
            ids = await self.worker.call(lambda: self._encode(prompt))
        else:
            raise ApiError(
                INVALID,
                "'prompt' must be a non-empty string (or a list of token ids), "
                f"got {_show(prompt)}",
                param="prompt",
            )
        if not echo:
            echoed = ""
        elif isinstance(prompt, str):
            echoed = prompt
        else:
            echoed = await self.worker.call(lambda: self.tokenizer.decode(ids))
        return await self._serve(
            request, ids, sampling, stops, stream, chat=False, echo=echoed, speculation=speculation
        )

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._json_body(request)
        self._check_model(body)
        sampling, stops, stream = parse_sampling(body, self.options.default_max_tokens)
        check_unsupported(body)
        speculation = await self._speculation(body)
        tools = parse_tools(body)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(INVALID, "'messages' must be a non-empty list", param="messages")
        clean = [chat_message(m, i) for i, m in enumerate(messages)]
        rendered = tools.rendered if tools else None
        ids = await self.worker.call(lambda: self._render(clean, rendered))
        return await self._serve(
            request, ids, sampling, stops, stream, chat=True, tools=tools, speculation=speculation
        )

    async def messages(self, request: web.Request) -> web.StreamResponse:
        """Anthropic's Messages API: the same rendering, generation and tool parsing as chat."""
        body = await self._json_body(request)
        self._check_model(body)
        req = await self.worker.call(lambda: anthropic.parse_request(body))  # a big body: seconds
        rendered = req.tools.rendered if req.tools else None
        ids = await self.worker.call(lambda: self._render(req.messages, rendered, req.fields))
        gen = self._generation(
            ids, req.sampling, req.stops, chat=True, tools=req.tools, prefix="msg_"
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
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        alive = KeepAlive(request, resp, gen.outcome)  # comments while the cluster recovers
        await alive.start(gen)  # errors before the first byte are still proper HTTP errors
        try:
            await resp.write(events.start())
            async for part in gen.stream_parts():
                await resp.write(events.part(part))
            if gen.outcome.error:
                e = gen._failure()
                await resp.write(events.error(e.status, e.message))
            else:
                await resp.write(events.end(gen.reason, gen.stop_hit, len(gen.outcome.tokens)))
        except (ConnectionResetError, asyncio.CancelledError):
            await gen.client_gone()
            raise
        finally:
            await alive.close()
        return resp

    async def _speculation(self, body: dict) -> tuple[int | None, tuple[int, ...]]:
        """(drafts per step, predicted token ids) of a request (parse_speculation)."""
        drafts, text = parse_speculation(body, self.options)
        if not text:
            return drafts, ()

        def encode() -> tuple[int, ...]:
            self._refuse_too_long([text], "prediction.content")
            return tuple(self.tokenizer.encode(text, add_special_tokens=False))

        ids = await self.worker.call(encode)
        if len(ids) > self.options.context_length:
            raise ApiError(
                INVALID,
                f"'prediction' has {len(ids)} tokens, past this model's context of "
                f"{self.options.context_length}",
                param="prediction",
            )
        return drafts, ids

    def _generation(
        self,
        ids: list[int],
        sampling: Sampling,
        stops: list[str],
        chat: bool,
        tools: Tools | None = None,
        prefix: str = "",
        speculation: tuple[int | None, tuple[int, ...]] = (None, ()),
    ) -> "_Generation":
        """A request checked against the context, the vocabulary and the cluster's state."""
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
        drafts, prediction = speculation
        # the nodes end a sequence on a stop string's tokens at once (as mlx-lm's server does); one
        # the model spells with other tokens is still found in the text here, and cancelled
        stop_ids = tuple(
            t
            for t in (tuple(self.tokenizer.encode(s, add_special_tokens=False)) for s in stops)
            if t
        )
        req = GenerateRequest(
            rid,
            tuple(ids),
            sampling,
            eos,
            draft_tokens=drafts,
            prediction=prediction,
            stop_sequences=stop_ids,
        )
        return _Generation(self, req, stops, tools)

    async def _serve(
        self,
        request: web.Request,
        ids: list[int],
        sampling: Sampling,
        stops: list[str],
        stream: bool,
        chat: bool,
        tools: Tools | None = None,
        echo: str = "",
        speculation: tuple[int | None, tuple[int, ...]] = (None, ()),
    ) -> web.StreamResponse:
        """`echo`: text put before a completion's own (the prompt, where the request asked for it)."""
        gen = self._generation(ids, sampling, stops, chat, tools, speculation=speculation)
        if stream:
            return await self._stream(request, gen, chat, echo)
        text, outcome = await gen.run()
        return web.json_response(self._final(gen, echo + text, outcome, chat))

    def _usage(self, gen: "_Generation", outcome: Outcome) -> dict:
        n = len(outcome.tokens)
        return {
            "prompt_tokens": len(gen.req.prompt),
            "completion_tokens": n,
            "total_tokens": len(gen.req.prompt) + n,
        }

    def _extra(self, gen: "_Generation", outcome: Outcome) -> dict:
        d = outcome.done
        t = d.timings if d else None
        return {
            "tokens": outcome.tokens,
            "cached_tokens": d.cached_tokens if d else 0,
            "prompt_tps": prompt_tps(d),
            "generation_tps": (max(len(outcome.tokens), 1) / t.generation_s)
            if t and t.generation_s
            else 0.0,
            "time_to_first_token_s": gen.ttft,
            "stalls_s": [round(s, 3) for s in outcome.stalls],  # one per resume after a lost node
            "speculative": speculation_figures(d.counters if d else {}, len(outcome.tokens)),
            # rank 0's MLX peak since it started (the nodes of one cluster hold about the same)
            "peak_memory_bytes": int(d.counters.get("peak_memory_bytes", 0)) if d else 0,
        }

    def _final(self, gen: "_Generation", text: str, outcome: Outcome, chat: bool) -> dict:
        choice: dict[str, Any] = {"index": 0, "finish_reason": gen.reason, "logprobs": None}
        if chat:
            text = "".join(p for p in gen.parts if isinstance(p, str))
            calls = [call_json(p) for p in gen.parts if isinstance(p, ToolCall)]
            choice["message"] = {"role": "assistant", "content": text or (None if calls else "")}
            if calls:
                choice["message"]["tool_calls"] = calls
        else:
            choice["text"] = text
        return {
            "id": gen.req.request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.options.model_id,
            "choices": [choice],
            "usage": self._usage(gen, outcome),
            "moe_cluster": self._extra(gen, outcome),
        }

    async def _stream(
        self, request: web.Request, gen: "_Generation", chat: bool, echo: str = ""
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        alive = KeepAlive(request, resp, gen.outcome)  # comments while the cluster recovers
        await alive.start(gen)  # errors before the first byte are still proper HTTP errors
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(
            delta_text: str | None,
            finish: str | None,
            first: bool = False,
            calls: list | None = None,
        ) -> dict:
            if chat:
                delta: dict[str, Any] = {}
                if first:
                    delta["role"] = "assistant"
                if delta_text:
                    delta["content"] = delta_text
                if calls:
                    delta["tool_calls"] = calls
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {
                    "index": 0,
                    "text": delta_text or "",
                    "finish_reason": finish,
                    "logprobs": None,
                }
            return {
                "id": gen.req.request_id,
                "object": obj,
                "created": created,
                "model": self.options.model_id,
                "choices": [choice],
            }

        def sse(event: dict) -> bytes:
            return f"data: {json.dumps(event)}\n\n".encode()

        try:
            if chat:
                await resp.write(sse(chunk(None, None, first=True)))
            elif echo:
                await resp.write(sse(chunk(echo, None)))
            calls = 0
            async for piece in gen.stream_parts():
                if isinstance(piece, str):
                    await resp.write(sse(chunk(piece, None)))
                    continue
                # as OpenAI streams a call: its id and name first, then its arguments in deltas
                head = {
                    **call_json(piece, calls),
                    "function": {"name": piece.name, "arguments": ""},
                }
                await resp.write(sse(chunk(None, None, calls=[head])))
                await resp.write(
                    sse(
                        chunk(
                            None,
                            None,
                            calls=[{"index": calls, "function": {"arguments": piece.arguments}}],
                        )
                    )
                )
                calls += 1
            outcome = gen.outcome
            if outcome.error:
                e = gen._failure()
                await resp.write(
                    sse(
                        {
                            "error": {
                                "message": e.message,
                                "type": e.type,
                                "param": None,
                                "code": e.code,
                            }
                        }
                    )
                )
            else:
                final = chunk(None, gen.reason)
                final["usage"] = self._usage(gen, outcome)
                final["moe_cluster"] = self._extra(gen, outcome)
                await resp.write(sse(final))
            await resp.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            await gen.client_gone()
            raise
        finally:
            await alive.close()
        return resp


class _Generation:
    """One request's detokenisation, stop strings and bookkeeping around Cluster.generate."""

    def __init__(
        self, api: Api, req: GenerateRequest, stops: list[str], tools: Tools | None = None
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
                raise self._failure() from None
        except MoeClusterError as exc:  # not ready, degraded, queue full: by its kind
            raise ApiError.of(exc) from None
        except asyncio.CancelledError:
            await self.client_gone()
            raise

    @property
    def reason(self) -> str:
        """The finish reason the client sees: a generation that ended after calling tools called them."""
        if self.finish_reason == "stop" and any(isinstance(p, ToolCall) for p in self.parts):
            return "tool_calls"
        return self.finish_reason

    async def stream_parts(self):
        """The output as it becomes final: text deltas and, where tools were offered, whole tool calls
        (each also kept in `parts`)."""
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

    def _failure(self) -> ApiError:
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
            raise self._failure()
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

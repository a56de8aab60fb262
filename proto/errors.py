"""The project's one error hierarchy and the one table from an error's kind to HTTP and gRPC.

Every error we raise on purpose is a `MoeClusterError` with a `kind`. Callers branch on the kind
(or on the gRPC status code the kind maps to), never on message text. `UserError` is bad input:
a config, an argument, a file, a checkpoint or placement that cannot run; the CLI prints it as
one line and exits 2. Imports no mlx (the HTTP server and the CLI use it without a model).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import ClassVar

import grpc


class ErrorKind(enum.Enum):
    """What went wrong, as far as a caller needs to know to react."""

    INVALID_INPUT = "invalid_input"  # a request, file or argument that cannot be used
    NOT_FOUND = "not_found"  # a model, node or file that is not there
    UNAUTHENTICATED = "unauthenticated"  # wrong or missing secret / API key
    BUSY = "busy"  # a request already runs, or the queue is full: try again later
    NOT_READY = "not_ready"  # nothing loaded yet, or loading
    UNAVAILABLE = "unavailable"  # a node or peer is down: the cluster is degraded
    TIMEOUT = "timeout"  # a deadline passed
    CANCELLED = "cancelled"  # the caller stopped the request
    INTERNAL = "internal"  # a bug: the text goes to the log, not to the client


@dataclass(frozen=True)
class KindMapping:
    http: int  # HTTP status of the API's answer
    type: str  # OpenAI error `type`
    code: str  # OpenAI error `code` (a handler may name a finer one, e.g. model_not_found)
    grpc: grpc.StatusCode


# The one table: every kind, its HTTP status, OpenAI type/code and gRPC status code.
KINDS: dict[ErrorKind, KindMapping] = {
    ErrorKind.INVALID_INPUT: KindMapping(
        400, "invalid_request_error", "invalid_input", grpc.StatusCode.INVALID_ARGUMENT
    ),
    ErrorKind.NOT_FOUND: KindMapping(
        404, "invalid_request_error", "not_found", grpc.StatusCode.NOT_FOUND
    ),
    ErrorKind.UNAUTHENTICATED: KindMapping(
        401, "authentication_error", "invalid_api_key", grpc.StatusCode.UNAUTHENTICATED
    ),
    ErrorKind.BUSY: KindMapping(
        429, "rate_limit_error", "queue_full", grpc.StatusCode.RESOURCE_EXHAUSTED
    ),
    ErrorKind.UNAVAILABLE: KindMapping(
        503, "service_unavailable", "cluster_degraded", grpc.StatusCode.UNAVAILABLE
    ),
    ErrorKind.NOT_READY: KindMapping(
        503, "service_unavailable", "not_ready", grpc.StatusCode.FAILED_PRECONDITION
    ),
    ErrorKind.TIMEOUT: KindMapping(
        504, "server_error", "timeout", grpc.StatusCode.DEADLINE_EXCEEDED
    ),
    ErrorKind.CANCELLED: KindMapping(499, "server_error", "cancelled", grpc.StatusCode.CANCELLED),
    ErrorKind.INTERNAL: KindMapping(
        500, "server_error", "internal_error", grpc.StatusCode.INTERNAL
    ),
}

_BY_GRPC = {m.grpc: kind for kind, m in KINDS.items()}
_BY_HTTP: dict[int, ErrorKind] = {}
for _kind, _m in KINDS.items():
    _BY_HTTP.setdefault(_m.http, _kind)  # 503 is UNAVAILABLE (listed before NOT_READY)


def grpc_code(kind: ErrorKind) -> grpc.StatusCode:
    return KINDS[kind].grpc


def http_status(kind: ErrorKind) -> int:
    return KINDS[kind].http


def kind_from_grpc(code: grpc.StatusCode | None) -> ErrorKind:
    """The kind of a failed call; codes we never send (UNKNOWN, DATA_LOSS, ...) are INTERNAL."""
    return _BY_GRPC.get(code, ErrorKind.INTERNAL)


def kind_from_http(status: int) -> ErrorKind:
    """The kind of an API answer (for the CLI's remote commands); other 4xx are bad input, 5xx internal."""
    if status in _BY_HTTP:
        return _BY_HTTP[status]
    return ErrorKind.INVALID_INPUT if 400 <= status < 500 else ErrorKind.INTERNAL


class MoeClusterError(Exception):
    """Base of every error the project raises on purpose; `kind` says how callers should react."""

    kind: ClassVar[ErrorKind] = ErrorKind.INTERNAL
    retry_after_s: float | None = (
        None  # seconds a client should wait before trying again (HTTP Retry-After)
    )


class UserError(MoeClusterError, ValueError):
    """Bad input: a config, argument, file, checkpoint or placement that cannot run.

    A ValueError too, so code that guarded against bad values keeps doing so.
    """

    kind = ErrorKind.INVALID_INPUT


class NotFoundError(UserError):
    kind = ErrorKind.NOT_FOUND


class AuthError(MoeClusterError):
    kind = ErrorKind.UNAUTHENTICATED


class BusyError(MoeClusterError):
    kind = ErrorKind.BUSY


class NotReadyError(MoeClusterError):
    kind = ErrorKind.NOT_READY


class UnavailableError(MoeClusterError):
    """A node or peer is down (the cluster is degraded)."""

    kind = ErrorKind.UNAVAILABLE


class DeadlineError(MoeClusterError):
    kind = ErrorKind.TIMEOUT


class CancelledError(MoeClusterError):
    kind = ErrorKind.CANCELLED


class InternalError(MoeClusterError):
    """A bug somewhere else (a node, a child process), relayed here."""

    kind = ErrorKind.INTERNAL


_CLASS_OF_KIND: dict[ErrorKind, type[MoeClusterError]] = {
    ErrorKind.INVALID_INPUT: UserError,
    ErrorKind.NOT_FOUND: NotFoundError,
    ErrorKind.UNAUTHENTICATED: AuthError,
    ErrorKind.BUSY: BusyError,
    ErrorKind.NOT_READY: NotReadyError,
    ErrorKind.UNAVAILABLE: UnavailableError,
    ErrorKind.TIMEOUT: DeadlineError,
    ErrorKind.CANCELLED: CancelledError,
    ErrorKind.INTERNAL: InternalError,
}


def error_for(kind: ErrorKind, message: str) -> MoeClusterError:
    """The typed error to raise for a kind that arrived from elsewhere (a node, a child process)."""
    return _CLASS_OF_KIND[kind](message)


def kind_of(exc: BaseException) -> ErrorKind:
    """The kind of any exception: its own for ours, INTERNAL for everything else (a bug)."""
    return exc.kind if isinstance(exc, MoeClusterError) else ErrorKind.INTERNAL

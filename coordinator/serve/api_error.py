"""The HTTP API's error: a status, type, code and message in OpenAI's JSON shape (Anthropic's on
/v1/messages), from the kinds of proto/errors.py."""

from __future__ import annotations

import logging
import math

from aiohttp import web

from ...proto.errors import KINDS, ErrorKind, MoeClusterError
from . import anthropic

logger = logging.getLogger(__name__)

INVALID = ErrorKind.INVALID_INPUT  # 400, naming the field in `param`
INTERNAL_MESSAGE = "internal error in the cluster (the coordinator's log has the details)"


class ApiError(Exception):
    """An HTTP error in OpenAI's shape; the status, type and default code come from the kind
    (proto.errors.KINDS)."""

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
        """A typed error as HTTP by its kind; a bug's text goes to the log only, never to the
        client."""
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

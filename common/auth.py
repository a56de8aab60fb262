"""Cluster secret on every RPC (a server interceptor and the caller's metadata) and TLS credentials.

The secret travels as call metadata and is compared in constant time; a call without it is
aborted with UNAUTHENTICATED before any handler runs, so it gets no data. The secret itself is
never logged, and neither is the metadata that carries it. Shared by the envoy and node services.
"""

from __future__ import annotations

import hmac
import logging
from pathlib import Path
from typing import Any, Awaitable, Callable

import grpc

from ..proto.errors import UserError

logger = logging.getLogger(__name__)

SECRET_KEY = "x-moe-cluster-secret"  # metadata key
SECRET_ENV = "MOE_CLUSTER_SECRET"  # environment variable a process reads the secret from


def call_metadata(secret: str) -> tuple[tuple[str, str], ...]:
    """Metadata to pass on every call (`metadata=` of a stub or multicallable)."""
    return ((SECRET_KEY, secret),)


def authorized(metadata, secret: str) -> bool:
    for key, value in metadata or ():
        if key == SECRET_KEY:
            return hmac.compare_digest(
                value.encode() if isinstance(value, str) else value, secret.encode()
            )
    return False


def _denier(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that aborts every call with UNAUTHENTICATED."""

    async def deny(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED, f"{method}: missing or wrong cluster secret"
        )

    async def deny_stream(request_or_iterator: Any, context: grpc.aio.ServicerContext):
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED, f"{method}: missing or wrong cluster secret"
        )
        yield  # pragma: no cover - makes this an async generator, as streaming handlers are

    kw = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny_stream, **kw)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, **kw)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **kw)
    return grpc.unary_unary_rpc_method_handler(deny, **kw)


class SecretInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call that does not carry the cluster secret."""

    def __init__(self, secret: str):
        if not secret:
            raise UserError("the cluster secret is empty")
        self._secret = secret

    def __repr__(self) -> str:  # never show the secret
        return "SecretInterceptor(<secret>)"

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or authorized(details.invocation_metadata, self._secret):
            return handler
        logger.warning("refused %s: missing or wrong cluster secret", details.method)
        return _denier(handler, details.method)


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise UserError(f"cannot read TLS {what} {path}: {exc.strerror}") from exc


def server_credentials(cert: str, key: str, ca: str | None = None) -> grpc.ServerCredentials:
    """TLS for a server from PEM files; with `ca`, clients must present a certificate it signed."""
    return grpc.ssl_server_credentials(
        [(_read(key, "key"), _read(cert, "certificate"))],
        root_certificates=_read(ca, "CA") if ca else None,
        require_client_auth=bool(ca),
    )


def channel_credentials(
    ca: str, cert: str | None = None, key: str | None = None
) -> grpc.ChannelCredentials:
    """TLS for a client: trust `ca`; present `cert`/`key` when the server asks for one."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca, "CA"),
        private_key=_read(key, "key") if key else None,
        certificate_chain=_read(cert, "certificate") if cert else None,
    )


def ssl_server_context(cert: str, key: str, ca: str | None = None):
    """`server_credentials`' rule for a plain socket (the Ship data channel): with `ca`, clients
    must present a certificate it signed."""
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(cert, key)
        if ca:
            ctx.load_verify_locations(ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as exc:
        raise UserError(f"cannot use TLS certificate {cert} / key {key}: {exc}") from exc
    return ctx


def ssl_client_context(ca: str, cert: str | None = None, key: str | None = None):
    """`channel_credentials`' rule for a plain socket: trust `ca`; present `cert`/`key`."""
    import ssl

    ctx = ssl.create_default_context(cafile=ca)
    try:
        if cert and key:
            ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise UserError(f"cannot use TLS certificate {cert} / key {key}: {exc}") from exc
    return ctx

"""The coordinator's view of one node: a gRPC client of the Node service with the cluster secret."""

from __future__ import annotations

import logging
from typing import AsyncIterator

import grpc

from ...common.auth import call_metadata, channel_credentials
from ...proto.records import GenerateEvent, Health, LoadProgress, LoadSpec, NodeStatus
from ...proto.records import GenerateRequest
from ...proto import CHANNEL_OPTIONS, convert
from ...proto.errors import ErrorKind, MoeClusterError
from ...proto import node_pb2_grpc as npb_grpc

logger = logging.getLogger(__name__)

RPC_TIMEOUT_S = 5.0  # unary calls (health, status, cancel, shutdown)


class ClusterError(MoeClusterError):
    """Something about the cluster that stops a request or a start, with the reason (a node down)."""

    kind = ErrorKind.UNAVAILABLE


class NodeClient:
    """One node agent, reached at `address` (host:port)."""

    def __init__(
        self,
        name: str,
        address: str,
        secret: str,
        *,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
    ):
        self.name = name
        self.address = address
        self._metadata = call_metadata(secret)
        if tls_ca:
            self._channel = grpc.aio.secure_channel(
                address, channel_credentials(tls_ca, tls_cert, tls_key), options=CHANNEL_OPTIONS
            )
        else:
            self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = npb_grpc.NodeStub(self._channel)

    def __repr__(self) -> str:
        return f"NodeClient({self.name}@{self.address})"

    async def health(self, timeout: float = RPC_TIMEOUT_S) -> Health:
        msg = await self._stub.Health(
            convert.health_request_to_proto(), timeout=timeout, metadata=self._metadata
        )
        return convert.health_from_proto(msg)

    async def status(self, timeout: float = RPC_TIMEOUT_S) -> NodeStatus:
        msg = await self._stub.Status(
            convert.status_request_to_proto(), timeout=timeout, metadata=self._metadata
        )
        return convert.status_from_proto(msg)

    async def load(self, spec: LoadSpec, timeout: float) -> AsyncIterator[LoadProgress]:
        call = self._stub.Load(
            convert.load_request_to_proto(spec), timeout=timeout, metadata=self._metadata
        )
        async for msg in call:
            yield convert.load_progress_from_proto(msg)

    async def generate(self, req: GenerateRequest, timeout: float) -> AsyncIterator[GenerateEvent]:
        call = self._stub.Generate(
            convert.generate_request_to_proto(req), timeout=timeout, metadata=self._metadata
        )
        try:
            async for msg in call:
                yield convert.generate_event_from_proto(msg)
        finally:
            call.cancel()

    async def cancel(
        self, request_id: str, abort: bool = False, timeout: float = RPC_TIMEOUT_S
    ) -> bool:
        msg = await self._stub.Cancel(
            convert.cancel_request_to_proto(request_id, abort),
            timeout=timeout,
            metadata=self._metadata,
        )
        return convert.cancel_reply_from_proto(msg)

    async def probe(self, layer: int, x, timeout: float = RPC_TIMEOUT_S):
        """This node's share of MoE layer `layer`'s output for x (tokens, hidden), float32."""
        msg = await self._stub.Probe(
            convert.probe_request_to_proto(layer, x), timeout=timeout, metadata=self._metadata
        )
        return convert.probe_reply_from_proto(msg)

    async def link_listen(self, timeout: float = RPC_TIMEOUT_S):
        """A listener on this node for one link probe (proto/link.py LinkListen)."""
        msg = await self._stub.LinkListen(
            convert.link_listen_request_to_proto(), timeout=timeout, metadata=self._metadata
        )
        return convert.link_listen_from_proto(msg)

    async def link_probe(self, spec, timeout: float):
        """Round trips and a transfer from this node to a peer's listener (LinkProbeResult)."""
        msg = await self._stub.LinkProbe(
            convert.link_probe_request_to_proto(spec), timeout=timeout, metadata=self._metadata
        )
        return convert.link_probe_reply_from_proto(msg)

    async def link_allreduce(self, spec, timeout: float):
        """This node's all-reduce timings among the nodes over spec.transport."""
        msg = await self._stub.LinkAllReduce(
            convert.link_allreduce_request_to_proto(spec), timeout=timeout, metadata=self._metadata
        )
        return convert.link_allreduce_reply_from_proto(msg)

    async def shutdown(self, grace_s: float = 1.0, timeout: float = RPC_TIMEOUT_S) -> None:
        await self._stub.Shutdown(
            convert.shutdown_request_to_proto(grace_s), timeout=timeout, metadata=self._metadata
        )

    async def close(self) -> None:
        await self._channel.close()


def describe_rpc_error(exc: grpc.RpcError) -> str:
    """One line for a failed call: the status and its details."""
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    if code == grpc.StatusCode.UNAVAILABLE:
        return "unreachable"
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return "refused: wrong cluster secret"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "timed out"
    return f"{code.name if code else 'error'}: {details}"

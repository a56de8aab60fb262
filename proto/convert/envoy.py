"""The Envoy service (envoy <-> envoy): the Exchange stream's Hello and the Health call, as bytes
(the envoy registers these as its serializers)."""

from __future__ import annotations

from typing import Any

from .. import envoy_pb2 as epb
from ..frame import Hello

_ENVOY = epb.DESCRIPTOR.services_by_name["Envoy"]
ENVOY_EXCHANGE = f"/{_ENVOY.full_name}/Exchange"
ENVOY_HEALTH = f"/{_ENVOY.full_name}/Health"
ENVOY_SERVICE = _ENVOY.full_name


def hello_to_wire(hello: Hello) -> bytes:
    """A Hello -> serialized moe_cluster.v1.Hello (all the Exchange stream carries)."""
    return epb.Hello(
        rank=hello.rank,
        world_size=hello.world_size,
        protocol=hello.protocol,
        data_port=hello.data_port,
        data_token=hello.data_token,
    ).SerializeToString()


def hello_from_wire(data: bytes) -> Hello:
    h = epb.Hello.FromString(data)
    return Hello(h.rank, h.world_size, h.protocol, h.data_port, h.data_token)


def envoy_health_request_to_wire(_: Any = None) -> bytes:
    return epb.EnvoyHealthRequest().SerializeToString()


def envoy_health_request_from_wire(data: bytes) -> None:
    epb.EnvoyHealthRequest.FromString(data)


def envoy_health_to_wire(health: dict) -> bytes:
    """{"rank", "world_size", "connected", "whole"} -> serialized EnvoyHealth."""
    return epb.EnvoyHealth(
        rank=health["rank"],
        world_size=health["world_size"],
        connected=sorted(health["connected"]),
        whole=health["whole"],
    ).SerializeToString()


def envoy_health_from_wire(data: bytes) -> dict:
    msg = epb.EnvoyHealth.FromString(data)
    return {
        "rank": msg.rank,
        "world_size": msg.world_size,
        "connected": list(msg.connected),
        "whole": msg.whole,
    }

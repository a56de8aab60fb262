"""The Node service's Load: what a node loads (placement, transport, serving settings) and its
progress, each checked as it arrives."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from .. import node_pb2 as npb
from .enums import (
    KEEPALIVE_FROM_PB,
    KEEPALIVE_TO_PB,
    ConvertError,
    error_from_proto,
    error_to_proto,
    lookup,
)

if TYPE_CHECKING:
    from ..placement import Placement
    from ..records import LoadProgress, LoadSpec


def placement_to_proto(p: Placement) -> npb.Placement:
    msg = npb.Placement(world_size=p.world_size)
    for layer, ranks in p.layers.items():
        lp = msg.layers[layer]
        for rank, experts in ranks.items():
            lp.ranks[rank].ids.extend(experts)
    return msg


def placement_from_proto(msg: npb.Placement) -> Placement:
    from ..placement import Placement

    layers = {
        int(layer): {int(rank): tuple(e.ids) for rank, e in sorted(lp.ranks.items())}
        for layer, lp in sorted(msg.layers.items())
    }
    return Placement.from_json(
        {
            "layers": {
                str(k): {str(r): list(v) for r, v in ranks.items()} for k, ranks in layers.items()
            }
        },
        msg.world_size,
    )


def transport_to_proto(spec: Any) -> npb.Transport:
    """A node.transports spec (EnvoySpec or MlxSpec) -> Transport."""
    from ..transport import EnvoySpec, MlxSpec

    if isinstance(spec, EnvoySpec):
        return npb.Transport(
            envoy=npb.EnvoyTransport(
                peers=spec.addresses,
                listen=spec.listen,
                tls=spec.tls is not None,
                data_port=spec.data_port,
            )
        )
    if isinstance(spec, MlxSpec):
        return npb.Transport(
            mlx=npb.MlxTransport(
                backend=spec.backend,
                hosts=[npb.MlxHost(addresses=h) for h in spec.hosts],
                jaccl_coordinator=spec.jaccl_coordinator,
                jaccl_devices=[
                    npb.MlxHost(addresses=[d or "" for d in row]) for row in spec.jaccl_devices
                ],
            )
        )
    raise ConvertError(
        f"transport {type(spec).__name__} cannot be sent to a node (envoy or mlx only)"
    )


def transport_from_proto(
    msg: npb.Transport, *, timeout_s: float, secret: str = "", tls: Any = None
) -> Any:
    """Transport -> EnvoySpec or MlxSpec. The secret and TLS files are the node's own configuration."""
    from ..transport import EnvoySpec, MlxSpec
    from ..records import COLLECTIVE_TIMEOUT_S

    timeout_s = timeout_s or COLLECTIVE_TIMEOUT_S
    kind = msg.WhichOneof("kind")
    if kind == "envoy":
        e = msg.envoy
        if e.tls and tls is None:
            raise ConvertError("transport asks for TLS but this node has no TLS files configured")
        return EnvoySpec(
            tuple(e.peers),
            secret=secret,
            listen=e.listen,
            timeout_s=timeout_s,
            tls=tls if e.tls else None,
            data_port=e.data_port,
        )
    if kind == "mlx":
        m = msg.mlx
        return MlxSpec(
            tuple(tuple(h.addresses) for h in m.hosts),
            backend=m.backend or "ring",
            timeout_s=timeout_s,
            jaccl_coordinator=m.jaccl_coordinator,
            jaccl_devices=tuple(tuple(d or None for d in row.addresses) for row in m.jaccl_devices),
        )
    raise ConvertError("transport is empty (expected envoy or mlx)")


def load_request_to_proto(spec: LoadSpec) -> npb.LoadRequest:
    msg = npb.LoadRequest(
        model=spec.model,
        rank=spec.rank,
        world_size=spec.world_size,
        keepalive=lookup(KEEPALIVE_TO_PB, spec.keepalive, "keepalive"),
        transport=transport_to_proto(spec.transport),
        collective_timeout_s=spec.transport.timeout_s,
        prefill_step=spec.prefill_step,
        prompt_cache_bytes=spec.prompt_cache_bytes,
        expert_cache=spec.expert_cache,
        max_batch=spec.max_batch,
        prefill_budget=spec.prefill_budget,
        kv_budget_bytes=spec.kv_budget_bytes,
        route=spec.route,
        speculative=spec.speculative,
        draft_tokens=spec.draft_tokens,
        draft_model=spec.draft_model,
        mtp_experts=spec.mtp_experts,
        overlap=spec.overlap,
        attention=spec.attention,
        orphan_after_s=spec.orphan_after_s,
        adopt=spec.adopt,
    )
    if spec.placement is not None:
        msg.placement.CopyFrom(placement_to_proto(spec.placement))
    if spec.ship is not None:
        msg.ship.CopyFrom(
            npb.ShipSource(fingerprint=spec.ship.fingerprint, address=spec.ship.address)
        )
    msg.heat.extend(
        npb.LayerHeat(layer=layer, selections=list(counts), tokens=tokens)
        for layer, counts, tokens in spec.heat
    )
    return msg


def _speculative(mode: str) -> str:
    from ..records import SPECULATIVE_MODES

    if mode and mode not in SPECULATIVE_MODES:
        raise ConvertError(
            f"LoadRequest.speculative {mode!r} is not one of {', '.join(SPECULATIVE_MODES)}"
        )
    return mode or "off"


def _mtp_experts(holding: str) -> str:
    from ..records import MTP_EXPERTS

    if holding and holding not in MTP_EXPERTS:
        raise ConvertError(
            f"LoadRequest.mtp_experts {holding!r} is not one of {', '.join(MTP_EXPERTS)}"
        )
    return holding or "auto"


def load_request_from_proto(msg: npb.LoadRequest, *, secret: str = "", tls: Any = None) -> LoadSpec:
    """LoadRequest -> LoadSpec; `secret` and `tls` come from the node's configuration."""
    from ..records import DEFAULT_PREFILL_STEP
    from ..records import LoadSpec

    if not msg.model:
        raise ConvertError("LoadRequest.model is empty")
    if msg.world_size < 1 or msg.rank >= msg.world_size:
        raise ConvertError(f"LoadRequest rank {msg.rank} is not below world_size {msg.world_size}")
    keepalive = (
        "lru"
        if msg.keepalive == npb.KEEPALIVE_UNSPECIFIED
        else lookup(KEEPALIVE_FROM_PB, msg.keepalive, "keepalive")
    )
    transport = transport_from_proto(
        msg.transport, timeout_s=msg.collective_timeout_s, secret=secret, tls=tls
    )
    return LoadSpec(
        model=msg.model,
        rank=msg.rank,
        world_size=msg.world_size,
        placement=placement_from_proto(msg.placement) if msg.HasField("placement") else None,
        keepalive=keepalive,
        transport=transport,
        prefill_step=msg.prefill_step or DEFAULT_PREFILL_STEP,
        prompt_cache_bytes=msg.prompt_cache_bytes,
        ship=_ship_from_proto(msg),
        expert_cache=msg.expert_cache or "off",
        max_batch=msg.max_batch or LoadSpec.max_batch,
        prefill_budget=msg.prefill_budget or LoadSpec.prefill_budget,
        kv_budget_bytes=msg.kv_budget_bytes,
        heat=tuple((h.layer, tuple(h.selections), h.tokens) for h in msg.heat),
        route=msg.route or "measure",
        speculative=_speculative(msg.speculative),
        draft_tokens=msg.draft_tokens or LoadSpec.draft_tokens,
        draft_model=msg.draft_model,
        mtp_experts=_mtp_experts(msg.mtp_experts),
        overlap=msg.overlap,
        attention=msg.attention or "replicated",
        orphan_after_s=msg.orphan_after_s,
        adopt=msg.adopt,
    )


def _ship_from_proto(msg: npb.LoadRequest):
    from ..records import ShipSource

    if not msg.HasField("ship"):
        return None
    fp, address = msg.ship.fingerprint, msg.ship.address
    if not re.fullmatch(r"[0-9a-f]{64}", fp):
        raise ConvertError(f"LoadRequest.ship.fingerprint {fp[:80]!r} is not 64 hex digits")
    _, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConvertError(f"LoadRequest.ship.address {address[:80]!r} is not host:port")
    return ShipSource(fp, address)


def load_progress_to_proto(p: LoadProgress) -> npb.LoadProgress:
    msg = npb.LoadProgress(
        bytes_loaded=p.bytes_loaded, bytes_total=p.bytes_total, phase=p.phase, done=p.done
    )
    if p.error is not None:
        msg.error.CopyFrom(error_to_proto(p.error))
    return msg


def load_progress_from_proto(msg: npb.LoadProgress) -> LoadProgress:
    from ..records import LoadProgress

    return LoadProgress(
        msg.bytes_loaded,
        msg.bytes_total,
        msg.phase,
        msg.done,
        error_from_proto(msg.error) if msg.HasField("error") else None,
    )

"""The one place where protobuf messages become domain records and back.

Servicers and stubs call these (or pass them to gRPC as serializers); nothing else in the code
sees a generated message class.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from .frame import Hello
from . import envoy_pb2 as epb
from . import node_pb2 as npb
from .errors import ErrorKind, UserError

if TYPE_CHECKING:  # domain types of the node side, imported lazily (mlx, mlx-lm behind them)
    from .records import GenerateEvent, Health, LoadProgress, LoadSpec, NodeError, NodeStatus
    from .placement import Placement
    from .records import GenerateRequest

# ---------------------------------------------------------------------------------------------
# Envoy <-> envoy

_ENVOY = epb.DESCRIPTOR.services_by_name["Envoy"]
ENVOY_EXCHANGE = f"/{_ENVOY.full_name}/Exchange"
ENVOY_HEALTH = f"/{_ENVOY.full_name}/Health"
ENVOY_SERVICE = _ENVOY.full_name


class ConvertError(UserError):
    """A message that does not make a valid domain record; names the field."""


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


# ---------------------------------------------------------------------------------------------
# Coordinator <-> node

_KEEPALIVE_TO_PB = {
    "none": npb.KEEPALIVE_NONE,
    "lru": npb.KEEPALIVE_LRU,
    "busy": npb.KEEPALIVE_BUSY,
}
_KEEPALIVE_FROM_PB = {v: k for k, v in _KEEPALIVE_TO_PB.items()}
_STATE_TO_PB = {
    "idle": npb.NODE_STATE_IDLE,
    "loading": npb.NODE_STATE_LOADING,
    "ready": npb.NODE_STATE_READY,
    "busy": npb.NODE_STATE_BUSY,
    "failed": npb.NODE_STATE_FAILED,
    "stopping": npb.NODE_STATE_STOPPING,
}
_STATE_FROM_PB = {v: k for k, v in _STATE_TO_PB.items()}
_FINISH_TO_PB = {
    "stop": npb.FINISH_REASON_STOP,
    "length": npb.FINISH_REASON_LENGTH,
    "cancelled": npb.FINISH_REASON_CANCELLED,
    "error": npb.FINISH_REASON_ERROR,
}
_FINISH_FROM_PB = {v: k for k, v in _FINISH_TO_PB.items()}


def _lookup(table: dict, key, what: str):
    try:
        return table[key]
    except KeyError:
        raise ConvertError(
            f"unknown {what} {key!r} (expected one of {', '.join(map(str, table))})"
        ) from None


def placement_to_proto(p: Placement) -> npb.Placement:
    msg = npb.Placement(world_size=p.world_size)
    for layer, ranks in p.layers.items():
        lp = msg.layers[layer]
        for rank, experts in ranks.items():
            lp.ranks[rank].ids.extend(experts)
    return msg


def placement_from_proto(msg: npb.Placement) -> Placement:
    from .placement import Placement

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
    from .transport import EnvoySpec, MlxSpec

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
    from .transport import EnvoySpec, MlxSpec
    from .records import COLLECTIVE_TIMEOUT_S

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
        keepalive=_lookup(_KEEPALIVE_TO_PB, spec.keepalive, "keepalive"),
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
    from .records import SPECULATIVE_MODES

    if mode and mode not in SPECULATIVE_MODES:
        raise ConvertError(
            f"LoadRequest.speculative {mode!r} is not one of {', '.join(SPECULATIVE_MODES)}"
        )
    return mode or "off"


def load_request_from_proto(msg: npb.LoadRequest, *, secret: str = "", tls: Any = None) -> LoadSpec:
    """LoadRequest -> LoadSpec; `secret` and `tls` come from the node's configuration."""
    from .records import DEFAULT_PREFILL_STEP
    from .records import LoadSpec

    if not msg.model:
        raise ConvertError("LoadRequest.model is empty")
    if msg.world_size < 1 or msg.rank >= msg.world_size:
        raise ConvertError(f"LoadRequest rank {msg.rank} is not below world_size {msg.world_size}")
    keepalive = (
        "lru"
        if msg.keepalive == npb.KEEPALIVE_UNSPECIFIED
        else _lookup(_KEEPALIVE_FROM_PB, msg.keepalive, "keepalive")
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
        overlap=msg.overlap,
        attention=msg.attention or "replicated",
        orphan_after_s=msg.orphan_after_s,
        adopt=msg.adopt,
    )


def _ship_from_proto(msg: npb.LoadRequest):
    from .records import ShipSource

    if not msg.HasField("ship"):
        return None
    fp, address = msg.ship.fingerprint, msg.ship.address
    if not re.fullmatch(r"[0-9a-f]{64}", fp):
        raise ConvertError(f"LoadRequest.ship.fingerprint {fp[:80]!r} is not 64 hex digits")
    _, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConvertError(f"LoadRequest.ship.address {address[:80]!r} is not host:port")
    return ShipSource(fp, address)


# ErrorKind <-> its wire enum, by name; UNSPECIFIED (a sender that set none) reads as INTERNAL
_KIND_TO_PB = {k: npb.ErrorKind.Value(f"ERROR_KIND_{k.name}") for k in ErrorKind}
_KIND_FROM_PB = {v: k for k, v in _KIND_TO_PB.items()} | {
    npb.ERROR_KIND_UNSPECIFIED: ErrorKind.INTERNAL
}


def _error_to_proto(error: NodeError) -> npb.Error:
    return npb.Error(kind=_KIND_TO_PB[error.kind], message=error.message, rank=error.rank)


def _error_from_proto(msg: npb.Error) -> NodeError:
    from .records import NodeError

    return NodeError(_KIND_FROM_PB.get(msg.kind, ErrorKind.INTERNAL), msg.message, msg.rank)


def load_progress_to_proto(p: LoadProgress) -> npb.LoadProgress:
    msg = npb.LoadProgress(
        bytes_loaded=p.bytes_loaded, bytes_total=p.bytes_total, phase=p.phase, done=p.done
    )
    if p.error is not None:
        msg.error.CopyFrom(_error_to_proto(p.error))
    return msg


def load_progress_from_proto(msg: npb.LoadProgress) -> LoadProgress:
    from .records import LoadProgress

    return LoadProgress(
        msg.bytes_loaded,
        msg.bytes_total,
        msg.phase,
        msg.done,
        _error_from_proto(msg.error) if msg.HasField("error") else None,
    )


def generate_request_to_proto(req: GenerateRequest) -> npb.GenerateRequest:
    s = req.sampling
    try:  # protobuf refuses values its fields cannot hold (a negative id, a seed past uint64)
        msg = npb.GenerateRequest(
            request_id=req.request_id,
            prompt=list(req.prompt),
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            eos_token_ids=list(req.eos_token_ids),
            seq=req.seq,
            sampler_step=s.step,
            prediction=list(req.prediction),
            quiet=req.quiet,
            stop_sequences=[npb.Tokens(ids=list(t)) for t in req.stop_sequences],
            top_k=s.top_k,
            min_p=s.min_p,
            repetition_penalty=s.repetition_penalty,
            repetition_context_size=s.repetition_context_size,
            presence_penalty=s.presence_penalty,
            presence_context_size=s.presence_context_size,
            frequency_penalty=s.frequency_penalty,
            frequency_context_size=s.frequency_context_size,
            logit_bias=dict(s.logit_bias),
        )
        if s.seed is not None:
            msg.seed = s.seed
        if req.draft_tokens is not None:
            msg.draft_tokens = req.draft_tokens
        if req.owner >= 0:
            msg.owner = req.owner
    except (ValueError, TypeError) as exc:
        raise ConvertError(
            f"GenerateRequest {req.request_id} does not fit the wire format: {exc}"
        ) from None
    return msg


def generate_request_from_proto(
    msg: npb.GenerateRequest, *, prefill_step: int | None = None
) -> GenerateRequest:
    """GenerateRequest -> node.runtime.GenerateRequest; the prefill chunk comes from the Load."""
    from .records import DEFAULT_PREFILL_STEP, Sampling
    from .records import GenerateRequest

    if not msg.request_id:
        raise ConvertError("GenerateRequest.request_id is empty")
    if not msg.prompt:
        raise ConvertError(f"GenerateRequest {msg.request_id} has an empty prompt")
    seed = msg.seed if msg.HasField("seed") else None
    sampling = Sampling(
        msg.max_tokens,
        msg.temperature,
        msg.top_p,
        seed,
        msg.sampler_step,
        top_k=msg.top_k,
        min_p=msg.min_p,
        repetition_penalty=msg.repetition_penalty,
        repetition_context_size=msg.repetition_context_size,
        presence_penalty=msg.presence_penalty,
        presence_context_size=msg.presence_context_size,
        frequency_penalty=msg.frequency_penalty,
        frequency_context_size=msg.frequency_context_size,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
    )
    try:
        sampling.check()
    except ValueError as exc:
        raise ConvertError(f"GenerateRequest {msg.request_id}: {exc}") from exc
    return GenerateRequest(
        msg.request_id,
        tuple(msg.prompt),
        sampling,
        tuple(msg.eos_token_ids),
        prefill_step or DEFAULT_PREFILL_STEP,
        seq=msg.seq,
        draft_tokens=msg.draft_tokens if msg.HasField("draft_tokens") else None,
        prediction=tuple(msg.prediction),
        quiet=msg.quiet,
        stop_sequences=tuple(tuple(t.ids) for t in msg.stop_sequences if t.ids),
        owner=msg.owner if msg.HasField("owner") else -1,
    )


def generate_event_to_proto(event: GenerateEvent) -> npb.GenerateEvent:
    from .records import GenerateDone, GeneratedTokens, NodeError

    if isinstance(event, GeneratedTokens):
        return npb.GenerateEvent(tokens=npb.Tokens(ids=list(event.ids)))
    if isinstance(event, GenerateDone):
        t = event.timings
        return npb.GenerateEvent(
            done=npb.GenerateDone(
                finish_reason=_lookup(_FINISH_TO_PB, event.finish_reason, "finish reason"),
                prompt_tokens=event.prompt_tokens,
                cached_tokens=event.cached_tokens,
                generated_tokens=event.generated_tokens,
                timings=npb.Timings(
                    prompt_s=t.prompt_s,
                    generation_s=t.generation_s,
                    collective_s=t.collective_s,
                    queue_s=t.queue_s,
                ),
                counters=dict(event.counters),
            )
        )
    if isinstance(event, NodeError):
        return npb.GenerateEvent(error=_error_to_proto(event))
    raise ConvertError(f"not a generate event: {type(event).__name__}")


def generate_event_from_proto(msg: npb.GenerateEvent) -> GenerateEvent:
    from .records import GenerateDone, GeneratedTokens, Timings

    kind = msg.WhichOneof("event")
    if kind == "tokens":
        return GeneratedTokens(tuple(msg.tokens.ids))
    if kind == "done":
        d, t = msg.done, msg.done.timings
        return GenerateDone(
            finish_reason=_lookup(_FINISH_FROM_PB, d.finish_reason, "finish reason"),
            prompt_tokens=d.prompt_tokens,
            cached_tokens=d.cached_tokens,
            generated_tokens=d.generated_tokens,
            timings=Timings(t.prompt_s, t.generation_s, t.collective_s, t.queue_s),
            counters=dict(d.counters),
        )
    if kind == "error":
        return _error_from_proto(msg.error)
    raise ConvertError("GenerateEvent is empty (expected tokens, done or error)")


def cancel_request_to_proto(request_id: str, abort: bool = False) -> npb.CancelRequest:
    return npb.CancelRequest(request_id=request_id, abort=abort)


def cancel_request_from_proto(msg: npb.CancelRequest) -> str:
    if not msg.request_id:
        raise ConvertError("CancelRequest.request_id is empty")
    return msg.request_id


def cancel_is_abort(msg: npb.CancelRequest) -> bool:
    """The request failed elsewhere: its collective steps fail now (see node.proto)."""
    return msg.abort


def cancel_reply_to_proto(found: bool) -> npb.CancelReply:
    return npb.CancelReply(found=found)


def cancel_reply_from_proto(msg: npb.CancelReply) -> bool:
    return msg.found


def shutdown_request_to_proto(grace_s: float) -> npb.ShutdownRequest:
    return npb.ShutdownRequest(grace_s=grace_s)


def shutdown_request_from_proto(msg: npb.ShutdownRequest) -> float:
    return msg.grace_s


def health_request_to_proto() -> npb.HealthRequest:
    return npb.HealthRequest()


def status_request_to_proto() -> npb.StatusRequest:
    return npb.StatusRequest()


def shutdown_reply_to_proto() -> npb.ShutdownReply:
    return npb.ShutdownReply()


def health_to_proto(h: Health) -> npb.HealthReply:
    return npb.HealthReply(
        ok=h.ok, state=_lookup(_STATE_TO_PB, h.state, "node state"), reason=h.reason
    )


def health_from_proto(msg: npb.HealthReply) -> Health:
    from .records import Health

    return Health(msg.ok, _lookup(_STATE_FROM_PB, msg.state, "node state"), msg.reason)


def status_to_proto(s: NodeStatus) -> npb.NodeStatus:
    m = s.memory
    return npb.NodeStatus(
        state=_lookup(_STATE_TO_PB, s.state, "node state"),
        model=s.model,
        rank=s.rank,
        world_size=s.world_size,
        memory=npb.Memory(
            device_bytes=m.device_bytes,
            budget_bytes=m.budget_bytes,
            used_bytes=m.used_bytes,
            peak_bytes=m.peak_bytes,
        ),
        device=s.device,
        backend=s.backend,
        experts_per_layer=dict(s.experts_per_layer),
        counters=dict(s.counters),
        uptime_s=s.uptime_s,
        pid=s.pid,
        queue_depth=s.queue_depth,
        allreduce=npb.AllreduceHistogram(
            bounds=s.allreduce.bounds, counts=s.allreduce.counts, sum_s=s.allreduce.sum_s
        )
        if s.allreduce is not None
        else None,
        routing=[npb.LayerRouting(layer=r.layer, held=r.held, tokens=r.tokens) for r in s.routing],
        expert_cache=[npb.ExpertCacheLayer(**vars(c)) for c in s.expert_cache],
        route=s.route,
        route_us=dict(s.route_us),
        speculative=s.speculative,
        micro_batches=s.micro_batches,
        route_host_from=s.route_host_from,
        streams=s.streams,
        kv_bytes=s.kv_bytes,
        attention=s.attention,
    )


def status_from_proto(msg: npb.NodeStatus) -> NodeStatus:
    from .records import AllreduceHistogram, ExpertCacheLayer, LayerRouting, Memory, NodeStatus

    m, a = msg.memory, msg.allreduce
    return NodeStatus(
        state=_lookup(_STATE_FROM_PB, msg.state, "node state"),
        model=msg.model,
        rank=msg.rank,
        world_size=msg.world_size,
        memory=Memory(m.device_bytes, m.budget_bytes, m.used_bytes, m.peak_bytes),
        device=msg.device,
        backend=msg.backend,
        experts_per_layer={int(k): int(v) for k, v in sorted(msg.experts_per_layer.items())},
        counters=dict(sorted(msg.counters.items())),
        uptime_s=msg.uptime_s,
        pid=msg.pid,
        queue_depth=msg.queue_depth,
        allreduce=AllreduceHistogram(tuple(a.bounds), tuple(a.counts), a.sum_s)
        if msg.HasField("allreduce")
        else None,
        routing=tuple(LayerRouting(r.layer, tuple(r.held), tuple(r.tokens)) for r in msg.routing),
        expert_cache=tuple(
            ExpertCacheLayer(
                c.layer,
                c.capacity,
                c.local,
                c.hits,
                c.misses,
                c.bytes_read,
                c.read_seconds,
                c.prefetched,
                c.prefetch_hits,
                c.prefetch_bytes,
            )
            for c in msg.expert_cache
        ),
        route=msg.route,
        route_us=dict(sorted(msg.route_us.items())),
        speculative=msg.speculative,
        micro_batches=msg.micro_batches,
        route_host_from=msg.route_host_from,
        streams=msg.streams,
        kv_bytes=msg.kv_bytes,
        attention=msg.attention,
    )


# ---------------------------------------------------------------------------------------------
# Probe (the load-time check): float32 arrays as raw little-endian bytes


def _f32(shape, data: bytes, what: str):
    import numpy as np

    shape = tuple(int(d) for d in shape)
    if len(shape) != 2 or len(data) != 4 * shape[0] * shape[1]:
        raise UserError(f"{what}: {len(data)} bytes do not hold a float32 array of shape {shape}")
    return np.frombuffer(data, dtype="<f4").reshape(shape)


def probe_request_to_proto(layer: int, x) -> npb.ProbeRequest:
    import numpy as np

    x = np.ascontiguousarray(x, dtype="<f4")
    return npb.ProbeRequest(layer=layer, shape=list(x.shape), x=x.tobytes())


def probe_request_from_proto(msg: npb.ProbeRequest):
    """(layer, x (tokens, hidden) float32)."""
    return int(msg.layer), _f32(msg.shape, msg.x, "probe input")


def probe_reply_to_proto(y) -> npb.ProbeReply:
    import numpy as np

    y = np.ascontiguousarray(y, dtype="<f4")
    return npb.ProbeReply(shape=list(y.shape), y=y.tobytes())


def probe_reply_from_proto(msg: npb.ProbeReply):
    return _f32(msg.shape, msg.y, "probe reply")


# ---------------------------------------------------------------------------------------------
# Ship (proto/ship.proto): shards of a checkpoint only the coordinator holds


def catalog_request_to_proto(fingerprint: str):
    from . import ship_pb2 as spb

    return spb.CatalogRequest(fingerprint=fingerprint)


def catalog_reply_to_proto(catalog: bytes, data_port: int = 0, data_token: str = ""):
    from . import ship_pb2 as spb

    return spb.CatalogReply(catalog=catalog, data_port=data_port, data_token=data_token)


def catalog_reply_from_proto(msg) -> bytes:
    return msg.catalog


def data_channel_from_proto(msg) -> tuple[int, str]:
    """(port, token) of a CatalogReply's plain-TCP data channel; port 0 when it has none."""
    return msg.data_port, msg.data_token


def fetch_request_to_proto(spec):
    from . import ship_pb2 as spb

    return spb.FetchRequest(
        fingerprint=spec.fingerprint,
        blobs=list(spec.blobs),
        node=spec.node,
        first_offset=spec.first_offset,
        chunk_bytes=spec.chunk_bytes,
    )


def fetch_request_from_proto(msg):
    from .records import FetchSpec

    return FetchSpec(msg.fingerprint, tuple(msg.blobs), msg.node, msg.first_offset, msg.chunk_bytes)


def chunk_to_proto(blob: str, offset: int, data: bytes, crc32: int, last: bool, sha256: str = ""):
    from . import ship_pb2 as spb

    return spb.Chunk(blob=blob, offset=offset, data=data, crc32=crc32, last=last, sha256=sha256)


def chunk_from_proto(msg):
    from .records import ShipChunk

    return ShipChunk(
        msg.blob, msg.offset, msg.data, msg.crc32, msg.last, msg.sha256
    )  # each read of msg.data copies it: once


# --- bench link ------------------------------------------------------------------------------


def _seconds(pairs) -> list:
    return [npb.Seconds(size=size, seconds=list(s)) for size, s in pairs]


def _pairs(msgs) -> tuple:
    return tuple((m.size, tuple(m.seconds)) for m in msgs)


def link_listen_request_to_proto() -> npb.LinkListenRequest:
    return npb.LinkListenRequest()


def link_listen_to_proto(listen) -> npb.LinkListenReply:
    return npb.LinkListenReply(
        port=listen.port, token=listen.token, free_ports=list(listen.free_ports)
    )


def link_listen_from_proto(msg: npb.LinkListenReply):
    from .link import LinkListen

    return LinkListen(msg.port, bytes(msg.token), tuple(msg.free_ports))


def link_probe_request_to_proto(spec) -> npb.LinkProbeRequest:
    return npb.LinkProbeRequest(
        address=spec.address,
        token=spec.token,
        payload_bytes=list(spec.payload_bytes),
        iters=spec.iters,
        transfer_bytes=spec.transfer_bytes,
    )


def link_probe_request_from_proto(msg: npb.LinkProbeRequest):
    from .link import LinkProbeSpec

    if not msg.payload_bytes or msg.iters < 1:
        raise ConvertError(
            f"a link probe needs payload sizes and iters >= 1 (got {list(msg.payload_bytes)}, "
            f"{msg.iters})"
        )
    return LinkProbeSpec(
        msg.address, bytes(msg.token), tuple(msg.payload_bytes), msg.iters, msg.transfer_bytes
    )


def link_probe_reply_to_proto(result) -> npb.LinkProbeReply:
    return npb.LinkProbeReply(
        round_trips=_seconds(result.round_trips),
        transfer_bytes=result.transfer_bytes,
        transfer_s=result.transfer_s,
    )


def link_probe_reply_from_proto(msg: npb.LinkProbeReply):
    from .link import LinkProbeResult

    return LinkProbeResult(_pairs(msg.round_trips), msg.transfer_bytes, msg.transfer_s)


def link_allreduce_request_to_proto(spec) -> npb.LinkAllReduceRequest:
    return npb.LinkAllReduceRequest(
        transport=transport_to_proto(spec.transport),
        rank=spec.rank,
        hidden=spec.hidden,
        tokens=list(spec.tokens),
        iters=spec.iters,
        warmup=spec.warmup,
        timeout_s=spec.timeout_s,
        dtype=spec.dtype,
    )


def link_allreduce_request_from_proto(
    msg: npb.LinkAllReduceRequest, *, secret: str = "", tls: Any = None
):
    from .link import DTYPES, LinkAllReduceSpec

    dtype = msg.dtype or "bfloat16"
    if dtype not in DTYPES:
        raise ConvertError(f"a link all-reduce of dtype {dtype!r}: choose from {', '.join(DTYPES)}")
    if not msg.tokens or msg.iters < 1 or msg.hidden < 1:
        raise ConvertError(
            f"a link all-reduce needs tokens, hidden >= 1 and iters >= 1 (got "
            f"{list(msg.tokens)}, {msg.hidden}, {msg.iters})"
        )
    timeout_s = msg.timeout_s or 120.0
    return LinkAllReduceSpec(
        transport_from_proto(msg.transport, timeout_s=timeout_s, secret=secret, tls=tls),
        msg.rank,
        msg.hidden,
        tuple(msg.tokens),
        msg.iters,
        msg.warmup,
        timeout_s,
        dtype,
    )


def link_allreduce_reply_to_proto(result) -> npb.LinkAllReduceReply:
    return npb.LinkAllReduceReply(times=_seconds(result.times))


def link_allreduce_reply_from_proto(msg: npb.LinkAllReduceReply):
    from .link import LinkAllReduceResult

    return LinkAllReduceResult(_pairs(msg.times))

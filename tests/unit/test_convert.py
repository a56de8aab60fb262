"""Coordinator <-> node messages survive the trip through protobuf unchanged."""

from __future__ import annotations

from dataclasses import replace

import pytest

from moe_cluster.proto.records import Sampling
from moe_cluster.proto.records import (
    AllreduceHistogram,
    GenerateDone,
    GeneratedTokens,
    Health,
    LoadProgress,
    LoadSpec,
    Memory,
    ExpertCacheLayer,
    LayerRouting,
    NodeError,
    NodeStatus,
    Timings,
)
from moe_cluster.proto.placement import Placement
from moe_cluster.proto.records import GenerateRequest
from moe_cluster.node.collective.specs import EnvoySpec, MlxSpec
from moe_cluster.proto.records import TlsFiles
from moe_cluster.proto import convert
from moe_cluster.proto.errors import ErrorKind
from moe_cluster.proto import node_pb2


def wire(msg):
    """Serialize and parse again, as the other end sees it."""
    return type(msg).FromString(msg.SerializeToString())


PLACEMENT = Placement(2, {1: {0: (0, 1, 2), 1: (2, 3)}, 3: {0: (0, 1), 1: (2, 3)}})


def test_load_request_envoy():
    tls = TlsFiles("/etc/moe/envoy.pem", "/etc/moe/envoy.key", "/etc/moe/ca.pem")
    transport = EnvoySpec(
        ("10.0.0.1:7000", "10.0.0.2:7000"),
        secret="s",
        listen="0.0.0.0:7000",
        timeout_s=3.0,
        tls=tls,
        data_port=7001,
    )
    spec = LoadSpec("/models/dbrx", 1, 2, transport, PLACEMENT, "busy", 256, 8 << 30)
    back = convert.load_request_from_proto(
        wire(convert.load_request_to_proto(spec)), secret="s", tls=tls
    )
    assert back == spec
    adopting = replace(spec, adopt=True, orphan_after_s=7.5)
    assert (
        convert.load_request_from_proto(
            wire(convert.load_request_to_proto(adopting)), secret="s", tls=tls
        )
        == adopting
    )
    with pytest.raises(ValueError, match="orphan_after_s"):
        replace(spec, orphan_after_s=float("nan"))
    cached = LoadSpec(
        "/models/dbrx",
        1,
        2,
        transport,
        PLACEMENT,
        expert_cache="25%",
        max_batch=16,
        prefill_budget=64,
        kv_budget_bytes=1 << 30,
        heat=((1, (5.0, 0.0, 2.5, 1.0), 8), (3, (0.0, 1.0, 7.0, 0.0), 8)),
    )
    assert (
        convert.load_request_from_proto(
            wire(convert.load_request_to_proto(cached)), secret="s", tls=tls
        )
        == cached
    )
    with pytest.raises(ValueError, match="expert_cache"):
        LoadSpec("/models/dbrx", 1, 2, transport, PLACEMENT, expert_cache="half")
    forced = LoadSpec("/models/dbrx", 1, 2, transport, PLACEMENT, route="host")
    assert (
        convert.load_request_from_proto(
            wire(convert.load_request_to_proto(forced)), secret="s", tls=tls
        )
        == forced
    )
    with pytest.raises(ValueError, match="route"):
        LoadSpec("/models/dbrx", 1, 2, transport, PLACEMENT, route="fastest")
    whole = LoadSpec("/models/dbrx", 1, 2, transport, speculative="mtp", mtp_experts="whole")
    assert (
        convert.load_request_from_proto(
            wire(convert.load_request_to_proto(whole)), secret="s", tls=tls
        )
        == whole
    )
    with pytest.raises(ValueError, match="mtp_experts must be one of auto, whole, sharded"):
        LoadSpec("/models/dbrx", 1, 2, transport, mtp_experts="half")


def test_load_request_mlx_and_defaults():
    transport = MlxSpec((("10.0.0.1:5000",), ("10.0.0.2:5000", "10.0.1.2:5001")), timeout_s=5.0)
    spec = LoadSpec("/m", 0, 2, transport)
    back = convert.load_request_from_proto(wire(convert.load_request_to_proto(spec)))
    assert back == spec
    assert back.placement is None and back.keepalive == "lru" and back.prefill_step == 512


def test_load_request_jaccl():
    transport = MlxSpec(
        ((), ()),
        backend="jaccl",
        jaccl_coordinator="10.0.0.1:9000",
        jaccl_devices=((None, "rdma_en5"), ("rdma_en5", None)),
        timeout_s=5.0,
    )
    spec = LoadSpec("/m", 1, 2, transport)
    assert convert.load_request_from_proto(wire(convert.load_request_to_proto(spec))) == spec


def test_load_request_is_validated():
    msg = node_pb2.LoadRequest(model="/m", rank=2, world_size=2)
    with pytest.raises(convert.ConvertError, match="rank 2 is not below world_size 2"):
        convert.load_request_from_proto(msg)
    msg = node_pb2.LoadRequest(model="/m", rank=0, world_size=1)
    with pytest.raises(convert.ConvertError, match="transport is empty"):
        convert.load_request_from_proto(msg)
    msg.transport.envoy.peers.append("127.0.0.1:1")
    msg.transport.envoy.tls = True
    with pytest.raises(convert.ConvertError, match="no TLS files configured"):
        convert.load_request_from_proto(msg)
    bad = node_pb2.Placement(world_size=2)
    bad.layers[1].ranks[0].ids.extend([0, 1])
    bad.layers[1].ranks[5].ids.extend([2])
    with pytest.raises(ValueError, match="5"):
        convert.placement_from_proto(bad)


def test_secret_is_never_sent():
    spec = LoadSpec("/m", 0, 1, EnvoySpec(("127.0.0.1:1",), secret="hunter2-secret"))
    assert b"hunter2-secret" not in convert.load_request_to_proto(spec).SerializeToString()
    assert "hunter2-secret" not in repr(spec)


def test_load_progress():
    for p in (
        LoadProgress(10, 100, "experts"),
        LoadProgress(100, 100, "mesh", done=True),
        LoadProgress(
            5,
            100,
            "experts",
            done=True,
            error=NodeError(ErrorKind.INVALID_INPUT, "no such file", 1),
        ),
    ):
        assert convert.load_progress_from_proto(wire(convert.load_progress_to_proto(p))) == p


def test_generate_request():
    for sampling in (
        Sampling(64, 0.0, 1.0, None),
        Sampling(8, 0.7, 0.9, 1234),
        Sampling(8, 0.7, 0.9, 0),
        Sampling(8, 0.7, 0.9, 5, step=37),
    ):  # a resumed request's sampler goes on at its step
        req = GenerateRequest("req-1", (1, 2, 3), sampling, (2, 7), prefill_step=128)
        back = convert.generate_request_from_proto(
            wire(convert.generate_request_to_proto(req)), prefill_step=128
        )
        assert back == req
    with pytest.raises(convert.ConvertError, match="req-2 has an empty prompt"):
        convert.generate_request_from_proto(
            node_pb2.GenerateRequest(request_id="req-2", max_tokens=1)
        )
    with pytest.raises(convert.ConvertError, match="top_p must be in"):
        convert.generate_request_from_proto(
            node_pb2.GenerateRequest(request_id="r", prompt=[1], max_tokens=1, top_p=2)
        )


def test_generate_events():
    events = [
        GeneratedTokens((5,)),
        GeneratedTokens((5, 6, 7)),
        GenerateDone(
            "length", 12, 4, 32, Timings(0.5, 2.0, 0.3, 0.01), {"selected": 2.5, "computed": 2.65}
        ),
        GenerateDone("cancelled", 3, 0, 1),
        NodeError(ErrorKind.UNAVAILABLE, "rank 1 (10.0.0.2:7000) stalled", 0),
    ]
    for e in events:
        assert convert.generate_event_from_proto(wire(convert.generate_event_to_proto(e))) == e
    with pytest.raises(ValueError, match="finish_reason must be one of"):
        GenerateDone("bored", 1, 0, 1)


def test_status_health_cancel_shutdown():
    status = NodeStatus(
        "busy",
        "/models/dbrx",
        1,
        2,
        Memory(192 << 30, 150 << 30, 80 << 30, 90 << 30),
        "Apple M2 Ultra",
        "envoy",
        {1: 8, 3: 8},
        {"selected": 2.6},
        12.5,
        4242,
        3,
        AllreduceHistogram((25e-6, 1e-3), (7, 2, 1), 0.0125),
        (LayerRouting(1, (8, 9), (0, 3) + (1,) * 14), LayerRouting(3, (0, 15), (5,) * 16)),
    )
    assert convert.status_from_proto(wire(convert.status_to_proto(status))) == status
    cached = NodeStatus("ready", expert_cache=(ExpertCacheLayer(1, 4, 8, 30, 6, 6 << 20, 0.012),))
    assert convert.status_from_proto(wire(convert.status_to_proto(cached))) == cached
    routed = NodeStatus(
        "ready", route="device", route_us={"device": 120.5, "host": 250.0}, route_host_from=96
    )
    assert convert.status_from_proto(wire(convert.status_to_proto(routed))) == routed
    idle = NodeStatus("idle")
    assert (
        convert.status_from_proto(wire(convert.status_to_proto(idle))) == idle
    )  # no histogram before a load
    assert convert.health_from_proto(
        wire(convert.health_to_proto(Health(True, "ready")))
    ) == Health(True, "ready")
    assert (
        convert.cancel_request_from_proto(wire(convert.cancel_request_to_proto("req-9"))) == "req-9"
    )
    assert convert.cancel_reply_from_proto(wire(convert.cancel_reply_to_proto(True))) is True
    assert convert.shutdown_request_from_proto(wire(convert.shutdown_request_to_proto(2.5))) == 2.5
    with pytest.raises(ValueError, match="state must be one of"):
        Health(True, "sleepy")

"""The error hierarchy and its one table: every kind maps to HTTP and gRPC, and survives the wire."""

from __future__ import annotations

import grpc
import pytest

from moe_cluster.proto import convert
from moe_cluster.proto import errors
from moe_cluster.proto.errors import KINDS, ErrorKind, MoeClusterError, UserError
from moe_cluster.proto.records import LoadProgress, NodeError


def test_every_kind_has_one_http_status_openai_shape_and_grpc_code():
    assert set(KINDS) == set(ErrorKind)
    for kind, m in KINDS.items():
        assert 400 <= m.http < 600 and m.type and m.code, kind
        assert isinstance(m.grpc, grpc.StatusCode) and m.grpc is not grpc.StatusCode.OK, kind
    # gRPC codes are one per kind, so a node's code names its kind again at the coordinator
    assert len({m.grpc for m in KINDS.values()}) == len(KINDS)


@pytest.mark.parametrize("kind", list(ErrorKind))
def test_kinds_round_trip_through_grpc_codes_and_error_classes(kind):
    assert errors.kind_from_grpc(errors.grpc_code(kind)) is kind
    exc = errors.error_for(kind, "why")
    assert isinstance(exc, MoeClusterError) and exc.kind is kind and str(exc) == "why"
    assert isinstance(exc, UserError) == (kind in (ErrorKind.INVALID_INPUT, ErrorKind.NOT_FOUND))


def test_codes_we_never_send_are_internal_and_http_falls_back_by_class():
    assert errors.kind_from_grpc(grpc.StatusCode.UNKNOWN) is ErrorKind.INTERNAL
    assert errors.kind_from_grpc(None) is ErrorKind.INTERNAL
    assert errors.kind_from_http(503) is ErrorKind.UNAVAILABLE
    assert errors.kind_from_http(429) is ErrorKind.BUSY
    assert errors.kind_from_http(422) is ErrorKind.INVALID_INPUT
    assert errors.kind_from_http(502) is ErrorKind.INTERNAL


@pytest.mark.parametrize("kind", list(ErrorKind))
def test_node_error_kinds_survive_the_wire(kind):
    error = NodeError(kind, "message", 3)
    assert convert.generate_event_from_proto(convert.generate_event_to_proto(error)) == error
    progress = LoadProgress(0, 0, "failed", done=True, error=error)
    assert convert.load_progress_from_proto(convert.load_progress_to_proto(progress)) == progress


def test_an_error_with_no_kind_on_the_wire_reads_as_internal():
    from moe_cluster.proto import node_pb2

    msg = node_pb2.GenerateEvent(error=node_pb2.Error(message="old sender", rank=1))
    assert convert.generate_event_from_proto(msg) == NodeError(ErrorKind.INTERNAL, "old sender", 1)


def test_project_errors_have_the_kind_of_what_went_wrong():
    from moe_cluster.coordinator.plan.calibration import CalibrationError
    from moe_cluster.coordinator.plan.perfmodel import PlanError
    from moe_cluster.coordinator.serve.client import ClusterError
    from moe_cluster.coordinator.serve.requests import QueueFull
    from moe_cluster.coordinator.serve.config import ConfigError
    from moe_cluster.proto.frame import FrameError
    from moe_cluster.node.collective.link import LinkError
    from moe_cluster.node.collective.steps import StepError
    from moe_cluster.common.mdns import DiscoveryError
    from moe_cluster.proto.convert import ConvertError
    from moe_cluster.proto.placement import PlacementError

    for user in (
        CalibrationError,
        PlanError,
        ConfigError,
        PlacementError,
        ConvertError,
        DiscoveryError,
    ):
        assert issubclass(user, UserError) and issubclass(user, ValueError), user
    assert DiscoveryError.kind is ErrorKind.NOT_FOUND
    for down in (ClusterError, LinkError, StepError):
        assert down.kind is ErrorKind.UNAVAILABLE and not issubclass(down, UserError), down
    assert QueueFull.kind is ErrorKind.BUSY
    assert FrameError.kind is ErrorKind.INTERNAL


def test_node_side_errors_with_mlx():
    pytest.importorskip("mlx.core")
    from moe_cluster.node.checkpoint import CheckpointError
    from moe_cluster.node.collective.base import CollectiveError
    from moe_cluster.node.moe.load import ShardError

    assert issubclass(ShardError, CheckpointError) and issubclass(CheckpointError, UserError)
    assert CollectiveError.kind is ErrorKind.UNAVAILABLE

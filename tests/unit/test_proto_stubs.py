"""The committed gRPC stubs are what `python -m moe_cluster.proto.generate` makes from the .proto files."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

from moe_cluster.proto import generate

grpc_tools = pytest.importorskip(
    "grpc_tools", reason="grpcio-tools (the test extra) regenerates the stubs"
)

PROTO_DIR = Path(generate.__file__).parent
VERSION = re.compile(r"^GRPC_GENERATED_VERSION = '([^']+)'$", re.MULTILINE)


def test_stubs_are_fresh(tmp_path):
    written = generate.generate(tmp_path)
    assert sorted(p.name for p in written) == sorted(generate.generated_names())
    committed_version = VERSION.search((PROTO_DIR / "envoy_pb2_grpc.py").read_text()).group(1)
    fresh_version = VERSION.search((tmp_path / "envoy_pb2_grpc.py").read_text()).group(1)
    stale = []
    for name in generate.generated_names():
        if name.endswith(
            "_pb2.py"
        ):  # the descriptor: what the .proto says, whatever the tool version
            fresh = _descriptor_bytes(tmp_path / name)
            if (
                fresh
                != importlib.import_module(
                    f"moe_cluster.proto.{name[:-3]}"
                ).DESCRIPTOR.serialized_pb
            ):
                stale.append(name)
        if (
            committed_version == fresh_version
            and (tmp_path / name).read_text() != (PROTO_DIR / name).read_text()
        ):
            stale.append(name)
    assert not stale, (
        f"stale stubs {sorted(set(stale))}: run `python -m moe_cluster.proto.generate` and commit them"
    )


def _descriptor_bytes(path: Path) -> bytes:
    text = path.read_text()
    literal = re.search(r"AddSerializedFile\((b'.*?')\)\n", text, re.DOTALL).group(1)
    return eval(literal)  # noqa: S307 - a bytes literal protoc wrote


def test_generated_imports_are_package_relative():
    for name in generate.generated_names():
        text = (PROTO_DIR / name).read_text()
        assert not re.search(r"^import \w+_pb2", text, re.MULTILINE), (
            f"{name} has a top-level import of a stub"
        )

"""What a node must have loaded to be adopted by a new coordinator (node/adopt.py): everything its
load built must match; only the coordinator's own fields may differ."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from moe_cluster.node.adopt import SESSION_FIELDS, identity, mismatch
from moe_cluster.proto.placement import Placement
from moe_cluster.proto.records import LoadSpec, ShipSource
from moe_cluster.proto.transport import EnvoySpec, MlxSpec

ENVOY = EnvoySpec(("10.0.0.1:7701", "10.0.0.2:7701"), secret="s", timeout_s=5.0)
FP = "ab" * 32
LOADED = LoadSpec(
    "/models/m",
    1,
    2,
    ENVOY,
    Placement.even({0: 8, 1: 8}, 2),
    ship=ShipSource(FP, ":7702"),
    orphan_after_s=10.0,
)

# every field a load builds something from, with a value it may not differ by
DIFFERENT = {
    "model": "/models/other",
    "rank": 0,
    "world_size": 3,
    "transport": replace(ENVOY, addresses=("10.0.0.1:7701", "10.0.0.3:7701")),
    "placement": Placement.from_json(
        {"layers": {"0": {"0": [0], "1": list(range(1, 8))}, "1": {"0": [0], "1": [1]}}}, 2
    ),
    "keepalive": "busy",
    "prefill_step": 256,
    "prompt_cache_bytes": 1 << 20,
    "ship": ShipSource("cd" * 32, ":7702"),
    "expert_cache": "50%",
    "max_batch": 4,
    "prefill_budget": 64,
    "kv_budget_bytes": 1 << 30,
    "heat": ((0, (1.0,) * 8, 8),),
    "route": "host",
    "speculative": "prompt-lookup",
    "draft_tokens": 2,
    "draft_model": "/models/draft",
    "mtp_experts": "whole",
    "overlap": True,
    "attention": "by-stream",
}


def test_the_same_load_is_adopted_whatever_the_coordinator_says_of_itself():
    assert mismatch(LOADED, LOADED) == ""
    # a new coordinator's Ship service listens elsewhere, it may wait longer, and it adopts
    again = replace(LOADED, ship=ShipSource(FP, ":40123"), orphan_after_s=30.0, adopt=True)
    assert mismatch(LOADED, again) == ""


@pytest.mark.parametrize("field", sorted(DIFFERENT))
def test_any_other_difference_is_refused_and_named(field):
    why = mismatch(LOADED, replace(LOADED, **{field: DIFFERENT[field]}))
    assert why, field
    named = {"ship": "fingerprint", "transport": "transport", "world_size": "world_size"}
    assert named.get(field, field) in why


def test_every_field_is_either_checked_or_the_coordinators():
    import dataclasses

    fields = {f.name for f in dataclasses.fields(LoadSpec)}
    assert fields == set(DIFFERENT) | set(SESSION_FIELDS)


def test_another_transport_kind_and_the_secret_never_shown():
    mlx = MlxSpec((("10.0.0.1:5000",), ("10.0.0.2:5000",)), timeout_s=5.0)
    why = mismatch(LOADED, replace(LOADED, transport=mlx))
    assert "transport" in why and "secret" not in why and "'s'" not in why


def test_identity_is_the_files_as_they_stand(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"x" * 16)
    (tmp_path / "notes.txt").write_text("not read by a load")
    before = identity(tmp_path)
    assert [name for name, *_ in before] == ["config.json", "model.safetensors"]
    assert identity(tmp_path) == before
    (tmp_path / "notes.txt").write_text("changed")
    assert identity(tmp_path) == before
    st = (tmp_path / "model.safetensors").stat()
    os.utime(tmp_path / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert identity(tmp_path) != before  # rewritten in place, same size
    assert identity(tmp_path / "gone") == ()

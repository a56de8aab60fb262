"""Safetensors headers and byte-range reads: what is read, and clear errors for bad files."""

from __future__ import annotations

import json
import struct

import mlx.core as mx
import pytest

from moe_cluster.node.checkpoint import (
    Checkpoint,
    CheckpointError,
    read_header,
    read_tensor,
    write_checkpoint,
)


def _write_raw(path, header: dict, payload: bytes) -> None:
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + payload)


def test_rows_are_read_by_byte_range(tmp_path):
    w = mx.arange(4 * 3 * 5, dtype=mx.float32).reshape(4, 3, 5)
    b = (mx.arange(4 * 6, dtype=mx.float32).reshape(4, 6) / 7).astype(mx.bfloat16)
    write_checkpoint(tmp_path, {"w": w, "b": b}, {"model_type": "x"})
    ck = Checkpoint(tmp_path)
    assert mx.array_equal(read_tensor(ck.tensors["w"]), w)
    assert mx.array_equal(read_tensor(ck.tensors["w"], [1, 3]), w[mx.array([1, 3])])
    got = read_tensor(ck.tensors["b"], [2, 0])
    assert got.dtype == mx.bfloat16 and mx.array_equal(got, b[mx.array([2, 0])])


def test_split_into_shards_with_index(tmp_path):
    tensors = {f"t{i}": mx.ones((100,)) * i for i in range(6)}
    files = write_checkpoint(tmp_path, tensors, {"model_type": "x"}, max_shard_bytes=900)
    assert [f.name for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    ck = Checkpoint(tmp_path)
    assert all(mx.array_equal(read_tensor(ck.tensors[k]), v) for k, v in tensors.items())


def test_byte_range_not_matching_header(tmp_path):
    f = tmp_path / "model.safetensors"
    _write_raw(f, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, bytes(16))
    with pytest.raises(CheckpointError, match="does not match its header"):
        read_header(f)


def test_byte_range_past_end_of_file(tmp_path):
    f = tmp_path / "model.safetensors"
    _write_raw(f, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8))
    with pytest.raises(CheckpointError, match="past the end of the file"):
        read_header(f)


def test_overlapping_ranges(tmp_path):
    f = tmp_path / "model.safetensors"
    hdr = {
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
    }
    _write_raw(f, hdr, bytes(24))
    with pytest.raises(CheckpointError, match="overlap"):
        read_header(f)


def test_truncated_and_garbage_files(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="shorter than its header"):
        read_header(f)
    f.write_bytes(struct.pack("<Q", 4) + b"nope")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        read_header(f)


def test_folder_that_is_not_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        Checkpoint(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "mixtral"}')
    with pytest.raises(CheckpointError, match="no model.*safetensors"):
        Checkpoint(tmp_path)
    (tmp_path / "config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match="malformed"):
        Checkpoint(tmp_path)


def test_index_naming_missing_files(tmp_path):
    write_checkpoint(tmp_path, {"a": mx.zeros((3,))}, {"model_type": "x"})
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00009.safetensors"}})
    )
    with pytest.raises(CheckpointError, match="missing: model-00009"):
        Checkpoint(tmp_path)

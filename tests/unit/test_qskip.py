"""The quantized skip kernel's contract (node/moe/qskip.py) on the CPU: the kernel itself needs CUDA
(`moe-cluster bench expert-step` checks and times it against gather_qmm there); here its
reference, which unpacks the words as the kernel does, is held to gather_qmm, and the skipping
decode step with quantized experts to the host path."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

import cuda_emulator
from moe_cluster.node.moe import qskip
from moe_cluster.node.moe.experts import ExpertShard, ShardLinear, ShardState
from moe_cluster.proto.placement import Placement
from mlx_lm.models.switch_layers import SwitchGLU
from test_experts import D, E, _assert_steps_agree, _on_the_host

FORMATS = [
    ("affine", 4, 32),
    ("affine", 4, 64),
    ("affine", 4, 128),
    ("affine", 8, 32),
    ("affine", 8, 64),
    ("affine", 8, 128),
    ("mxfp4", 4, 32),
]


def _quantized(w: mx.array, mode: str, bits: int, group: int) -> qskip.QMatrix:
    q = mx.quantize(w, group_size=group, bits=bits, mode=mode)
    return qskip.QMatrix(
        q[0], q[1], q[2] if len(q) > 2 else None, {"group_size": group, "bits": bits, "mode": mode}
    )


@pytest.mark.parametrize("mode, bits, group", FORMATS)
def test_the_reference_unpacks_as_gather_qmm_reads(mode, bits, group):
    w = mx.random.normal((4, 24, 256), key=mx.random.key(1)) * 0.1
    q = _quantized(w, mode, bits, group)
    x = mx.random.normal((2, 256), key=mx.random.key(2))
    slots = mx.array([3, -1, 0, 2], dtype=mx.int32)
    for per_x, rows in ((2, x), (1, mx.concatenate([x, x[::-1]]))):
        got = qskip.reference(rows, q, slots, per_x)
        want = qskip.gather_qmm(rows, q, slots, per_x)
        np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-4)
        assert not np.array(got[1]).any()  # the skipped position: zeros


def test_a_wrong_unpacking_is_caught():
    """The check above can fail: values read high bits first give another matrix."""
    w = mx.random.normal((2, 8, 64), key=mx.random.key(1))
    q = _quantized(w, "affine", 4, 32)
    flipped = replace(q, weight=mx.array(np.array(q.weight).byteswap()))
    x, slots = mx.random.normal((1, 64), key=mx.random.key(2)), mx.array([1], dtype=mx.int32)
    got = qskip.reference(x, flipped, slots, 1)
    want = qskip.gather_qmm(x, q, slots, 1)
    assert np.abs(np.array(got) - np.array(want)).max() > 1e-2


def test_fits_takes_the_mlx_community_formats_only():
    w = mx.random.normal((2, 8, 128), key=mx.random.key(1)).astype(mx.bfloat16)
    for mode, bits, group in FORMATS:
        q = _quantized(w, mode, bits, group)
        assert qskip.fits(q), (mode, bits, group)
    q = _quantized(w.astype(mx.float32), "affine", 4, 64)  # float32 scales: gather_qmm keeps them
    assert not qskip.fits(q)
    q = _quantized(w, "affine", 3, 64)
    assert not qskip.fits(q)
    q = _quantized(w, "mxfp8", 8, 32)
    assert not qskip.fits(q)


def _quantized_shards(placement, keepalive, mode, bits, group, dtype=mx.float32):
    mx.random.seed(0)
    bank, world = SwitchGLU(D, 64, E), placement.world_size  # widths divisible by the groups
    out = []
    for rank in range(world):
        local = list(placement.layers[0][rank])
        idx = mx.array(local)
        projs = {}
        for p in ("gate_proj", "up_proj", "down_proj"):
            q = _quantized(getattr(bank, p).weight[idx].astype(dtype), mode, bits, group)
            projs[p] = ShardLinear(q.weight, scales=q.scales, biases=q.biases, quant=q.quant)
        out.append(
            ExpertShard(
                0,
                local,
                placement.holders(0, E),
                projs,
                "glu",
                bank.activation,
                ShardState(rank, world, keepalive),
            )
        )
    return out


@pytest.mark.parametrize(
    "mode, bits, group", [("affine", 4, 32), ("affine", 8, 32), ("mxfp4", 4, 32)]
)
@pytest.mark.parametrize("keepalive", ["none", "lru"])
def test_the_quantized_skipping_step_equals_the_host_path(
    mode, bits, group, keepalive, monkeypatch
):
    monkeypatch.setattr(qskip, "qskip", qskip.reference)
    placement = Placement.even({0: E}, 2)
    skipping = _quantized_shards(placement, keepalive, mode, bits, group)
    host = _on_the_host(_quantized_shards(placement, keepalive, mode, bits, group))
    for s in skipping:
        s.use_skip(
            mx.float32
        )  # what enable_skip_gemv does where the check passes (CUDA, bf16/f16 only)
        s.set_route("skip")
    _assert_steps_agree(skipping, host, seed=3, atol=1e-4)


def test_enable_takes_quantized_bfloat16_experts_where_the_check_passes(monkeypatch):
    placement = Placement.even({0: E}, 2)
    monkeypatch.setattr(qskip, "check", lambda *a: None)  # as on a GPU where the kernel matches
    shard = _quantized_shards(placement, "none", "affine", 4, 32, dtype=mx.bfloat16)[0]
    assert (
        shard.enable_skip_gemv() is None and shard.route == "skip" and shard.routes()[0] == "skip"
    )
    monkeypatch.setattr(qskip, "check", lambda *a: "differs from gather_qmm (relative 0.5)")
    shard = _quantized_shards(placement, "none", "affine", 4, 32, dtype=mx.bfloat16)[0]
    assert "differs from gather_qmm" in shard.enable_skip_gemv() and shard.routes() == (
        "device",
        "host",
    )
    shard = _quantized_shards(placement, "none", "affine", 4, 32)[0]  # float32 scales: gather_qmm
    assert "float32" in shard.enable_skip_gemv() and shard.route == "device"


def _bits(a: mx.array) -> np.ndarray:
    """An array's raw bits as numpy (bfloat16 as uint16)."""
    return np.array(a.view(mx.uint16)) if a.dtype == mx.bfloat16 else np.array(a)


@pytest.mark.needs(
    None if cuda_emulator.AVAILABLE else "no g++ to build the emulated kernel",
    "apt-get install g++",
)
@pytest.mark.parametrize(
    "mode, bits, group", [("affine", 4, 64), ("affine", 8, 128), ("mxfp4", 4, 32)]
)
@pytest.mark.parametrize("per_x", [4, 1])  # gate/up: k positions share a row; down: a row each
def test_the_cuda_source_run_on_the_host_matches_gather_qmm(mode, bits, group, per_x, tmp_path):
    """The kernel's own source (compiled for the host, cuda_emulator.py) against gather_qmm in
    float32 on the same bfloat16 inputs: within a bfloat16 rounding of the output, zeros where skipped."""
    e, d_out, d_in, k = 4, 6, 1280, 4  # 1280: lanes that take one chunk and lanes that take two
    q = _quantized(
        (mx.random.normal((e, d_out, d_in), key=mx.random.key(1)) * 0.05).astype(mx.bfloat16),
        mode,
        bits,
        group,
    )
    x = mx.random.normal((k // per_x, d_in), key=mx.random.key(2)).astype(mx.bfloat16)
    slots = mx.array([e - 1, -1, 0, e // 2], dtype=mx.int32)
    scale_t = "uint8_t" if mode == "mxfp4" else "__nv_bfloat16"
    biases = q.biases if q.biases is not None else q.scales
    got = cuda_emulator.run(
        qskip._HEADER,
        qskip._SOURCE,
        {
            "x": ("__nv_bfloat16", _bits(x)),
            "w": ("uint32_t", np.array(q.weight)),
            "scales": (scale_t, _bits(q.scales)),
            "biases": (scale_t, _bits(biases)),
            "slots": ("int32_t", np.array(slots)),
        },
        {
            "D_IN": d_in,
            "D_OUT": d_out,
            "PER_X": per_x,
            "BITS": bits,
            "GROUP": group,
            "MX": int(mode == "mxfp4"),
        },
        k,
        d_out,
        tmp_path,
    )
    want = np.array(qskip.gather_qmm(x, q, slots, per_x, float32=True))
    assert not got[1].any()  # the skipped position: nothing read, zeros
    assert (
        np.abs(got - want).max() <= 2**-8 * np.abs(want).max()
    )  # a bfloat16 rounding of the largest
    ref = np.array(qskip.reference(x, q, slots, per_x).astype(mx.float32))
    np.testing.assert_array_equal(
        got, ref
    )  # the CPU tests' reference is the kernel, to the bit here

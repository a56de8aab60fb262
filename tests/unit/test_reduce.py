"""node/collective/reduce.py gives the bytes MLX's own float32 sum-and-cast gives, for every dtype
and rank count, with _sum.c's bfloat16 sum and with numpy's (an install without a C compiler)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from conftest import native_sum
from moe_cluster.node.collective.reduce import DTYPES, Reducer, from_float32, to_float32


@pytest.fixture(params=["native", "numpy"])
def reduce_sum(request) -> Reducer:
    """Every test here runs on both bfloat16 paths (the others have one)."""
    if request.param == "native":
        native_sum()  # skips where the install could not build it
    reducer = Reducer(native=request.param == "native")
    assert reducer.native_sums("bfloat16") == (request.param == "native")
    return reducer


MX = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}


def mlx_sum(parts: list[np.ndarray], dtype: str) -> np.ndarray:
    """What a node would compute with MLX: float32 accumulation in rank order, cast back."""
    arrays = [mx.array(p).view(MX[dtype]) if dtype == "bfloat16" else mx.array(p) for p in parts]
    acc = arrays[0].astype(mx.float32)
    for a in arrays[1:]:
        acc = acc + a.astype(mx.float32)
    out = acc.astype(MX[dtype])
    return np.array(out.view(mx.uint16) if dtype == "bfloat16" else out)


def random_payload(rng: np.random.Generator, dtype: str, n: int, special: bool) -> np.ndarray:
    """Raw payloads: every bit pattern (NaNs, infinities, subnormals) if `special`, else typical values."""
    if special:
        bits = rng.integers(0, 2 ** (8 * DTYPES[dtype].itemsize), n, dtype=np.uint64)
        raw = bits.astype(np.uint32 if dtype == "float32" else np.uint16)
        return raw.view(DTYPES[dtype]) if dtype != "bfloat16" else raw
    x = (rng.standard_normal(n) * 3).astype(np.float32)
    if dtype == "float32":
        return x
    if dtype == "float16":
        return x.astype(np.float16)
    return np.array(mx.array(x).astype(mx.bfloat16).view(mx.uint16))


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint32 if a.itemsize == 4 else np.uint16)


def assert_same_bytes(ours: np.ndarray, ref: np.ndarray, dtype: str, msg: str = "") -> None:
    """Every bit equal; for float16/float32, a NaN's sign and payload may differ (IEEE leaves
    which operand's NaN an addition returns to the implementation). bfloat16 NaNs are canonical."""
    if dtype == "bfloat16":
        np.testing.assert_array_equal(bits(ours), bits(ref), err_msg=msg)
        return
    nan = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(ours), nan, err_msg=msg)
    np.testing.assert_array_equal(bits(ours)[~nan], bits(ref)[~nan], err_msg=msg)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("special", [False, True])
def test_bit_identical_to_mlx(dtype, ranks, special, reduce_sum):
    rng = np.random.default_rng(ranks * 10 + special)
    for n in (1, 7, 6144, 3 * 6144 + 5):
        parts = [random_payload(rng, dtype, n, special) for _ in range(ranks)]
        with np.errstate(all="ignore"):
            ours = reduce_sum(parts, dtype)
        assert ours.dtype == DTYPES[dtype]
        assert_same_bytes(ours, mlx_sum(parts, dtype), dtype, f"{dtype} x{ranks} n={n}")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_the_float32_sum_is_the_reduction_before_its_rounding(dtype, ranks):
    """sum_float32 (the ride's slots are summed so) rounded by MLX gives the reduction's bytes,
    every bit pattern included."""
    rng = np.random.default_rng(ranks)
    for special in (False, True):
        parts = [random_payload(rng, dtype, 3 * 6144 + 5, special) for _ in range(ranks)]
        with np.errstate(all="ignore"):
            wide = Reducer().sum_float32(parts, dtype, np.empty(parts[0].size, np.float32))
        rounded = mx.array(wide).astype(MX[dtype])
        rounded = np.array(rounded.view(mx.uint16) if dtype == "bfloat16" else rounded)
        assert_same_bytes(rounded, mlx_sum(parts, dtype), dtype, f"ranks {ranks} special {special}")


def test_overflow_to_infinity_and_then_nan(reduce_sum):
    big = np.array(
        mx.array([3e38, -3e38, 3e38], dtype=mx.float32).astype(mx.bfloat16).view(mx.uint16)
    )
    infinities = np.array([0xFF80, 0x7F80, 0x0000], dtype=np.uint16)  # -inf, +inf, 0
    parts = [big, big, infinities]  # -> [inf - inf, -inf + inf, inf]: NaN, NaN, inf
    with np.errstate(all="ignore"):
        ours = reduce_sum(parts, "bfloat16")
    np.testing.assert_array_equal(ours, mlx_sum(parts, "bfloat16"))
    np.testing.assert_array_equal(ours, [0x7FC0, 0x7FC0, 0x7F80])


def test_out_buffer_and_scratch_reuse(reduce_sum):
    rng = np.random.default_rng(0)
    r = reduce_sum
    for n in (6144, 10, 20000, 6144):  # shrink and grow the scratch
        parts = [random_payload(rng, "bfloat16", n, False) for _ in range(3)]
        out = np.empty(n, np.uint16)
        assert r(parts, "bfloat16", out) is out
        np.testing.assert_array_equal(out, mlx_sum(parts, "bfloat16"))


def test_helpers_agree_with_the_reducer(reduce_sum):
    rng = np.random.default_rng(5)
    for dtype in DTYPES:
        parts = [random_payload(rng, dtype, 4096, True) for _ in range(2)]
        with np.errstate(all="ignore"):
            acc = to_float32(parts[0], dtype).copy()
            acc += to_float32(parts[1], dtype)
            assert_same_bytes(from_float32(acc, dtype), reduce_sum(parts, dtype), dtype)


def test_native_sum_checks_its_buffers():
    built = native_sum()
    a, out = np.zeros(8, np.uint16), np.zeros(8, np.uint16)
    with pytest.raises(ValueError, match="part 1 overlaps out"):
        built.bfloat16(out, [a, out])
    with pytest.raises(ValueError, match="part 1 holds 6 bytes, out 16"):
        built.bfloat16(out, [a, a[:3]])
    with pytest.raises(ValueError, match="0 parts"):
        built.bfloat16(out, [])
    with pytest.raises(TypeError, match="sequence of buffers"):
        built.bfloat16(out, 5)
    with pytest.raises(ValueError, match="not C-contiguous"):
        built.bfloat16(out, [a, np.zeros(16, np.uint16)[::2]])  # not contiguous


def test_rejects_bad_input(reduce_sum):
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        reduce_sum([np.zeros(3, np.int8)], "int8")
    with pytest.raises(ValueError, match="partial 1 has 2 values, partial 0 has 3"):
        reduce_sum([np.zeros(3, np.float32), np.zeros(2, np.float32)], "float32")

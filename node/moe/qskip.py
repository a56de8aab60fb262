"""skip_gemv for quantized experts on CUDA: the decode step reads only this node's experts.

The device-routed step at N > 1 (kernels.py `Gather`) sends the positions another node
computes to a local slot and zeroes them; `gather_qmm` then reads one expert per position, k per
node per layer, what one device reads alone. This kernel takes each position's slot, or -1 for a
position computed elsewhere, and returns zeros there without reading anything, as skip_gemv.py does
for bfloat16/float16 weights; the formats are mlx-community's:

- affine, 4 or 8 bits, groups of 32, 64 or 128: `weight` (E, out, in·bits/32) uint32, values low
  bits first; `scales`, `biases` (E, out, in/group) in the activations' dtype; w = scale·q + bias;
- mxfp4: `weight` as 4-bit affine, each value an e2m1 float (sign in bit 3); `scales` (E, out,
  in/32) uint8, a power of two 2^(s − 127) (e8m0); no biases.

One warp per output feature, each lane one 16-byte load of packed weights (32 values at 4 bits, 16
at 8: inside one group, so one scale and bias a load), weights dequantized and multiplied in float32
and summed in float32, a warp reduction, one rounding to the output dtype: what gather_qmm computes,
summed in another order, so within a rounding or two of the output dtype, not bitwise (the load-time
check's bound). bfloat16/float16 activations only, as skip_gemv: float32 keeps gather_qmm.

Used where it applies (CUDA, the formats above, no expert bias) and where the check at load against
gather_qmm at the weight's own shape passes; `route: device` in cluster.yaml keeps it off.
`moe-cluster bench expert-step` times it against gather_qmm per format and per m.
"""

from __future__ import annotations

from dataclasses import dataclass

from typing import Mapping

import mlx.core as mx

from . import skip_gemv

_WARPS = skip_gemv._WARPS
AFFINE_BITS = (4, 8)
AFFINE_GROUPS = (32, 64, 128)

_HEADER = (
    skip_gemv._HEADER
    + r"""
__device__ __forceinline__ float fp4_e2m1(unsigned int q) {
  const float v[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  return (q & 8u) ? -v[q & 7u] : v[q & 7u];
}
// A scale as a float, by its type: affine's in the activations' dtype, mxfp4's an e8m0 power of
// two. Overloads, not conversions: the branch a format does not take still compiles.
__device__ __forceinline__ float affine_scale(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float affine_scale(__half v) { return __half2float(v); }
__device__ __forceinline__ float affine_scale(unsigned char) { return 0.0f; }
__device__ __forceinline__ float mx_scale(unsigned char s) {
  return __uint_as_float(s == 0 ? 0x400000u : ((unsigned int)s << 23));
}
__device__ __forceinline__ float mx_scale(__nv_bfloat16) { return 0.0f; }
__device__ __forceinline__ float mx_scale(__half) { return 0.0f; }
"""
)

# x: (rows, D_IN) T; w: (experts, D_OUT, D_IN * BITS / 32) uint32; scales, biases: (experts, D_OUT,
# D_IN / GROUP) (mxfp4: uint8 scales, biases unused); slots: (positions,) int32, -1: computed elsewhere;
# y: (positions, D_OUT) T. Position r reads input row r / PER_X, as skip_gemv.
_SOURCE = (
    r"""
  constexpr int PER_WORD = 32 / BITS;
  constexpr int CHUNK = 4 * PER_WORD;  // values in one 16-byte load
  constexpr int WORDS = D_IN / PER_WORD;
  constexpr int GROUPS = D_IN / GROUP;
  constexpr unsigned int MASK = (1u << BITS) - 1u;
"""
    + skip_gemv.POSITION
    + r"""
  if (s >= 0) {
    const size_t row = (size_t)s * D_OUT + o;
    const unsigned int* wr = w + row * WORDS;
    const T* xr = x + (size_t)(r / PER_X) * D_IN;
    for (int i = lane * CHUNK; i < D_IN; i += 32 * CHUNK) {
      const uint4 u = *reinterpret_cast<const uint4*>(wr + i / PER_WORD);
      const unsigned int words[4] = {u.x, u.y, u.z, u.w};
      float xs[CHUNK];
#pragma unroll
      for (int j = 0; j < CHUNK; j += 8) load8(xr + i + j, xs + j);
      const int g = i / GROUP;
      if (MX) {
        const float sc = mx_scale(scales[row * GROUPS + g]);
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
          for (int b = 0; b < PER_WORD; b++)
            acc += (fp4_e2m1((words[j] >> (BITS * b)) & MASK) * sc) * xs[j * PER_WORD + b];
      } else {
        const float sc = affine_scale(scales[row * GROUPS + g]);
        const float bi = affine_scale(biases[row * GROUPS + g]);
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
          for (int b = 0; b < PER_WORD; b++)
            acc += (sc * (float)((words[j] >> (BITS * b)) & MASK) + bi) * xs[j * PER_WORD + b];
      }
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
  }
  if (lane == 0) y[(size_t)r * D_OUT + o] = static_cast<T>(acc);
"""
)

_kernel = None
_checked: dict[tuple, str | None] = {}  # (mode, bits, group, dtype, shape) -> check()'s answer


def available() -> bool:
    """CUDA here and the skip kernels not turned off (skip_gemv.available)."""
    return skip_gemv.available()


@dataclass(frozen=True)
class QMatrix:
    """A quantized expert bank as gather_qmm takes it: (experts, out, in·bits/32) uint32 words,
    their scales and biases (None for mxfp4), and the quantization (mode, bits, group_size)."""

    weight: mx.array
    scales: mx.array
    biases: mx.array | None
    quant: Mapping

    @classmethod
    def of(cls, p) -> "QMatrix":
        """A ShardLinear's (node/moe/kernels.py)."""
        return cls(p.weight, p.scales, p.get("biases"), p.quant)


def fits(m: QMatrix) -> bool:
    """Whether a quantized (experts, out, in·bits/32) weight can take this kernel: affine 4/8-bit
    with groups of 32/64/128 and bfloat16/float16 scales and biases, or mxfp4 (uint8 scales)."""
    weight, scales, biases, quant = m.weight, m.scales, m.biases, m.quant
    if not quant or weight.ndim != 3 or weight.dtype != mx.uint32:
        return False
    mode, bits, group = quant.get("mode", "affine"), quant.get("bits"), quant.get("group_size")
    if mode == "affine":
        return (
            bits in AFFINE_BITS
            and group in AFFINE_GROUPS
            and biases is not None
            and scales.dtype in (mx.bfloat16, mx.float16)
            and biases.dtype == scales.dtype
        )
    return mode == "mxfp4" and bits == 4 and group == 32 and scales.dtype == mx.uint8


def qskip(x: mx.array, m: QMatrix, slots: mx.array, per_x: int) -> mx.array:
    """(positions, out): position r is x[r // per_x] through expert slots[r]'s quantized matrix
    (transposed, as gather_qmm's transpose=True), zeros where slots[r] < 0 (nothing read for it).
    x (rows, in) bfloat16/float16; slots (positions,) int32."""
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(
            name="moe_cluster_qskip",
            input_names=["x", "w", "scales", "biases", "slots"],
            output_names=["y"],
            source=_SOURCE,
            header=_HEADER,
        )
    weight, scales, biases, quant = m.weight, m.scales, m.biases, m.quant
    mode, bits, group = quant.get("mode", "affine"), quant["bits"], quant["group_size"]
    positions, d_out, d_in = slots.shape[0], weight.shape[1], x.shape[-1]
    blocks = -(-d_out // _WARPS)
    (y,) = _kernel(
        inputs=[x, weight, scales, biases if biases is not None else scales, slots],
        template=[
            ("T", x.dtype),
            ("D_IN", d_in),
            ("D_OUT", d_out),
            ("PER_X", per_x),
            ("BITS", bits),
            ("GROUP", group),
            ("MX", int(mode == "mxfp4")),
        ],
        grid=(blocks * 32 * _WARPS, positions, 1),
        threadgroup=(32 * _WARPS, 1, 1),
        output_shapes=[(positions, d_out)],
        output_dtypes=[x.dtype],
    )
    return y


def reference(x: mx.array, m: QMatrix, slots: mx.array, per_x: int) -> mx.array:
    """qskip's contract in plain MLX ops, unpacking the words as the kernel does (tests run it on
    the CPU against gather_qmm: the packing, the groups and mxfp4's scales as the kernel reads them)."""
    weight, scales, biases, quant = m.weight, m.scales, m.biases, m.quant
    mode, bits, group = quant.get("mode", "affine"), quant["bits"], quant["group_size"]
    per_word = 32 // bits
    src = mx.maximum(slots, 0)
    words = weight[src]  # (positions, out, in / per_word)
    shifts = mx.arange(per_word, dtype=mx.uint32) * bits
    q = ((words[..., None] >> shifts) & ((1 << bits) - 1)).reshape(
        *words.shape[:2], -1
    )  # (positions, out, in)
    if mode == "mxfp4":
        table = mx.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
        vals = mx.where((q & 8) > 0, -table[q & 7], table[q & 7])
        s = scales[src].astype(mx.uint32)
        scale = mx.where(s == 0, 2.0**-127, mx.power(2.0, s.astype(mx.float32) - 127))
        w = vals.reshape(*q.shape[:2], -1, group) * scale[..., None]
    else:
        w = (
            scales[src].astype(mx.float32)[..., None]
            * q.reshape(*q.shape[:2], -1, group).astype(mx.float32)
            + biases[src].astype(mx.float32)[..., None]
        )
    w = w.reshape(q.shape)
    rows = x[mx.arange(slots.shape[0]) // per_x].astype(mx.float32)
    y = (w @ rows[:, :, None])[:, :, 0]
    return mx.where((slots >= 0)[:, None], y, mx.zeros_like(y)).astype(x.dtype)


def check(m: QMatrix) -> str | None:
    """Why the kernel cannot stand in for gather_qmm on this weight here (None: it can), as
    skip_gemv.check: compiled and compared at the weight's own shape, once per format and shape."""
    weight, scales, quant = m.weight, m.scales, m.quant
    key = (
        quant.get("mode", "affine"),
        quant["bits"],
        quant["group_size"],
        scales.dtype,
        *weight.shape,
    )
    if key not in _checked:
        _checked[key] = _check(m)
    return _checked[key]


def _check(m: QMatrix) -> str | None:
    """Against gather_qmm in float32 on the same quantized weights: what both roundings approximate
    (MLX's CPU gather_qmm, summing bfloat16 in bfloat16, is itself ~5% off that on 1280-wide rows)."""
    dtype = m.scales.dtype if m.scales.dtype != mx.uint8 else mx.bfloat16  # mxfp4: bfloat16 x
    return skip_gemv.compare(
        lambda rows, slots, per_x: qskip(rows, m, slots, per_x),
        lambda rows, slots, per_x: gather_qmm(rows, m, slots, per_x, float32=True),
        m.weight.shape[0],
        m.weight.shape[-1] * 32 // m.quant["bits"],
        dtype,
        "gather_qmm",
    )


def gather_qmm(
    x: mx.array, m: QMatrix, slots: mx.array, per_x: int, float32: bool = False
) -> mx.array:
    """What the device route computes for the same positions: gather_qmm, one expert read per
    position (slot 0 for a skipped one), zeros where slots < 0; `float32`: with the activations,
    scales and biases in float32 (the sum the kernel's float32 accumulation approximates)."""
    weight, scales, biases, quant = m.weight, m.scales, m.biases, m.quant
    if float32:
        x, scales, biases = (
            a if a is None or a.dtype == mx.uint8 else a.astype(mx.float32)
            for a in (x, scales, biases)
        )
    src = x[mx.arange(slots.shape[0]) // per_x][:, None, :]
    y = mx.gather_qmm(
        src,
        weight,
        scales,
        biases,
        rhs_indices=mx.maximum(slots, 0).astype(mx.uint32),
        transpose=True,
        group_size=quant["group_size"],
        bits=quant["bits"],
        mode=quant.get("mode", "affine"),
    )[:, 0, :]
    return mx.where((slots >= 0)[:, None], y, mx.zeros_like(y))

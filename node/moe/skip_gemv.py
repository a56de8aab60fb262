"""The decode step's expert matmuls on CUDA, skipping the positions another node computes.

At N > 1 the device-routed step (kernels.py `Gather`) keeps fixed shapes: each of a
token's k positions goes through some local slot and the positions another node computes are zeroed
afterwards. MLX's `gather_mm` on CUDA then reads one expert matrix per position, duplicates included,
so a node read k experts per layer — what one GPU holding every expert reads — and expert parallelism
saved no bytes at batch 1 (DBRX at N = 2 over NCCL ran at 0.72× one GPU).

This kernel takes each position's slot, or -1 for a position computed elsewhere, and returns zeros
for the latter without reading anything: a node reads the experts its own positions select, about
E[n] of them, with the same fixed shapes and no host read. One warp per output feature: 16-byte loads
along the (contiguous) input dimension, float32 accumulation, a warp reduction, one rounding to the
output dtype — what `gather_mm` computes, summed in another order.

Used by default where it applies (CUDA, unquantized bfloat16/float16 weights without bias, the
input width a multiple of 8) and where a check at load time against `gather_mm` passes; elsewhere,
or where cluster.yaml's `route:` forces another route, the step keeps `gather_mm`. Not for
float32, where a cluster must give stock mlx-lm's logits within 1e-4: summed in its own order, the
kernel put longcat_flash's tiny float32 model 3.2e-4 away at N = 2 on an H100 (the family sweep,
tests/families), where gather_mm stays within 1e-4. bfloat16 tokens part from stock's within a few
steps on either path (each node's partial is rounded before the sum).

Measured at N = 2, one GPU per node: 1.36x gather_mm's decode on the DBRX shape and 1.61x on 12
layers of the Qwen3-30B-A3B shape; on all 48 layers runs of either swing 2x on one host, the
kernel ahead by median (59.7 against 53.2 tok/s), and a one-process 48-layer chain ran it 1.27x
gather_mm under every CUDA-graph setting (docs/performance.md; `moe-cluster bench expert-step`
times the kernel alone against the experts a node computes).
"""

from __future__ import annotations

import mlx.core as mx

from ..device import on_cuda

_WARPS = 4  # per block: 128 threads, one output feature per warp

_HEADER = r"""
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float* v) {
  uint4 u = *reinterpret_cast<const uint4*>(p);
  unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int i = 0; i < 4; i++) {
    v[2 * i] = __uint_as_float(w[i] << 16);
    v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ void load8(const __half* p, float* v) {
  uint4 u = *reinterpret_cast<const uint4*>(p);
  const __half2* h = reinterpret_cast<const __half2*>(&u);
#pragma unroll
  for (int i = 0; i < 4; i++) {
    float2 f = __half22float2(h[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}
"""

# x: (rows of input, D_IN); w: (experts, D_OUT, D_IN); slots: (positions,) int32, -1: computed
# elsewhere; y: (positions, D_OUT). Position r reads input row r / PER_X (k positions share a token's
# row for the first projections; the last one has a row per position).
# One warp per (output feature o, position r), slot s; the kernels of qskip.py start alike.
POSITION = r"""
  const int lane = threadIdx.x & 31;
  const int o = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int r = blockIdx.y;
  if (o >= D_OUT) return;
  const int s = slots[r];
  float acc = 0.0f;
"""
_SOURCE = (
    POSITION
    + r"""
  if (s >= 0) {
    const T* wr = w + ((size_t)s * D_OUT + o) * D_IN;
    const T* xr = x + (size_t)(r / PER_X) * D_IN;
#pragma unroll 4
    for (int i = lane * 8; i < D_IN; i += 256) {
      float a[8], b[8];
      load8(wr + i, a);
      load8(xr + i, b);
#pragma unroll
      for (int j = 0; j < 8; j++) acc += a[j] * b[j];
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
  }
  if (lane == 0) y[(size_t)r * D_OUT + o] = static_cast<T>(acc);
"""
)

_kernel = None
_checked: dict[
    tuple, str | None
] = {}  # (dtype, experts, out, in) -> check()'s answer: one per shape


def available() -> bool:
    """MLX has a CUDA device here."""
    return on_cuda()


def fits(weight: mx.array) -> bool:
    """Whether a (experts, out, in) weight can take this kernel."""
    return (
        weight.ndim == 3 and weight.dtype in (mx.bfloat16, mx.float16) and weight.shape[-1] % 8 == 0
    )


def skip_gemv(x: mx.array, w: mx.array, slots: mx.array, per_x: int) -> mx.array:
    """(positions, out): position r is x[r // per_x] @ w[slots[r]].T, or zeros where slots[r] < 0
    (nothing of w read for it). x (rows, in) in w's dtype; slots (positions,) int32."""
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(
            name="moe_cluster_skip_gemv",
            input_names=["x", "w", "slots"],
            output_names=["y"],
            source=_SOURCE,
            header=_HEADER,
        )
    positions, (_, d_out, d_in) = slots.shape[0], w.shape
    blocks = -(-d_out // _WARPS)
    (y,) = _kernel(
        inputs=[x, w, slots],
        template=[("T", w.dtype), ("D_IN", d_in), ("D_OUT", d_out), ("PER_X", per_x)],
        grid=(blocks * 32 * _WARPS, positions, 1),
        threadgroup=(32 * _WARPS, 1, 1),
        output_shapes=[(positions, d_out)],
        output_dtypes=[w.dtype],
    )
    return y


def check(w: mx.array) -> str | None:
    """Why the kernel cannot stand in for gather_mm on weight `w` here (None: it can): compiled and
    compared with gather_mm at the weight's own shape, with two input rows shared by two positions
    each (one of them skipped) and with a row per position. Asked once per dtype and shape: every
    layer's projections of a model share a few."""
    key = (w.dtype, *w.shape)
    if key not in _checked:
        _checked[key] = _check(w)
    return _checked[key]


def _check(w: mx.array) -> str | None:
    wt = w.swapaxes(-1, -2)

    def gather(rows, slots, per_x):
        src = rows[mx.arange(slots.shape[0]) // per_x][:, None, :]
        return mx.gather_mm(src, wt, rhs_indices=mx.maximum(slots, 0).astype(mx.uint32))[:, 0, :]

    return compare(
        lambda rows, slots, per_x: skip_gemv(rows, w, slots, per_x),
        gather,
        w.shape[0],
        w.shape[-1],
        w.dtype,
        "gather_mm",
    )


def compare(kernel, reference, experts: int, d_in: int, dtype: mx.Dtype, name: str) -> str | None:
    """Why `kernel(rows, slots, per_x)` cannot stand in for `reference` (the same, reading one expert
    per position; None: it can), with two input rows shared by two positions each (one skipped)
    and with a row per position. Also qskip's check."""
    try:
        x = (mx.random.normal((2, d_in), key=mx.random.key(0)) * 0.5).astype(dtype)
        slots = mx.array([0, -1, experts - 1, experts // 2], dtype=mx.int32)
        errs, zero = [], 0.0
        # bfloat16 keeps 8 bits: outputs summed in another order differ by a rounding or two
        tol = {mx.bfloat16: 2e-2, mx.float16: 4e-3}[dtype]
        for per_x, rows in ((2, x), (1, mx.concatenate([x, x[::-1]]))):
            got = kernel(rows, slots, per_x).astype(mx.float32)
            want = reference(rows, slots, per_x).astype(mx.float32)
            keep = mx.array([0, 2, 3])
            scale = mx.maximum(mx.abs(want[keep]).max(), 1e-6)
            errs.append(float((mx.abs(got[keep] - want[keep]).max() / scale).item()))
            zero = max(zero, float(mx.abs(got[1]).max().item()))
    except Exception as exc:  # noqa: BLE001 - a compiler or driver that cannot build it: keep the reference
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    if zero != 0.0 or not max(errs) <= tol:
        return f"differs from {name} (relative {max(errs):.3g}, skipped row {zero:.3g})"
    return None

"""Run a warp-per-output CUDA kernel source of node/moe (skip_gemv.py, qskip.py) on the host: the
source compiled with g++ under a few shims (bfloat16 as its bits, uint4, the thread indices), one
thread at a time, the warp's shuffle reduction replayed (lanes 31..1 first, lane 0 adding their
sums), bfloat16 only. What it checks: the kernel's indexing, unpacking and dequantization, on a
machine without a GPU; not its speed, nor the order of its float32 sum."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np

AVAILABLE = shutil.which("g++") is not None

_SHIM = r"""
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <vector>
#define __device__
#define __forceinline__ inline
struct __nv_bfloat16 {
  uint16_t b;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) { uint32_t u; memcpy(&u, &f, 4); u += 0x7fff + ((u >> 16) & 1); b = u >> 16; }
};
struct __half { uint16_t b; };
struct __half2 { __half x, y; };
struct float2 { float x, y; };
static inline float2 __half22float2(__half2) { return {0, 0}; }
static inline float __half2float(__half) { return 0; }
static inline float __bfloat162float(__nv_bfloat16 v) { uint32_t u = (uint32_t)v.b << 16; float f; memcpy(&f, &u, 4); return f; }
struct uint4 { unsigned int x, y, z, w; };
static inline float __uint_as_float(unsigned int u) { float f; memcpy(&f, &u, 4); return f; }
struct dim3 { int x, y, z; };
static dim3 threadIdx, blockIdx, blockDim;
static float lane_acc[32];
static inline float __shfl_down_sync(unsigned, float v, int off) {
  const int lane = threadIdx.x & 31;
  if (lane != 0) { if (off == 16) lane_acc[lane] = v; return 0.0f; }
  if (off != 16) return 0.0f;
  float s = 0; for (int i = 1; i < 32; i++) s += lane_acc[i]; return s;
}
"""

_MAIN = r"""
template <typename T, TEMPLATE>
void body(SIGNATURE) {
SOURCE
}
template <typename V> static std::vector<V> read(FILE* f) {
  uint64_t n; fread(&n, 8, 1, f); std::vector<V> v(n); fread(v.data(), sizeof(V), n, f); return v;
}
int main(int argc, char** argv) {
  FILE* f = fopen(argv[1], "rb");
  int positions, d_out; fread(&positions, 4, 1, f); fread(&d_out, 4, 1, f);
READS
  fclose(f);
  std::vector<__nv_bfloat16> y((size_t)positions * d_out, __nv_bfloat16(12345.0f));
  blockDim = {128, 1, 1};
  for (int by = 0; by < positions; by++) for (int bx = 0; bx < (d_out + 3) / 4; bx++)
    for (int warp = 0; warp < 4; warp++) for (int lane = 31; lane >= 0; lane--) {
      blockIdx = {bx, by, 0}; threadIdx = {warp * 32 + lane, 0, 0};
      body<__nv_bfloat16, ARGS>(CALL, y.data());
    }
  fwrite(y.data(), 2, y.size(), stdout);
}
"""


def run(
    header: str,
    source: str,
    inputs: dict[str, tuple[str, np.ndarray]],
    template: dict[str, int | bool],
    positions: int,
    d_out: int,
    tmp: Path,
) -> np.ndarray:
    """(positions, d_out) float32: the kernel `source` (one output feature per warp, 4 warps a block,
    grid (blocks, positions)) over `inputs` {name: (C type, array)}, in order, with integer or bool
    `template` values; its output `y` is bfloat16, as T."""
    kinds = {k: ("bool" if isinstance(v, bool) else "int") for k, v in template.items()}
    main = (
        _MAIN.replace("TEMPLATE", ", ".join(f"{kinds[k]} {k}" for k in template))
        .replace(
            "SIGNATURE",
            ", ".join(f"const {c}* {n}" for n, (c, _) in inputs.items()) + ", __nv_bfloat16* y",
        )
        .replace("SOURCE", source)
        .replace("READS", "\n".join(f"  auto {n}_ = read<{c}>(f);" for n, (c, _) in inputs.items()))
        .replace("ARGS", ", ".join(str(v).lower() for v in template.values()))
        .replace("CALL", ", ".join(f"{n}_.data()" for n in inputs))
    )
    (tmp / "k.cpp").write_text(_SHIM + header + main)
    subprocess.run(
        ["g++", "-O1", "-std=c++17", "-w", str(tmp / "k.cpp"), "-o", str(tmp / "k")], check=True
    )
    with open(tmp / "in.bin", "wb") as f:
        f.write(np.array([positions, d_out], dtype=np.int32).tobytes())
        for _, a in inputs.values():
            f.write(
                np.array([a.size], dtype=np.uint64).tobytes() + np.ascontiguousarray(a).tobytes()
            )
    out = subprocess.run(
        [str(tmp / "k"), str(tmp / "in.bin")], capture_output=True, check=True
    ).stdout
    bits = np.frombuffer(out, dtype=np.uint16).astype(np.uint32) << 16
    return bits.view(np.float32).reshape(positions, d_out)

#!/usr/bin/env bash
# Install moe-cluster and MLX's CUDA backend on a GPU host that has no registry access.
# Usage: scripts/gpu/setup.sh WHEEL_DIR...   (the wheels, downloaded elsewhere with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_35_x86_64 \
#     mlx==0.32.4 mlx-cuda-13==0.32.4 mlx-lm==0.32.2 grpcio==1.85.1 protobuf==7.36.2 zeroconf==0.154.0 ifaddr
#  The mlx-cuda-13 wheel (~90 MB) is over one device call's 64 MiB: split it (split -b 46M) into parts
#  named in mlxcuda.parts, with the whole wheel's sha256sum line in mlxcuda.sha256, and carry the parts
#  in separate calls: each call's copies are kept in /tmp/wheels while the machine stays warm.)
# Installs once every part has arrived and the joined wheel matches its checksum; until then it
# says which parts are missing and exits 3. Afterwards: export PYTHONPATH=/tmp/site
# A WHEEL_DIR may also hold ptx.tgz, MLX's CUDA kernel cache from an earlier host (there, once no
# process is building a kernel: tar czf ptx.tgz -C /tmp/mlx .): a first run then builds no kernel it
# already has; the cache is per card architecture and MLX version. MLX's CUDA backend
# builds each kernel with NVRTC the first time a graph needs it; the quantized matmuls' are CUTLASS
# templates that take tens of seconds each, minutes in all on a fresh host.
set -euo pipefail
SITE=/tmp/site
W=/tmp/wheels
mkdir -p "$W" "$SITE"
for d in "$@"; do cp -n "$d"/* "$W"/ 2>/dev/null || true; done
if [ -f "$W/ptx.tgz" ]; then
  mkdir -p /tmp/mlx && tar xzf "$W/ptx.tgz" -C /tmp/mlx && rm "$W/ptx.tgz" \
    && echo "setup: MLX's kernel cache restored: $(find /tmp/mlx -name '*.ptx' | wc -l) kernels"
fi
if [ -f "$W/mlxcuda.parts" ]; then
  missing=""
  for p in $(cat "$W/mlxcuda.parts"); do [ -f "$W/$p" ] || missing="$missing $p"; done
  if [ -n "$missing" ]; then echo "setup: waiting for$missing (carry them in the next call)"; exit 3; fi
  (cd "$W" && cat $(cat mlxcuda.parts) > "$(awk '{print $2}' mlxcuda.sha256)" && sha256sum -c mlxcuda.sha256) \
    || { echo "setup: the joined mlx-cuda-13 wheel does not match its checksum"; exit 1; }
  (cd "$W" && rm -f $(cat mlxcuda.parts) mlxcuda.parts mlxcuda.sha256)
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$W"/*.whl
# moe-cluster itself, from this checkout (no build isolation: the host's setuptools builds it)
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target "$SITE" .
PYTHONPATH="$SITE" python3 -c "import mlx.core as mx, moe_cluster.node.moe.load; print('mlx', mx.__version__, mx.default_device())"

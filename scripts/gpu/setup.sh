#!/usr/bin/env bash
# Install moe-cluster and MLX's CUDA backend on a GPU host that has no registry access.
# Usage: scripts/gpu/setup.sh WHEEL_DIR...   (the wheels, downloaded elsewhere with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_35_x86_64 \
#     mlx==0.32.4 mlx-cuda-13==0.32.4 mlx-lm==0.32.2 grpcio==1.85.1 protobuf==7.36.2 zeroconf==0.154.0 ifaddr
#  mlx-cuda-13 may arrive split in parts named mlxcuda.part.*; they are joined here.)
# Afterwards: export PYTHONPATH=/tmp/site
set -euo pipefail
SITE=/tmp/site
mkdir -p /tmp/wheels "$SITE"
for d in "$@"; do cp -n "$d"/* /tmp/wheels/ 2>/dev/null || true; done
if ls /tmp/wheels/mlxcuda.part.* >/dev/null 2>&1; then
  cat /tmp/wheels/mlxcuda.part.* > /tmp/wheels/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
  rm /tmp/wheels/mlxcuda.part.*
fi
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" /tmp/wheels/*.whl
# moe-cluster itself, from this checkout (no build isolation: the host's setuptools builds it)
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target "$SITE" .
PYTHONPATH="$SITE" python3 -c "import mlx.core as mx, moe_cluster.node.moe.load; print('mlx', mx.__version__, mx.default_device())"

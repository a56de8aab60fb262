#!/usr/bin/env bash
# Keep MLX's CUDA kernel cache (/tmp/mlx/<version>/ptx, or MLX_PTX_CACHE_DIR's) for the next host:
# packed into OUT/ptx.tgz, which comes back with the call's files; carry its folder to the next
# host's scripts/gpu/setup.sh (e.g. mkdir .ptx && cp ptx.tgz .ptx/; setup.sh .ptx). The kernels are
# built for the card's architecture (sm_90a for H100 and H200 alike) and MLX's version names the
# folder, so a cache from another version is simply not read.
#   bash scripts/gpu/ptx_save.sh "$OUT"
set -eu
OUT=${1:?usage: ptx_save.sh OUT}
if [ -n "${MLX_PTX_CACHE_DIR:-}" ]; then
  echo "ptx_save: MLX_PTX_CACHE_DIR is set; this keeps only /tmp/mlx" >&2
fi
[ -d /tmp/mlx ] || { echo "ptx_save: no /tmp/mlx on this host (no kernel built yet)"; exit 0; }
tar czf "$OUT/ptx.tgz" -C /tmp/mlx .
echo "ptx_save: $(find /tmp/mlx -name '*.ptx' | wc -l) kernels, $(du -h "$OUT/ptx.tgz" | cut -f1) in $OUT/ptx.tgz"

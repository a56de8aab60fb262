#!/usr/bin/env bash
# The race rows still missing on a 4-GPU host (issue 33), in one background run that outlives the
# device's 10-minute calls (poll it with short calls that copy OUT back):
#   -. the bare collective inside a graph of 94 layers (collective_probe.py; PROBE=0 skips it);
#   0. ours' DeepSeek-V3 row at a few layers under variants of the node's kernels (DIAG_*, below);
#   1. the DeepSeek-V3 shape (MLA; the fewest layers one GPU does not hold) at N = 4, every row;
#   2. the Qwen3-235B-A22B shape (94 layers) at N = 4: ours over NCCL, mlx-lm's pipeline and
#      tensor parallelism; then ours over NCCL at N = 2.
# Each model is removed after its rows (the disk does not hold both). OUT/DONE at the end.
#   setsid bash scripts/gpu/race_session.sh /tmp/race-session > /tmp/race-session.log 2>&1 < /dev/null &
# Env: PYTHONPATH=/tmp/site (scripts/gpu/setup.sh); STREAMS (1,8); MAX_TOKENS (16); DIAG_VARIANTS
#      (default skip device blocking; empty: none; also skip0, host), DIAG_LAYERS (6); DSV3_ROWS,
#      Q4_ROWS, Q2_ROWS (the rows of each step; empty skips it); MODELS_ROOT (/tmp).
set -u
OUT=${1:-/tmp/race-session}
mkdir -p "$OUT"
export STREAMS=${STREAMS:-1,8} MAX_TOKENS=${MAX_TOKENS:-16} PYTHONUNBUFFERED=1
ROOT=${MODELS_ROOT:-/tmp}
stage() { echo "=== $(date +%T) $*" | tee -a "$OUT/session.log"; }
stage "start: $(nproc) cores, $(nvidia-smi -L 2>/dev/null | wc -l) GPUs, disk free $(df -h --output=avail "$ROOT" | tail -n1)"
if [ "${PROBE:-1}" != 0 ]; then
  stage "collective probe: N = 2, 4, 94 layers, hidden 4096"
  timeout 300 python3 scripts/gpu/collective_probe.py > "$OUT/collective.jsonl" 2> "$OUT/collective.err" \
    || stage "collective probe: exit $?"
  cat "$OUT/collective.jsonl"
fi
# ours' DeepSeek-V3 rows crashed once (an illegal memory access on one node): first the same row at
# DIAG_LAYERS layers under each variant of the node's kernels, and the full rows then run under the
# first variant that passed ("default" where it did). DIAG_VARIANTS empty: no bisection.
variant_env() {
  case $1 in
    default) echo "" ;;
    skip0) echo "MOE_CLUSTER_SKIP_GEMV=0" ;;  # gather_qmm where the quantized skip kernel ran
    host | device | skip) echo "MOE_CLUSTER_ROUTE=$1" ;;
    # every launch waits for its kernel: a fault that then goes away is a race between the host
    # and the device; one that stays is reported at the launch that made it
    blocking) echo "CUDA_LAUNCH_BLOCKING=1" ;;
    *) echo "unknown variant $1" >&2; return 1 ;;
  esac
}
ours_env=""
variants=${DIAG_VARIANTS-default skip device blocking}
if [ -n "$variants" ]; then
  chosen=""
  for v in $variants; do
    stage "DeepSeek-V3 shape at ${DIAG_LAYERS:-6} layers, N = 4, ours_envoy, variant $v"
    env $(variant_env "$v") SHAPE_NAME=deepseek-v3 NODES=4 ROWS=ours_envoy LAYERS=${DIAG_LAYERS:-6} \
      MODELS_ROOT="$ROOT/diag" bash scripts/gpu/race_run.sh "$OUT/diag-$v" || stage "diag $v: exit $?"
    if [ -f "$OUT/diag-$v/race-4-ours_envoy.json" ] && ! grep -q '"error"' "$OUT/diag-$v/race-4-ours_envoy.json"; then
      stage "diag $v: passed"
      [ -z "$chosen" ] && [ "$v" != blocking ] && chosen=$v  # blocking launches: a diagnosis only
    else
      stage "diag $v: failed"
    fi
  done
  rm -rf "$ROOT/diag"
  ours_env=$(variant_env "${chosen:-default}")
  stage "ours' full rows run with: ${ours_env:-the default kernels} (first passing variant: ${chosen:-none})"
fi
rows=${DSV3_ROWS-ours_mlx mlx_lm_pipeline mlx_lm_tensor ours_envoy}
if [ -n "$rows" ]; then
  stage "DeepSeek-V3 shape, N = 4: $rows"
  ours=$(printf '%s\n' $rows | grep '^ours' | tr '\n' ' ')
  peers=$(printf '%s\n' $rows | grep -v '^ours' | tr '\n' ' ')
  if [ -n "$ours" ]; then
    echo "${ours_env:-(default kernels)}" > "$OUT/dsv3-ours.env"
    env $ours_env SHAPE_NAME=deepseek-v3 NODES=4 ROWS="$ours" bash scripts/gpu/race_run.sh "$OUT/dsv3" || stage "dsv3 ours: exit $?"
  fi
  if [ -n "$peers" ]; then
    SHAPE_NAME=deepseek-v3 NODES=4 ROWS="$peers" bash scripts/gpu/race_run.sh "$OUT/dsv3" || stage "dsv3 peers: exit $?"
  fi
  rm -rf "$ROOT/deepseek-v3-4bit"
fi
rows=${Q4_ROWS-ours_mlx mlx_lm_pipeline mlx_lm_tensor}
if [ -n "$rows" ]; then
  stage "Qwen3-235B shape, N = 4: $rows"
  NODES=4 ROWS="$rows" bash scripts/gpu/race_run.sh "$OUT/qwen3" || stage "qwen3 N = 4: exit $?"
fi
rows=${Q2_ROWS-ours_mlx}
if [ -n "$rows" ]; then
  stage "Qwen3-235B shape, N = 2: $rows"
  NODES=2 ROWS="$rows" bash scripts/gpu/race_run.sh "$OUT/qwen3" || stage "qwen3 N = 2: exit $?"
fi
stage done
touch "$OUT/DONE"

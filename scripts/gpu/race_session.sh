#!/usr/bin/env bash
# The race rows still missing on a 4-GPU host (issue 33), in one background run that outlives the
# device's 10-minute calls (poll it with short calls that copy OUT back):
#   1. the DeepSeek-V3 shape (MLA; the fewest layers one GPU does not hold) at N = 4, every row;
#   2. the Qwen3-235B-A22B shape (94 layers) at N = 4: ours over NCCL, mlx-lm's pipeline and
#      tensor parallelism; then ours over NCCL at N = 2.
# Each model is removed after its rows (the disk does not hold both). OUT/DONE at the end.
#   setsid bash scripts/gpu/race_session.sh /tmp/race-session > /tmp/race-session.log 2>&1 < /dev/null &
# Env: PYTHONPATH=/tmp/site (scripts/gpu/setup.sh); STREAMS (1,8); MAX_TOKENS (16); DSV3_ROWS,
#      Q4_ROWS, Q2_ROWS (the rows of each step; empty skips it); MODELS_ROOT (/tmp).
set -u
OUT=${1:-/tmp/race-session}
mkdir -p "$OUT"
export STREAMS=${STREAMS:-1,8} MAX_TOKENS=${MAX_TOKENS:-16} PYTHONUNBUFFERED=1
ROOT=${MODELS_ROOT:-/tmp}
stage() { echo "=== $(date +%T) $*" | tee -a "$OUT/session.log"; }
stage "start: $(nproc) cores, $(nvidia-smi -L 2>/dev/null | wc -l) GPUs, disk free $(df -h --output=avail "$ROOT" | tail -n1)"
rows=${DSV3_ROWS-ours_mlx mlx_lm_pipeline mlx_lm_tensor ours_envoy}
if [ -n "$rows" ]; then
  stage "DeepSeek-V3 shape, N = 4: $rows"
  SHAPE_NAME=deepseek-v3 NODES=4 ROWS="$rows" bash scripts/gpu/race_run.sh "$OUT/dsv3" || stage "dsv3: exit $?"
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

#!/usr/bin/env bash
# skip_gemv on GPUs: the kernel probe, then per model `bench decode` at N = 1, 2 (one GPU per node
# where the host has two) with skip_gemv (the default on CUDA), and N = 2 over `transport: mlx`
# with it off (MOE_CLUSTER_SKIP_GEMV=0: gather_mm) in the same session. In the background:
#   setsid bash scripts/gpu/skip_run.sh /tmp/skip > /tmp/skip.log 2>&1 < /dev/null &
# Env: PYTHONPATH=/tmp/site (scripts/gpu/setup.sh); MODELS (default "dbrx qwen3-30b-a3b:12"), ROUNDS (2).
set -u
OUT=${1:-/tmp/skip}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
F="python3 scripts/gpu/figures.py"
stage() { echo "=== $(date +%T) $*"; }
stage probe
python3 scripts/gpu/skip_probe.py > "$OUT/skip_probe.jsonl" 2> "$OUT/skip_probe.err"; cat "$OUT/skip_probe.jsonl"; tail -3 "$OUT/skip_probe.err"
for spec in ${MODELS-dbrx qwen3-30b-a3b:12}; do
  m=${spec%%:*}
  layers=$([ "$m" != "$spec" ] && echo "--layers ${spec#*:}")
  stage "build $spec"
  $F build --model "$m" $layers || continue
  stage "bench $spec, skip_gemv"
  MOE_CLUSTER_SKIP_GEMV=1 $F bench --model "$m" --nodes 1,2 --transport mlx,envoy --max-tokens 32 --rounds "${ROUNDS:-2}" --out "$OUT"
  stage "bench $spec, gather_mm (skip_gemv off), N = 2 over mlx"
  MOE_CLUSTER_SKIP_GEMV=0 python3 -m moe_cluster.coordinator.cli bench decode --model "${MODELS_ROOT:-/tmp}/$m" --nodes 2 \
    --keepalive none --transport mlx --gpus --max-tokens 32 --rounds "${ROUNDS:-2}" --json > "$OUT/$m-gather.json" \
    2> "$OUT/$m-gather.err"; tail -c 600 "$OUT/$m-gather.json"; echo
  rm -rf "${MODELS_ROOT:-/tmp}/$m"  # room for the next model
done
stage done
touch "$OUT/DONE"

#!/usr/bin/env bash
# Every GPU figure in one background job (device calls last 10 minutes at most; this outlives them):
#   setsid bash scripts/gpu/run_all.sh /tmp/figs > /tmp/figs.log 2>&1 < /dev/null &
# then poll /tmp/figs.log and copy /tmp/figs/* out; /tmp/figs/DONE appears at the end.
# Stages, in this order (each model is built once, into MODELS_ROOT or /tmp, and kept while the disk holds it):
#   PROBE=0       skip what MLX's CUDA build offers (probe.json)
#   TP_PROBE=1    mlx-lm tensor parallel on the demo model per backend and stream (tp.jsonl)
#   ALLREDUCE=1   bench allreduce on the host's CPU cores
#   DISTINCT=0    skip the distinct-experts probe
#   MEMORY="m.."  memory_probe.py --no-stock on these models first (memory against MLX's limit, decode tok/s)
#   MODELS="m.."  bench decode of each (default both; NAME:LAYERS overrides the layer count), NODES (default 1,2);
#                 N1=1 runs n1_probe.py before each bench; the package is reinstalled from this checkout
#                 first, so a later device call's copy of the tree takes effect at the next bench
#   SERVE="m.."   bench serve --gpus at 1 and 8 concurrent streams on these models
# Env: PYTHONPATH=/tmp/site (scripts/gpu/setup.sh).
set -u
OUTDIR=${1:-/tmp/figs}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1
F="python3 scripts/gpu/figures.py"
ROOT=${MODELS_ROOT:-/tmp}
stage() { echo "=== $(date +%T) $*"; }
reinstall() {
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target /tmp/site . \
    > /dev/null 2>&1 || echo "reinstall failed: the installed package stays"
}
[ "${PROBE:-1}" != 0 ] && { stage probe; $F probe --out "$OUTDIR"; }
[ -n "${TP_PROBE:-}" ] && { stage tp probe; python3 scripts/gpu/tp_probe.py > "$OUTDIR/tp.jsonl" 2> "$OUTDIR/tp.err"; cat "$OUTDIR/tp.jsonl"; }
[ -n "${ALLREDUCE:-}" ] && { stage allreduce; $F allreduce --out "$OUTDIR"; }
[ "${DISTINCT:-1}" != 0 ] && { stage distinct; python3 scripts/gpu/distinct_probe.py > "$OUTDIR/distinct.jsonl"; }
for m in ${MEMORY:-}; do
  stage "memory $m"
  $F build --model "$m" && python3 scripts/gpu/memory_probe.py "$ROOT/$m" --no-stock \
    > "$OUTDIR/$m-memory.jsonl" 2> "$OUTDIR/$m-memory.err"
  cat "$OUTDIR/$m-memory.jsonl"; tail -3 "$OUTDIR/$m-memory.err"
done
for spec in ${MODELS-qwen3-30b-a3b dbrx}; do
  m=${spec%%:*}
  layers=$([ "$m" != "$spec" ] && echo "--layers ${spec#*:}")
  stage "bench $spec"
  reinstall
  $F build --model "$m" $layers && \
    { [ -z "${N1:-}" ] || python3 scripts/gpu/n1_probe.py "$ROOT/$m" > "$OUTDIR/$m-n1.json" 2> "$OUTDIR/$m-n1.err" || true; } && \
    $F bench --model "$m" --nodes "${NODES:-1,2}" --transport mlx,envoy --max-tokens "${MAX_TOKENS:-32}" \
      --rounds "${ROUNDS:-1}" --out "$OUTDIR"
done
for m in ${SERVE:-}; do
  stage "serve $m"
  reinstall
  $F build --model "$m" && python3 -m moe_cluster.coordinator.cli bench serve --model "$ROOT/$m" --nodes "${NODES:-1,2}" \
    --concurrency 1,8 --requests 2 --max-tokens "${MAX_TOKENS:-32}" --gpus --json > "$OUTDIR/$m-serve.json" \
    2> "$OUTDIR/$m-serve.err"
  tail -c 1500 "$OUTDIR/$m-serve.json"; tail -5 "$OUTDIR/$m-serve.err"
done
stage done
touch "$OUTDIR/DONE"

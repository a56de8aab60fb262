#!/usr/bin/env bash
# Every GPU figure in one background job (device calls last 10 minutes at most; this outlives them):
#   setsid bash scripts/gpu/run_all.sh /tmp/figs > /tmp/figs.log 2>&1 < /dev/null &
# then poll /tmp/figs.log and copy /tmp/figs/* out; /tmp/figs/DONE appears at the end.
# Env: PYTHONPATH=/tmp/site (scripts/gpu/setup.sh), MODELS (default both; NAME:LAYERS overrides a model's
# layer count), NODES (default 1,2), ALLREDUCE=1 to run bench allreduce on the host's CPUs too,
# PROBE=0 to skip the backends probe, DISTINCT=0 to skip the distinct-experts probe, N1=1 to run n1_probe.py on each model before its bench,
# MEMORY=1 to run memory_probe.py (stock then ours: memory against MLX's limit, decode tok/s) on each model before its bench.
set -u
OUTDIR=${1:-/tmp/figs}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1
F="python3 scripts/gpu/figures.py"
[ "${PROBE:-1}" != 0 ] && $F probe --out "$OUTDIR"
[ -n "${ALLREDUCE:-}" ] && $F allreduce --out "$OUTDIR"
[ "${DISTINCT:-1}" != 0 ] && python3 scripts/gpu/distinct_probe.py > "$OUTDIR/distinct.jsonl"
for spec in ${MODELS:-qwen3-30b-a3b dbrx}; do
  m=${spec%%:*}
  layers=$([ "$m" != "$spec" ] && echo "--layers ${spec#*:}")
  $F build --model "$m" $layers && \
    { [ -z "${MEMORY:-}" ] || python3 scripts/gpu/memory_probe.py "${MODELS_ROOT:-/tmp}/$m" > "$OUTDIR/$m-memory.jsonl" 2> "$OUTDIR/$m-memory.err" || true; } && \
    { [ -z "${N1:-}" ] || python3 scripts/gpu/n1_probe.py "${MODELS_ROOT:-/tmp}/$m" > "$OUTDIR/$m-n1.json" 2> "$OUTDIR/$m-n1.err" || true; } && \
    $F bench --model "$m" --nodes "${NODES:-1,2}" --transport mlx,envoy --max-tokens "${MAX_TOKENS:-32}" \
      --rounds "${ROUNDS:-1}" --out "$OUTDIR"
done
touch "$OUTDIR/DONE"

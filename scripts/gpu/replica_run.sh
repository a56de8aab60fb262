#!/usr/bin/env bash
# Replicated experts at N = 2 on one GPU (two node processes): scripts/replica_probe.py with this
# checkout's code and, alternating, with another checkout's installed under OLD_SITE (e.g. the
# commit before routing.ArrayRule, whose nodes read the routing on the host wherever a layer has
# replicas). One JSON line per run in OUT/<model>.jsonl.
# Env: PYTHONPATH=/tmp/site (scripts/gpu/setup.sh); OLD_SITE; MODELS ("demo qwen3-30b-a3b:12");
#      KEEPALIVES ("none lru"); PAIRS (3); GPUS=1: node r on GPU r (a host with two), NCCL.
set -u
OUT=${1:-/tmp/replica}
mkdir -p "$OUT"
for spec in ${MODELS-demo qwen3-30b-a3b:12}; do
  m=${spec%%:*}
  path=$PWD/node/demo/model  # the same files for both sides
  if [ "$m" != demo ]; then
    layers=$([ "$m" != "$spec" ] && echo "--layers ${spec#*:}")
    echo "=== $(date +%T) build $spec"
    python3 scripts/gpu/figures.py build --model "$m" $layers || continue
    path=${MODELS_ROOT:-/tmp}/$m
  fi
  for k in ${KEEPALIVES-none lru}; do
    for i in $(seq "${PAIRS:-3}"); do
      for side in new old; do
        [ "$side" = old ] && [ -z "${OLD_SITE:-}" ] && continue
        pp=$PYTHONPATH
        [ "$side" = old ] && pp=$OLD_SITE:$PYTHONPATH
        PYTHONPATH=$pp python3 scripts/replica_probe.py --model "$path" --keepalive "$k" --max-tokens 32 --rounds 2 \
          $([ -n "${GPUS:-}" ] && echo --gpus) \
          >> "$OUT/$m.jsonl" 2>> "$OUT/$m.err"
        tail -n1 "$OUT/$m.jsonl" | cut -c1-150
      done
    done
  done
done
echo "=== $(date +%T) done"

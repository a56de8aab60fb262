#!/usr/bin/env bash
# bench race on a Qwen3-235B-A22B- or DeepSeek-V3-shaped random 4-bit checkpoint (race_ckpt.py),
# one GPU per node, at N = 2 and 4:
# ours (transport mlx over NCCL; the envoy), mlx-lm pipeline and tensor parallelism, batch 1 and
# STREAMS. Each row runs in its own `bench race` call, so one that crashes (out of memory, a
# backend that refuses) is recorded as that row's error and the others still run; the rows of
# each N are then merged into OUT/race-<N>.json with their token agreement.
# Usage: scripts/gpu/race_run.sh [OUT]      (default: $OUT, else /tmp/race)
# Env: PYTHONPATH=/tmp/site (scripts/gpu/setup.sh); SHAPE_NAME (qwen3-235b, or deepseek-v3);
#      NODES ("2 4": those above the GPU count are skipped); ROWS (ours_mlx ours_envoy
#      mlx_lm_pipeline mlx_lm_tensor; empty: build the model only; rows of separate calls with
#      the same OUT are merged together); STREAMS (1,8,32); MAX_TOKENS (32); LAYERS (default,
#      qwen3-235b: the most the disk and one layer's margin hold, at most 94; deepseek-v3: the
#      fewest that one GPU cannot hold, its 3 dense layers and one MoE layer more than fit, at most
#      what the disk holds and 61); MODELS_ROOT (/tmp); ROW_TIMEOUT (seconds per row, 1800);
#      CPU=1: a small shape on this machine's CPU, no GPUs (to try the script: CPU=1 LAYERS=2
#      STREAMS=1,2 MAX_TOKENS=4 NODES=2 scripts/gpu/race_run.sh /tmp/r; with
#      SHAPE_NAME=deepseek-v3, LAYERS=5).
set -euo pipefail
OUT=${1:-${OUT:-/tmp/race}}
mkdir -p "$OUT"
ROOT=${MODELS_ROOT:-/tmp}
SHAPE_NAME=${SHAPE_NAME:-qwen3-235b}
STREAMS=${STREAMS:-1,8,32}
MAX_TOKENS=${MAX_TOKENS:-32}
ROWS=${ROWS-ours_mlx ours_envoy mlx_lm_pipeline mlx_lm_tensor}  # set and empty: build only
case "$SHAPE_NAME" in
  qwen3-235b)
    MODEL=$ROOT/qwen3-235b-a22b-4bit FULL=94 DENSE=0
    # one layer at 4-bit g64: 128 experts x 3 x 4096 x 1536 x 4.5 bits + attention
    LAYER_BYTES=1450000000 ;;
  deepseek-v3)
    MODEL=$ROOT/deepseek-v3-4bit FULL=61 DENSE=3
    # one MoE layer at 4-bit g64 (4.5 bits a weight with the scales and biases): 256 experts x 3 x
    # 7168 x 2048 (6.342 GB) + the shared expert (24.8 MB) + MLA attention (q_a, q_b, kv_a, the
    # split kv_b, o: 187.1 M weights, 105.2 MB) + the bf16 router (3.7 MB). A dense layer
    # (3 x 7168 x 18432 + attention) is 0.33 GB.
    LAYER_BYTES=6475510272 ;;
  *) echo "SHAPE_NAME must be qwen3-235b or deepseek-v3 (got $SHAPE_NAME)" >&2; exit 2 ;;
esac
log() { echo "=== $(date +%T) $*" | tee -a "$OUT/race_run.log"; }

gpus=$( (nvidia-smi -L 2>/dev/null || true) | wc -l)
gpu_name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1 || echo unknown)
gpu_bytes=$(( $(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n1 || echo 0) * 1048576 ))
case "$gpu_name" in
  *H200*) BW="--hardware h200" ;;
  *H100*) BW="--bandwidth 3350" ;;  # H100 SXM: 3.35 TB/s HBM3 (datasheet)
  *) BW="" ;;
esac
SHAPE="" GPUS="--gpus"
if [ -n "${CPU:-}" ]; then
  SHAPE="--test-shape" GPUS="" gpus=4 BW="--bandwidth 20"
  MODEL=$ROOT/race-test-shape$([ "$SHAPE_NAME" = qwen3-235b ] || echo "-$SHAPE_NAME")
fi
log "host: $gpus x $gpu_name ($gpu_bytes bytes each); bandwidth flag: ${BW:-none}; shape $SHAPE_NAME"

if [ -z "${LAYERS:-}" ]; then
  mkdir -p "$ROOT"
  free=$(df -B1 --output=avail "$ROOT" | tail -n1)
  # a model built by an earlier call counts as free: the same call again keeps its depth
  [ -d "$MODEL" ] && free=$(( free + $(du -sb "$MODEL" | cut -f1) ))
  disk=$(( free / LAYER_BYTES - 4 ))  # a few layers' margin for logs and the one-layer build
  [ "$disk" -gt "$FULL" ] && disk=$FULL
  need=$(( gpu_bytes / LAYER_BYTES + 1 + DENSE ))  # the fewest layers one GPU does not hold
  [ "$need" -lt 4 ] && need=4
  LAYERS=$disk
  [ "$SHAPE_NAME" = deepseek-v3 ] && [ "$need" -lt "$disk" ] && LAYERS=$need
  log "the disk holds $disk layers; one GPU holds the model below $need layers" \
    "($LAYER_BYTES bytes a MoE layer)"
  if [ "$LAYERS" -lt "$need" ]; then
    log "building $LAYERS layers anyway: one GPU may hold them"
  fi
fi
log "building $MODEL with $LAYERS of $FULL layers"
python3 scripts/gpu/race_ckpt.py "$MODEL" --layers "$LAYERS" --shape "$SHAPE_NAME" $SHAPE >> "$OUT/race_run.log" 2>&1
du -sb "$MODEL" | tee -a "$OUT/race_run.log"
cp "$MODEL/config.json" "$OUT/config.json"
if [ -z "$ROWS" ]; then log "built; no rows asked for"; exit 0; fi

for n in ${NODES:-2 4}; do
  if [ "$n" -gt "$gpus" ]; then log "skip N = $n: $gpus GPUs"; continue; fi
  for row in $ROWS; do
    f="$OUT/race-$n-$row"
    cmd="python3 -m moe_cluster.coordinator.cli bench race --model $MODEL --nodes $n $GPUS --streams $STREAMS \
--max-tokens $MAX_TOKENS --rows $row --no-stock $BW --json"
    echo "$cmd" > "$f.cmd"
    log "N = $n $row"
    rc=0
    timeout "${ROW_TIMEOUT:-1800}" $cmd > "$f.json" 2> "$f.err" || rc=$?
    if [ "$rc" -ne 0 ] || ! python3 -c "import json,sys; json.load(open(sys.argv[1]))" "$f.json" 2>/dev/null; then
      # the row's failure, quoted: its exit status and the end of its stderr
      python3 - "$f" "$row" "$n" "$rc" "$STREAMS" <<'EOF'
import json, sys
f, row, n, rc, streams = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
tail = open(f + ".err", errors="replace").read()[-1500:]
why = "timed out" if rc in (124, 137) else f"exit status {rc}"
rows = [{"name": row, "nodes": n, "streams": int(b), "error": f"bench race {why}: {tail}"} for b in streams.split(",")]
json.dump({"rows": rows, "failed": True}, open(f + ".json", "w"))
EOF
    fi
    tail -c 300 "$f.json"; echo
  done
  python3 - "$OUT" "$n" <<'EOF'
import glob, json, sys
from moe_cluster.coordinator.bench.race import merge
out, n = sys.argv[1], int(sys.argv[2])
merged = merge([json.load(open(f)) for f in sorted(glob.glob(f"{out}/race-{n}-*.json"))])
json.dump(merged, open(f"{out}/race-{n}.json", "w"))
rows = merged["rows"]
for r in rows:
    print(r["name"], r["streams"], r.get("error", "")[:120] or f"{r['decode_tps']:.1f} tok/s, bound "
          + (f"{r['bound']['decode_tps']:.1f}" if r.get("bound") else "-"))
print("agreement:", {b: a["same"] for b, a in merged["agreement"].items()})
try:  # a GPU host may lack matplotlib: plot the merged file elsewhere (race.plot)
    from moe_cluster.coordinator.bench.race import plot
    plot(merged, f"{out}/race-{n}.png")
except Exception as exc:  # noqa: BLE001 - the figure is optional, the JSON is the record
    print(f"no plot: {exc}")
EOF
done
log "plan's predictions against these runs"
for n in ${NODES:-2 4}; do
  [ -f "$OUT/race-$n.json" ] || continue
  python3 -m moe_cluster.coordinator.cli plan --model "$MODEL" --check-against "$OUT/race-$n.json" --json \
    > "$OUT/check-$n.json" 2> "$OUT/check-$n.err" || log "check against N = $n failed: $(tail -c 300 "$OUT/check-$n.err")"
done
log "done"

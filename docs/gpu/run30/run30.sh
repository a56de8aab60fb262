#!/usr/bin/env bash
# GPU run 30 (issue 35): two micro-batches, each lane queuing its work on a device stream of its own
# (MOE_CLUSTER_LANE_STREAMS=1, node/overlap.py: the device may run the two lanes' kernels side by
# side) against one stream for both, alternated, on a 2-GPU host, one node per GPU, the
# Qwen3-30B-A3B shape of runs 26-29.
# Background session (setsid), polled by short calls; R/DONE at the end.
set -u
R=/tmp/r30
mkdir -p "$R"
export MLX_ENABLE_TF32=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
stage() { echo "=== $(date +%T) $*" | tee -a "$R/session.log"; }
stage "start: $(nproc) cores, $(nvidia-smi -L 2>/dev/null | wc -l) GPUs, load $(cut -d' ' -f1-3 /proc/loadavg)"
stage "MLX kernel cache: $(find /tmp/mlx -name '*.ptx' 2>/dev/null | wc -l) kernels"
MC="python3 -m moe_cluster.coordinator.cli"
M=/tmp/qwen3-4bit
if [ ! -f $M/config.json ]; then
  stage "build $M"
  (cd /tmp && timeout 300 $MC demo-model --arch qwen3_moe --hidden 2048 --heads 16 \
    --kv-heads 4 --ffn 768 --experts 128 --top-k 8 --layers 12 --quantize 4 --dtype bfloat16 \
    --shard-size 5GB --out $M) > "$R/build.out" 2> "$R/build.err" || stage "build exit $?"
fi
race() {  # race NAME LANE_STREAMS STREAMS ROWS TIMEOUT
  stage "-> $1: MOE_CLUSTER_LANE_STREAMS=$2, streams $3, rows $4"
  (cd /tmp && MOE_CLUSTER_LANE_STREAMS=$2 timeout -k 10 $5 $MC bench race --model $M --gpus --nodes 2 \
    --streams $3 --rows $4 --no-stock --max-tokens 24 --json) > "$R/$1.json" 2> "$R/$1.err" || stage "exit $?"
  python3 - "$R/$1.json" <<'PY' 2>&1 | tee -a "$R/session.log"
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print("  no JSON:", e); sys.exit()
for r in d["rows"]:
    b = r.get("breakdown_per_step_s") or {}
    print("  %-20s %3s streams  decode %.1f tok/s  step %.1f ms  breakdown %s  overlap %s" % (
        r["name"], r["streams"], r.get("decode_tps") or 0, 1e3 * (r.get("step_s") or 0),
        {k: round(1e3 * v, 2) for k, v in b.items() if isinstance(v, float)}, r.get("overlap")))
print("  agreement", json.dumps(d.get("agreement")))
PY
}
race streams-8-r1 1 8 ours_envoy,ours_envoy_overlap 240
race one-8 0 8 ours_envoy,ours_envoy_overlap 240
race streams-8-r2 1 8 ours_envoy,ours_envoy_overlap 240
stage "all done"
touch "$R/DONE"

#!/usr/bin/env bash
# GPU run 28 (issue 39, and the race after a performance step): envoy/_sum.c, the bfloat16 sum in C,
# against numpy's path (MOE_CLUSTER_NATIVE=0), alternated in one session on a 2-GPU host, one node
# per GPU: `bench allreduce` on the host's cores, then `bench race` on the Qwen3-30B-A3B shape.
# Background session (setsid), polled by short calls; R/DONE at the end.
set -u
R=/tmp/r28
mkdir -p "$R"
export MLX_ENABLE_TF32=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
stage() { echo "=== $(date +%T) $*" | tee -a "$R/session.log"; }
stage "start: $(nproc) cores, $(nvidia-smi -L 2>/dev/null | wc -l) GPUs, load $(cut -d' ' -f1-3 /proc/loadavg)"
nvidia-smi > "$R/nvidia-smi.txt" 2>&1
(cd /tmp && python3 -c "from moe_cluster.envoy import reduce; print('envoy/_sum.c built:', reduce.native)") 2>&1 | tee -a "$R/session.log"
stage "MLX kernel cache: $(find /tmp/mlx -name '*.ptx' 2>/dev/null | wc -l) kernels"
MC="python3 -m moe_cluster.coordinator.cli"
for v in 1 0; do
  stage "bench allreduce, MOE_CLUSTER_NATIVE=$v"
  (cd /tmp && MOE_CLUSTER_NATIVE=$v timeout 300 $MC bench allreduce --nodes 2,4 --hidden 6144 --tokens 1,32 \
    --dtype bfloat16 --paths envoy,mlx_ring --rounds 3 --json) > "$R/allreduce-native$v.json" 2> "$R/allreduce-native$v.err" \
    || stage "exit $?"
  python3 - "$R/allreduce-native$v.json" <<'PY' 2>&1 | tee -a "$R/session.log"
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print("  no JSON:", e); sys.exit()
for c in d["cases"]:
    print("  %d nodes %2d tokens: envoy %.1f  ring %.1f  x%.2f" % (c["nodes"], c["tokens"], c["envoy_p50_us"], c["mlx_ring_p50_us"], c["envoy_over_ring"]))
PY
done
M=/tmp/qwen3-4bit
if [ ! -f $M/config.json ]; then
  stage "build $M"
  (cd /tmp && timeout 300 $MC demo-model --arch qwen3_moe --hidden 2048 --heads 16 \
    --kv-heads 4 --ffn 768 --experts 128 --top-k 8 --layers ${LAYERS:-12} --quantize 4 --dtype bfloat16 \
    --shard-size 5GB --out $M) > "$R/build.out" 2> "$R/build.err" || stage "build exit $?"
  du -sh $M | tee -a "$R/session.log"
fi
race() {  # race NAME NATIVE STREAMS ROWS TIMEOUT
  stage "-> $1: MOE_CLUSTER_NATIVE=$2, streams $3, rows $4"
  (cd /tmp && MOE_CLUSTER_NATIVE=$2 timeout -k 10 $5 $MC bench race --model $M --gpus --nodes 2 \
    --streams $3 --rows $4 --no-stock --max-tokens 24 --json) > "$R/$1.json" 2> "$R/$1.err" || stage "exit $?"
  python3 - "$R/$1.json" <<'PY' 2>&1 | tee -a "$R/session.log"
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print("  no JSON:", e); sys.exit()
for r in d["rows"]:
    print("  %-18s %3s streams  decode %.1f tok/s  route %s" % (r["name"], r["streams"], r.get("decode_tps") or 0, (r.get("route") or "")[:30]))
print("  agreement", json.dumps(d.get("agreement")))
PY
}
race race-native 1 1,8 ours_envoy,ours_mlx,mlx_lm_pipeline,mlx_lm_tensor 420
race envoy-numpy-r1 0 1,8 ours_envoy 180
race envoy-native-r2 1 1,8 ours_envoy 180
race envoy-numpy-r2 0 1,8 ours_envoy 180
stage "all done; MLX kernel cache: $(find /tmp/mlx -name '*.ptx' 2>/dev/null | wc -l) kernels"
touch "$R/DONE"

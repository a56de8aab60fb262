#!/usr/bin/env bash
# GPU run 27 (issue 35): the pipelined Interleave under each decode route (skip, device), forced with
# MOE_CLUSTER_ROUTE, each beside its own unsplit rows, on a 2-GPU host, one node per GPU.
# Background session (setsid), polled by short calls; R/DONE at the end.
set -u
R=/tmp/r27
mkdir -p "$R"
export MLX_ENABLE_TF32=0 PYTHONUNBUFFERED=1
stage() { echo "=== $(date +%T) $*" | tee -a "$R/session.log"; }
stage "start: $(nproc) cores, $(nvidia-smi -L 2>/dev/null | wc -l) GPUs, disk free $(df -h --output=avail /tmp | tail -n1)"
nvidia-smi > "$R/nvidia-smi.txt" 2>&1
for t in new; do
  mkdir -p /tmp/tree-$t && tar xzf /tmp/wheels-run27/$t.tar.gz -C /tmp/tree-$t
  (cd /tmp/tree-$t && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target /tmp/site-$t . ) >> "$R/session.out" 2>&1
  (cd /tmp && PYTHONPATH=/tmp/site-$t:/tmp/site python3 -c "import moe_cluster.node.overlap as o, greenlet, mlx.core as mx; print('$t', o.__file__, 'evaluates' in open(o.__file__).read(), 'greenlet', greenlet.__version__, mx.default_device())") 2>&1 | tee -a "$R/session.log"
done
stage "MLX kernel cache: $(find /tmp/mlx -name '*.ptx' 2>/dev/null | wc -l) kernels"
M=/tmp/qwen3-4bit
MC="python3 -m moe_cluster.coordinator.cli"
if [ ! -f $M/config.json ]; then
  stage "build $M"
  (cd /tmp && PYTHONPATH=/tmp/site-new:/tmp/site timeout 300 $MC demo-model --arch qwen3_moe --hidden 2048 --heads 16 \
    --kv-heads 4 --ffn 768 --experts 128 --top-k 8 --layers ${LAYERS:-12} --quantize 4 --dtype bfloat16 \
    --shard-size 5GB --out $M) > "$R/build.out" 2> "$R/build.err" || stage "build exit $?"
  du -sh $M | tee -a "$R/session.log"
fi
race() {  # race NAME TREE STREAMS ROWS TIMEOUT
  stage "-> $1: route $2, streams $3, rows $4"
  (cd /tmp && MOE_CLUSTER_ROUTE=$2 PYTHONPATH=/tmp/site-new:/tmp/site timeout -k 10 $5 $MC bench race --model $M --gpus --nodes 2 \
    --streams $3 --rows $4 --no-stock --max-tokens 24 --json) > "$R/$1.json" 2> "$R/$1.err" || stage "exit $?"
  python3 - "$R/$1.json" <<'PY' 2>&1 | tee -a "$R/session.log"
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print("  no JSON:", e); sys.exit()
for r in d["rows"]:
    print("  %-22s %3s streams  decode %.1f tok/s  route %s  overlap %s" % (r["name"], r["streams"], r.get("decode_tps") or 0, (r.get("route") or "")[:30], r.get("overlap")))
print("  agreement", json.dumps(d.get("agreement")))
PY
}
for round in 1 2; do
  race device-8-r$round device 8 ours_envoy,ours_envoy_overlap 240
  race skip-8-r$round skip 8 ours_envoy,ours_envoy_overlap 240
  [ -f "$R/STOP" ] && break
done
[ -f "$R/STOP" ] || race device-32 device 32 ours_envoy,ours_envoy_overlap 240
stage "all done; MLX kernel cache: $(find /tmp/mlx -name '*.ptx' 2>/dev/null | wc -l) kernels"
touch "$R/DONE"

#!/usr/bin/env bash
# The envoy against the ring on a GPU host (docs/envoy.md): first `bench allreduce --trace` on the
# host's CPU cores (where each hop of the envoy's all-reduce goes), then per model `bench decode` at
# N = 2, one GPU per node, keepalive none, over the envoy and over `transport: mlx` with the ring
# backend forced (MOE_CLUSTER_MLX_BACKEND=ring: host-mediated like the envoy, where NCCL would be
# picked), and the same with NCCL for reference. Raw output only, into OUT; OUT/DONE at the end.
# In the background (device calls last 10 minutes at most; this outlives them):
#   setsid bash scripts/gpu/envoy_run.sh /tmp/envoy > /tmp/envoy.log 2>&1 < /dev/null &
# Env: PYTHONPATH=/tmp/site (scripts/gpu/setup.sh); MODELS (default "dbrx:4 qwen3-30b-a3b:12",
# NAME:LAYERS, or the path of a checkpoint already built, used as it is and kept), ROUNDS (2), MAX_TOKENS (32), NCCL=0 skips the NCCL reference, ALLREDUCE=0 the trace,
# OWN=0 the envoy's own path (MOE_CLUSTER_ENVOY_DIRECT=0: the envoy reduces, as before the node
# read its frames itself).
set -u
OUT=${1:-/tmp/envoy}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
MC="python3 -m moe_cluster.coordinator.cli"
F="python3 scripts/gpu/figures.py"
stage() { echo "=== $(date +%T) $*"; }
{
  echo "cores: $(nproc), load: $(cut -d' ' -f1-3 /proc/loadavg)"
  nvidia-smi -L 2>&1
  python3 -c "import platform, mlx.core as mx; print(platform.python_version(), 'mlx', mx.__version__)"
} > "$OUT/host.txt" 2>&1
cat "$OUT/host.txt"
if [ "${ALLREDUCE:-1}" != 0 ]; then
  stage "bench allreduce --trace"
  timeout 900 $MC bench allreduce --nodes 2,4 --hidden 6144 --tokens 1,32 --dtype bfloat16 --paths envoy,floor,mlx_ring \
    --trace > "$OUT/allreduce-trace.txt" 2> "$OUT/allreduce-trace.err"
  cat "$OUT/allreduce-trace.txt"
  timeout 900 $MC bench allreduce --nodes 2 --hidden 2048 --tokens 1 --dtype bfloat16 --paths envoy,floor,mlx_ring \
    --trace > "$OUT/allreduce-trace-h2048.txt" 2> "$OUT/allreduce-trace-h2048.err"
  cat "$OUT/allreduce-trace-h2048.txt"
fi
for spec in ${MODELS-dbrx:4 qwen3-30b-a3b:12}; do
  if [ "${spec#/}" != "$spec" ]; then  # a checkpoint built before (issue_run.sh's part A)
    path=$spec m=$(basename "$spec")
  else
    m=${spec%%:*}
    layers=$([ "$m" != "$spec" ] && echo "--layers ${spec#*:}")
    stage "build $spec"
    $F build --model "$m" $layers || continue
    path=${MODELS_ROOT:-/tmp}/$m
  fi
  decode() {  # decode NAME TRANSPORTS [ENV...]
    local name=$1 transports=$2
    shift 2
    stage "bench decode $m over $transports ($name)"
    env "$@" timeout 1800 $MC bench decode --model "$path" --nodes 2 --keepalive none --transport "$transports" \
      --gpus --max-tokens "${MAX_TOKENS:-32}" --rounds "${ROUNDS:-2}" --json > "$OUT/$m-$name.json" 2> "$OUT/$m-$name.err"
    python3 - "$OUT/$m-$name.json" <<'EOF'
import json, sys
try:
    b = json.load(open(sys.argv[1]))
except ValueError as exc:
    sys.exit(f"no JSON in {sys.argv[1]}: {exc}")
for c in b["clusters"]:
    print(f"  N={c['nodes']} {c['transport']} ({c.get('backend', '')}): {c['generation_tps']:.1f} tok/s, "
          f"fixed cost {c['fixed_cost_per_moe_layer_us']:.0f} us per MoE layer, same tokens {c['same_tokens']}")
EOF
  }
  decode envoy-ring envoy,mlx MOE_CLUSTER_MLX_BACKEND=ring
  # the envoy's own path (it reduces; the node hands it the partial), beside the default
  [ "${OWN:-1}" != 0 ] && decode envoy-own envoy MOE_CLUSTER_ENVOY_DIRECT=0
  [ "${NCCL:-1}" != 0 ] && decode nccl mlx
  [ "$path" != "$spec" ] && rm -rf "$path"  # room for the next model
done
stage done
touch "$OUT/DONE"

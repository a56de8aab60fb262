#!/usr/bin/env bash
# GPU run 25: one background session on a 4-GPU host (started with setsid, polled by short calls).
#   A. DeepSeek-V3 shape (SHAPE_NAME=deepseek-v3, race_run.sh's default depth: 27 layers), N = 4,
#      MAX_TOKENS=16: build, then ours_envoy, ours_mlx, mlx_lm_pipeline, mlx_lm_tensor at
#      STREAMS=1,8,32 (the mlx-lm rows at 32 only if R/SHORT exists when they start).
#   B. only if R/GO_B appears after A (written by the polling call when >= ~420 s of device time
#      remain): delete the DeepSeek checkpoint, build the Qwen3-235B shape at 94 layers, and run
#      NODES=2 ROWS=ours_envoy STREAMS=32.
# The tree (/tmp/tree-head, installed in /tmp/site by setup.sh) runs its own
# scripts/gpu/race_run.sh, a copy with the closing `plan --check-against` step cut (~20 s a call;
# the row commands are unchanged). R/DONE at the end.
set -u
R=/tmp/r25
mkdir -p "$R"
export MLX_ENABLE_TF32=0 PYTHONUNBUFFERED=1 MAX_TOKENS=16
unset SHAPE_NAME LAYERS NODES ROWS STREAMS
PP=/tmp/site
stage() { echo "=== $(date +%T) $*" | tee -a "$R/session.log"; }
stage "start: $(nproc) cores, $(nvidia-smi -L 2>/dev/null | wc -l) GPUs, disk free $(df -h --output=avail /tmp | tail -n1)"
nvidia-smi > "$R/nvidia-smi.txt" 2>&1
sed -i '/^log "plan.s predictions/,/^done$/d' /tmp/tree-head/scripts/gpu/race_run.sh
(cd /tmp && PYTHONPATH=$PP python3 -c "import moe_cluster, moe_cluster.coordinator.bench.race as r, moe_cluster.node as n, mlx.core as mx, mlx_lm
print('head: moe_cluster', list(moe_cluster.__path__), '| bench.race', r.__file__, '| node', n.__file__, '| mlx', mx.__version__, '| mlx_lm', mlx_lm.__version__)") 2>&1 | tee -a "$R/session.log"
stage "MLX kernel cache: $(find /tmp/mlx -name '*.ptx' 2>/dev/null | wc -l) kernels"

row() {  # row OUTDIR TIMEOUT ENV... : race_run.sh with ENV
  local out=$1 to=$2; shift 2
  stage "-> $out: $* ROW_TIMEOUT=$to"
  (cd /tmp/tree-head && env PYTHONPATH=$PP ROW_TIMEOUT=$to "$@" bash scripts/gpu/race_run.sh "$R/$out") \
    >> "$R/session.out" 2>&1 || stage "exit $?"
  stage "done: $(tail -n 3 "$R/session.out" | tr '\n' ' ' | cut -c1-400)"
}

# A. DeepSeek-V3 shape, N = 4
stage "A: build the DeepSeek-V3 shape (default depth)"
row build 600 SHAPE_NAME=deepseek-v3 ROWS=
row dsv3 420 SHAPE_NAME=deepseek-v3 NODES=4 STREAMS=1,8,32 ROWS=ours_envoy
row dsv3 360 SHAPE_NAME=deepseek-v3 NODES=4 STREAMS=1,8,32 ROWS=ours_mlx
for r in mlx_lm_pipeline mlx_lm_tensor; do
  s=1,8,32; [ -f "$R/SHORT" ] && s=32
  row dsv3 300 SHAPE_NAME=deepseek-v3 NODES=4 STREAMS=$s ROWS=$r
done
stage "A done; MLX kernel cache: $(find /tmp/mlx -name '*.ptx' 2>/dev/null | wc -l) kernels"
touch "$R/A_DONE"
# B waits up to 90 s for the polling call's decision
for i in $(seq 1 18); do { [ -f "$R/GO_B" ] || [ -f "$R/NO_B" ]; } && break; sleep 5; done
if [ -f "$R/GO_B" ]; then
  stage "B: delete the DeepSeek checkpoint; build the Qwen3-235B shape, 94 layers"
  rm -rf /tmp/deepseek-v3-4bit
  stage "disk free $(df -h --output=avail /tmp | tail -n1)"
  row qbuild 600 LAYERS=94 ROWS=
  row q2 360 LAYERS=94 NODES=2 STREAMS=32 ROWS=ours_envoy
else
  stage "B not run ($(ls "$R" | grep -E '^(GO_B|NO_B)$' || echo 'no decision'))"
fi
stage "all done"
touch "$R/DONE"

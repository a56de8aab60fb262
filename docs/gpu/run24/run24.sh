#!/usr/bin/env bash
# GPU run 24: one background session on a 4-GPU host (started with setsid, polled by short calls).
#   1. batch-1 A/B on the Qwen3-235B shape (94 layers) at N = 4: ours_mlx with MOE_CLUSTER_ROUTE=skip
#      from the HEAD tree and from run 19's cfe3b87 tree (same checkpoint, built once), then HEAD's
#      ours_mlx with the measured route at streams 1,32 (one load serves both);
#   2. 32 streams at N = 4: mlx_lm_pipeline, mlx_lm_tensor, ours_envoy (HEAD tree);
#   3. 32 streams at N = 2: ours_mlx, mlx_lm_pipeline, mlx_lm_tensor, ours_envoy (if time remains).
# Each tree runs its own scripts/gpu/race_run.sh (a copy with the closing `plan --check-against`
# step cut, ~20 s a call; the row commands are unchanged). R/DONE at the end.
# Trees: /tmp/tree-head (installed in /tmp/site by setup.sh), /tmp/tree-cfe (/tmp/site-cfe).
set -u
R=/tmp/r24
mkdir -p "$R"
export MLX_ENABLE_TF32=0 PYTHONUNBUFFERED=1 LAYERS=94 MAX_TOKENS=16
HEAD_PP=/tmp/site
CFE_PP=/tmp/site-cfe:/tmp/site
stage() { echo "=== $(date +%T) $*" | tee -a "$R/session.log"; }
stage "start: $(nproc) cores, $(nvidia-smi -L 2>/dev/null | wc -l) GPUs, disk free $(df -h --output=avail /tmp | tail -n1)"
nvidia-smi > "$R/nvidia-smi.txt" 2>&1
for t in head cfe; do
  sed -i '/^log "plan.s predictions/,/^done$/d' /tmp/tree-$t/scripts/gpu/race_run.sh
done
resolve() {  # which moe_cluster a tree's PYTHONPATH resolves to
  (cd /tmp && PYTHONPATH=$2 python3 -c "import moe_cluster, moe_cluster.coordinator.bench.race as r, moe_cluster.node as n, mlx.core as mx
print('$1: moe_cluster', list(moe_cluster.__path__), '| bench.race', r.__file__, '| node', n.__file__, '| mlx', mx.__version__)") 2>&1 | tee -a "$R/session.log"
}
resolve head "$HEAD_PP"
resolve cfe "$CFE_PP"

row() {  # row TREE OUTDIR TIMEOUT ENV... : race_run.sh of TREE with ENV
  local tree=$1 out=$2 to=$3; shift 3
  local pp=$HEAD_PP; [ "$tree" = cfe ] && pp=$CFE_PP
  stage "tree $tree -> $out: $* ROW_TIMEOUT=$to"
  (cd /tmp/tree-$tree && env PYTHONPATH=$pp ROW_TIMEOUT=$to "$@" bash scripts/gpu/race_run.sh "$R/$out") \
    >> "$R/session.out" 2>&1 || stage "exit $?"
  stage "done: $(tail -n 3 "$R/session.out" | tr '\n' ' ' | cut -c1-400)"
}

stage "build the Qwen3-235B shape, 94 layers"
row head build 600 ROWS=
# 1. A/B at batch 1, route forced to skip: HEAD first (it builds the kernels, with HEAD's stall guard
#    for kernel-building steps), then cfe3b87 on the warm kernel cache
row head ab-head 360 MOE_CLUSTER_ROUTE=skip STREAMS=1 NODES=4 ROWS=ours_mlx
row cfe ab-cfe 330 MOE_CLUSTER_ROUTE=skip STREAMS=1 NODES=4 ROWS=ours_mlx
# HEAD, route measured: batch 1 and 32 streams in one load
row head q4 450 STREAMS=1,32 NODES=4 ROWS=ours_mlx
# 2. 32 streams at N = 4
row head q4 300 STREAMS=32 NODES=4 ROWS=mlx_lm_pipeline
row head q4 300 STREAMS=32 NODES=4 ROWS=mlx_lm_tensor
row head q4 360 STREAMS=32 NODES=4 ROWS=ours_envoy
# 3. 32 streams at N = 2
for r in ours_mlx mlx_lm_pipeline mlx_lm_tensor ours_envoy; do
  row head q2 300 STREAMS=32 NODES=2 ROWS=$r
done
stage "all done"
touch "$R/DONE"

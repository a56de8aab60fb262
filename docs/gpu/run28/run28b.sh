#!/usr/bin/env bash
# GPU run 28, part B (issue 39): the envoy's fixed cost per MoE layer in decode against the ring's
# (scripts/gpu/envoy_run.sh: bench decode --transport envoy,mlx --keepalive none, N = 2, the ring
# forced), with envoy/_sum.c and with numpy's sum (MOE_CLUSTER_NATIVE=0), the Qwen3 shape built in
# part A; then the DBRX shape (4 layers) with the C sum.
set -u
R=/tmp/r28b
mkdir -p "$R"
export MLX_ENABLE_TF32=0 PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
export ALLREDUCE=0 OWN=0 NCCL=0 ROUNDS=2 MAX_TOKENS=32
MODELS=/tmp/qwen3-4bit bash scripts/gpu/envoy_run.sh $R/qwen3-native > $R/qwen3-native.log 2>&1
MOE_CLUSTER_NATIVE=0 MODELS=/tmp/qwen3-4bit bash scripts/gpu/envoy_run.sh $R/qwen3-numpy > $R/qwen3-numpy.log 2>&1
MODELS=dbrx:4 bash scripts/gpu/envoy_run.sh $R/dbrx-native > $R/dbrx-native.log 2>&1
touch $R/DONE

#!/usr/bin/env bash
# One device call (9 minutes at most) for issues 34, 35 and 39, each part time-bounded so that one
# that fails or runs long is logged and the next still runs; the parts run in the order of PARTS.
#  P (issue 34): why a 4-bit DBRX shape fails inside MLX on CUDA: stock mlx-lm's DBRX block feeds
#    one token at a time (1-D) to each expert's QuantizedLinear; the probe calls one with a 1-D and
#    a 2-D input on the GPU and prints what each does.
#  A (issue 34): 4-bit DBRX-shaped (4 layers) and Qwen3-30B-A3B-shaped (12 layers) random
#    checkpoints built here, then per model `bench decode` at N = 2 over `transport: mlx`, one GPU
#    per node, twice: the decode route forced to the quantized skip kernel and to redirected rows
#    (gather_qmm), MOE_CLUSTER_ROUTE=skip|device. Each row gives tok/s, its tokens and the expert
#    bytes each node reads per token (`expert_reads`).
#  B (issue 35): `bench decode --speculative prompt-lookup` at N = 2 on the demo model and on A's
#    Qwen3-shaped checkpoint, over the envoy and mlx, one call per (model, transport).
#  C (issue 39): scripts/gpu/envoy_run.sh with what time is left.
#  X (issues 33, 35): `bench race` rows at N = 2 on A's Qwen3-shaped checkpoint, per installed tree
#    (X_SITES) and decode route (X_ROUTES: forced, or measured with its wide-call crossover).
#  D (issue 35): two micro-batches per step: `bench race` rows ours_envoy and ours_mlx without and
#    with _overlap at 8 and 32 streams on A's Qwen3-shaped checkpoint, N = 2, one GPU per node.
# Raw JSON and stderr go to OUT/$RUN/ (RUN: the run's name, default run14); at the end everything is
# packed into OUT/$RUN.tgz, with OUT/$RUN-summary.txt beside it (scripts/gpu/issue_summary.py).
# Usage, after scripts/gpu/setup.sh (PYTHONPATH=/tmp/site):  bash scripts/gpu/issue_run.sh $OUT
# Env: BUDGET (seconds from the script's start to the packing, default 500: leave the call's other
#      steps their time), PARTS ("A B C"), MODELS_ROOT (/tmp), ROUTES ("skip device"), MAX_TOKENS
#      (32, part A), ROUNDS (2, part A), A_PAIRED=1 (part A: the routes alternated within one load), DBRX_LAYERS (4), QWEN_LAYERS (12), A_MODELS (the checkpoints part A builds
#      and runs: dbrx-4bit qwen3-4bit), A_DTYPE (their dtype: bfloat16), CPU=1: tiny shapes on this machine's CPU, no GPUs, routes
#      "host device" (no skip kernel there):  CPU=1 BUDGET=900 bash scripts/gpu/issue_run.sh /tmp/r14
set -u
RUN=${RUN:-run14}
OUT=${1:-${OUT:-/tmp/$RUN-out}}
R=$OUT/$RUN
mkdir -p "$R"
START=$(date +%s)
BUDGET=${BUDGET:-500}
PACK=15  # seconds kept for the summary and the packing
ROOT=${MODELS_ROOT:-/tmp}
export PYTHONUNBUFFERED=1
unset MOE_CLUSTER_ROUTE
MC="python3 -m moe_cluster.coordinator.cli"
left() { echo $(( START + BUDGET - PACK - $(date +%s) )); }
log() { echo "=== $(date +%T) +$(( $(date +%s) - START ))s $*" | tee -a "$R/$RUN.log"; }

# step NAME CAP CMD...: CMD under `timeout` (CAP seconds, or what the budget leaves if less),
# stdout to R/NAME.out, stderr to R/NAME.err, its command line to R/NAME.cmd; returns its status.
# timeout signals its whole process group, so the node processes a bench spawned go with it.
step() {
  local name=$1 cap=$2 t
  shift 2
  t=$(left)
  [ "$cap" -lt "$t" ] && t=$cap
  echo "${MOE_CLUSTER_ROUTE:+MOE_CLUSTER_ROUTE=$MOE_CLUSTER_ROUTE }$*" > "$R/$name.cmd"
  if [ "$t" -lt 10 ]; then
    log "$name: skipped, $(left) s of the budget left"
    echo "skipped: no time left in the budget" > "$R/$name.err"
    return 99
  fi
  log "$name (at most $t s)"
  local rc=0 t0=$(date +%s)
  timeout -k 10 "$t" "$@" > "$R/$name.out" 2> "$R/$name.err" || rc=$?
  log "$name: exit $rc after $(( $(date +%s) - t0 )) s$([ "$rc" = 124 ] && echo ' (timed out)')"
  [ "$rc" -ne 0 ] && tail -c 800 "$R/$name.err" | tee -a "$R/$RUN.log"
  return $rc
}

pack() {
  log "summary and packing"
  timeout 10 python3 scripts/gpu/issue_summary.py "$R" > "$R/summary.txt" 2>> "$R/$RUN.log"
  cat "$R/summary.txt"
  cp "$R/summary.txt" "$OUT/$RUN-summary.txt" 2>/dev/null
  if tar czf "$OUT/$RUN.tgz" -C "$OUT" "$RUN"; then
    rm -rf "$R"  # the device brings back a few files: the archive holds them all
  fi
  ls -la "$OUT"
}
trap pack EXIT

GPUS="--gpus" ROUTES=${ROUTES:-skip device}
DBRX=(--arch dbrx --hidden 6144 --heads 48 --kv-heads 8 --ffn 10752 --experts 16 --top-k 4 --layers ${DBRX_LAYERS:-4})
QWEN=(--arch qwen3_moe --hidden 2048 --heads 16 --kv-heads 4 --ffn 768 --experts 128 --top-k 8 --layers ${QWEN_LAYERS:-12})
if [ -n "${CPU:-}" ]; then
  GPUS="" ROUTES=${ROUTES_CPU:-host device}
  DBRX=(--arch dbrx --hidden 256 --heads 4 --kv-heads 2 --ffn 128 --experts 16 --top-k 4 --layers 2)
  QWEN=(--arch qwen3_moe --hidden 128 --heads 4 --kv-heads 2 --ffn 64 --experts 16 --top-k 8 --layers 2)
fi
{
  echo "cores: $(nproc), load: $(cut -d' ' -f1-3 /proc/loadavg), disk free: $(df -h --output=avail "$ROOT" | tail -n1)"
  nvidia-smi -L 2>&1 | head -8
  python3 -c "import platform, mlx.core as mx; print(platform.python_version(), 'mlx', mx.__version__, mx.default_device())"
  echo "MLX_ENABLE_TF32=${MLX_ENABLE_TF32-unset} PYTHONPATH=${PYTHONPATH-}"
  git log -1 --format='checkout: %H %s' 2>/dev/null
} > "$R/host.txt" 2>&1
cat "$R/host.txt"
# the code measured is this checkout's (a warm machine may hold an older install)
if [ -z "${CPU:-}" ]; then
  timeout 120 python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade \
    --target /tmp/site . >> "$R/$RUN.log" 2>&1 || log "reinstall of this checkout failed"
fi

build() {  # build NAME ARGS...: a 4-bit random checkpoint in ROOT/NAME, unless built with these args
  local name=$1 dir=$ROOT/$1
  shift
  local args="$* --dtype ${A_DTYPE:-bfloat16}"  # the config does not say its dtype: .build does
  if [ -f "$dir/config.json" ] && [ "$(cat "$dir/.build" 2>/dev/null)" = "$args" ]; then
    log "$dir exists"
    return 0
  fi
  rm -rf "$dir"
  step "build-$name" 150 $MC demo-model "$@" --quantize 4 --dtype "${A_DTYPE:-bfloat16}" --shard-size 5GB --out "$dir" \
    || { rm -rf "$dir"; return 1; }
  echo "$args" > "$dir/.build"
  du -sb "$dir" | tee -a "$R/$RUN.log"
  cp "$dir/config.json" "$R/$name-config.json"
}

part_p() {
  log "part P: a QuantizedLinear on a 1-D and a 2-D input (stock mlx-lm's DBRX block does the first)"
  step P-probe 60 python3 scripts/gpu/qlinear_probe.py
  cat "$R/P-probe.out" | tee -a "$R/$RUN.log"
}

part_a() {
  log "part A: issue 34, 4-bit DBRX and Qwen3 shapes at N = 2, routes: $ROUTES"
  built=()
  # A_MODELS: only those are built
  wanted() { case " ${A_MODELS:-dbrx-4bit qwen3-4bit} " in *" $1 "*) return 0 ;; esac; return 1; }
  wanted dbrx-4bit && build dbrx-4bit "${DBRX[@]}" && built+=(dbrx-4bit)
  wanted qwen3-4bit && build qwen3-4bit "${QWEN[@]}" && built+=(qwen3-4bit)
  for m in "${built[@]}"; do
    # A_PAIRED=1: one call per model, the routes alternated round by round within one load
    # (bench decode --routes: a pair of runs seconds apart, what a drifting host cannot move)
    if [ "${A_PAIRED:-0}" = 1 ]; then
      step "A-$m-paired" "${A_CAP:-150}" $MC -v bench decode --model "$ROOT/$m" --nodes 2 \
        --keepalive none --transport mlx $GPUS --no-peers --max-tokens "${MAX_TOKENS:-32}" \
        --rounds "${ROUNDS:-2}" --routes "${ROUTES// /,}" --json
      mv "$R/A-$m-paired.out" "$R/A-$m-paired.json" 2>/dev/null
      continue
    fi
    # A_ALTERNATE > 1: the routes alternated that many times (A-model-route-i), so that a
    # difference smaller than one call's noise can be told from it
    for i in $(seq "${A_ALTERNATE:-1}"); do
      for route in $ROUTES; do
        local name="A-$m-$route"
        [ "${A_ALTERNATE:-1}" -gt 1 ] && name="$name-$i"
        MOE_CLUSTER_ROUTE=$route step "$name" "${A_CAP:-150}" $MC -v bench decode --model "$ROOT/$m" --nodes 2 \
          --keepalive none --transport mlx $GPUS --no-peers --max-tokens "${MAX_TOKENS:-32}" \
          --rounds "${ROUNDS:-2}" --json
        mv "$R/$name.out" "$R/$name.json" 2>/dev/null
      done
    done
  done
  timeout 10 python3 scripts/gpu/issue_summary.py "$R" --part A 2>&1 | tee -a "$R/$RUN.log"
}

part_b() {
  log "part B: issue 35, speculative prompt lookup at N = 2 on the demo and the Qwen3 shape"
  spec() {  # spec NAME MODEL TRANSPORT ROUNDS SPOIL
    step "B-$1-$3" "${B_CAP:-180}" $MC bench decode --speculative prompt-lookup --model "$2" $GPUS --nodes 2 \
      --transport "$3" --max-tokens 64 --rounds "$4" ${5:+--spoil $5} --json
    mv "$R/B-$1-$3.out" "$R/B-$1-$3.json" 2>/dev/null
  }
  # One call per (model, transport): a call that runs out of time loses only its own rows. The
  # Qwen3 shape first (the GPU table the issue asks for; the demo's is measured on CPUs too), with
  # fewer scenarios and rounds than the demo's: every task loads its shard, 4 GB here.
  if [ -f "$ROOT/qwen3-4bit/config.json" ]; then
    for t in ${B_TRANSPORTS:-envoy mlx}; do
      spec qwen3-4bit "$ROOT/qwen3-4bit" "$t" "${B_ROUNDS:-2}" "${B_SPOIL:-0,0.5,1}"
    done
  else
    log "part B: no Qwen3-shaped checkpoint (part A did not build it)"
  fi
  [ "${B_DEMO:-1}" = 0 ] && return
  spec demo demo envoy 3 ""
  spec demo demo mlx 3 ""
}

part_c() {
  if [ "$(left)" -gt 60 ] && [ -z "${CPU:-}" ]; then
    log "part C: issue 39, scripts/gpu/envoy_run.sh with $(left) s left"
    step C-envoy 600 bash scripts/gpu/envoy_run.sh "$R/envoy"
  else
    log "part C: not run ($(left) s left${CPU:+; CPU mode})"
  fi
}

part_d() {
  log "part D: issue 35, two micro-batches per step (bench race, _overlap rows)"
  local m=${D_MODEL:-$ROOT/qwen3-4bit}
  [ -f "$m/config.json" ] || { log "part D: no checkpoint at $m (part A builds it)"; return; }
  step D-race 400 $MC bench race --model "$m" $GPUS --nodes 2 --streams "${D_STREAMS:-8,32}" \
    --rows "${D_ROWS:-ours_envoy,ours_envoy_overlap,ours_mlx,ours_mlx_overlap}" --no-stock \
    --max-tokens "${D_TOKENS:-24}" --json
  mv "$R/D-race.out" "$R/D-race.json" 2>/dev/null
}

part_x() {
  # X_SITES: "label=PYTHONPATH-prefix ..." (e.g. "old=/tmp/site-old new="): each tree's rows;
  # X_ROUTES: "skip measure": the route forced (wide calls to the host read from 64 positions, as
  # before the crossover) or measured at load with its crossover
  log "part X: bench race on the Qwen3 shape, per tree and route: ${X_SITES:-new=} / ${X_ROUTES:-skip measure}"
  local m=${X_MODEL:-$ROOT/qwen3-4bit}
  [ -f "$m/config.json" ] || build qwen3-4bit "${QWEN[@]}" || return
  for site in ${X_SITES:-new=}; do
    local label=${site%%=*} prefix=${site#*=}
    for route in ${X_ROUTES:-skip measure}; do
      local r=$route
      [ "$r" = measure ] && r=""
      PYTHONPATH="${prefix:+$prefix:}${PYTHONPATH:-}" MOE_CLUSTER_ROUTE=$r step "X-$label-$route" "${X_CAP:-200}" \
        $MC bench race --model "$m" $GPUS --nodes 2 --streams "${X_STREAMS:-1,8}" \
        --rows "${X_ROWS:-ours_mlx}" --no-stock --max-tokens "${X_TOKENS:-32}" --json
      mv "$R/X-$label-$route.out" "$R/X-$label-$route.json" 2>/dev/null
    done
  done
  if [ -n "${X_PEERS:-}" ]; then  # mlx-lm's rows on the same checkpoint, once
    step X-peers "${X_CAP:-200}" $MC bench race --model "$m" $GPUS --nodes 2 --streams "${X_STREAMS:-1,8}" \
      --rows "$X_PEERS" --no-stock --max-tokens "${X_TOKENS:-32}" --json
    mv "$R/X-peers.out" "$R/X-peers.json" 2>/dev/null
  fi
  timeout 10 python3 scripts/gpu/issue_summary.py "$R" --part X 2>&1 | tee -a "$R/$RUN.log"
}

for part in ${PARTS:-A B C}; do
  case $part in
    P) part_p ;;
    A) part_a ;;
    B) part_b ;;
    C) part_c ;;
    D) part_d ;;
    X) part_x ;;
    *) log "unknown part $part" ;;
  esac
done
log "done"

#!/usr/bin/env bash
# The quantized skip kernel on a GPU (node/moe/qskip.py): installs moe-cluster and MLX's CUDA
# backend from WHEEL_DIRs where given (scripts/gpu/setup.sh; without them, what /tmp/site holds),
# then scripts/gpu/qskip_probe.py: exactness against gather_qmm per format, then time per layer
# against m for a DBRX-like and a Qwen3-30B-A3B-like expert shape. One device call:
#   bash scripts/gpu/qskip_run.sh OUT [WHEEL_DIR...]     (OUT: e.g. $OUT/qskip)
# Writes OUT/qskip.jsonl (one JSON line per check or (shape, format, m)) and OUT/qskip.err.
# Env: SMALL=1 for 256 x 512 experts (a quick look).
set -u
OUT=${1:-/tmp/qskip}
shift || true
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ "$#" -gt 0 ]; then
  bash scripts/gpu/setup.sh "$@" || { echo "qskip_run: setup failed (rc $?)"; exit 1; }
else  # the probe runs this checkout's kernel: reinstall it over what /tmp/site holds
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --upgrade --target /tmp/site . \
    > /dev/null 2>&1 || echo "qskip_run: reinstall failed: the installed package stays"
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
echo "=== $(date +%T) qskip probe"
python3 scripts/gpu/qskip_probe.py ${SMALL:+--small} > "$OUT/qskip.jsonl" 2> "$OUT/qskip.err"
rc=$?
cat "$OUT/qskip.jsonl"; tail -20 "$OUT/qskip.err"
echo "=== $(date +%T) done (rc $rc)"
exit $rc

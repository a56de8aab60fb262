#!/usr/bin/env bash
# The CPU-side figures on a GPU host's idle cores (no GPU used): the envoy's all-reduce with its data
# channel against the gRPC stream alone, alternating in one session, the full all-reduce table, and
# shipping a shard over loopback (and across a namespace where this host lets us make one).
# Usage: scripts/gpu/host_bench.sh OUT   (after scripts/gpu/setup.sh; MLX's CPU backend is enough)
# OUT/done appears at the end. ROUNDS=3 A/B rounds by default; FULL=0 skips the full all-reduce table,
# SHIP=0 the shipping runs.
set -uo pipefail
OUT=${1:?usage: host_bench.sh OUT}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
MC="python3 -m moe_cluster.coordinator.cli"
{
  echo "cores: $(nproc), load: $(cut -d' ' -f1-3 /proc/loadavg), user: $(id -un)"
  python3 -c "import platform, mlx.core as mx, uvloop; print(platform.python_version(), 'mlx', mx.__version__, 'uvloop', uvloop.__version__)"
  lscpu | grep -E "Model name|^CPU\(s\)|Thread|Flags" | cut -c1-200
} > "$OUT/host.txt" 2>&1
for i in $(seq 1 "${ROUNDS:-3}"); do
  for data in 1 0; do
    MOE_CLUSTER_ENVOY_DATA=$data timeout 300 $MC bench allreduce --nodes 2 --tokens 1 --paths envoy,floor \
      --iters 1000 --json > "$OUT/ab-$i-data$data.json" 2> "$OUT/ab-$i-data$data.err"
  done
done
[ "${FULL:-1}" = 1 ] && timeout 600 $MC bench allreduce --nodes 2,4 --hidden 6144 --tokens 1,32 --dtype bfloat16 --json \
  > "$OUT/allreduce.json" 2> "$OUT/allreduce.err"
[ "${SHIP:-1}" = 1 ] || { touch "$OUT/done"; exit 0; }
DIR=/dev/shm  # the source file and the receiver's cache (4 GB); /tmp where /dev/shm is small (containers)
[ "$(df -k --output=avail /dev/shm 2>/dev/null | tail -1)" -gt 6000000 ] 2>/dev/null || DIR=/tmp
echo "ship dir: $DIR" >> "$OUT/host.txt"
timeout 300 $MC bench ship --size 2GB --dir "$DIR" --json > "$OUT/ship-loopback.json" 2> "$OUT/ship-loopback.err"
# across network namespaces: a veth between this namespace and one made here (root), no rate limit
NS=mcbench$$
if ip netns add $NS 2>> "$OUT/netns.err"; then
  ip link add mcb0$$ type veth peer name mcb1$$ && ip link set mcb1$$ netns $NS \
    && ip addr add 10.213.78.1/24 dev mcb0$$ && ip link set mcb0$$ up \
    && ip netns exec $NS ip addr add 10.213.78.2/24 dev mcb1$$ && ip netns exec $NS ip link set mcb1$$ up \
    && ip netns exec $NS ip link set lo up 2>> "$OUT/netns.err"
  timeout 300 $MC bench ship --size 2GB --dir "$DIR" --netns $NS --host 10.213.78.1 --json \
    > "$OUT/ship-netns.json" 2> "$OUT/ship-netns.err"
  ip link del mcb0$$ 2>/dev/null; ip netns del $NS
fi
touch "$OUT/done"

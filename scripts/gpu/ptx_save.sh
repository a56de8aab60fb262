#!/usr/bin/env bash
# Keep MLX's CUDA kernel cache (/tmp/mlx/<version>/ptx) for the next host: packed into OUT/ptx.tgz,
# which comes back with the call's files; carry its folder to the next host's scripts/gpu/setup.sh
# (mkdir .ptx && cp ptx.tgz .ptx/; setup.sh .ptx). The kernels are built for the card's
# architecture (sm_90a for H100 and H200 alike) and MLX's version names the folder, so a cache from
# another version is not read. Only whole kernels are packed: one a process is still writing (an
# ELF shorter than its section table says, or without its .txt) is left out, as MLX would fail to
# load it on the next host instead of building it again.
#   bash scripts/gpu/ptx_save.sh "$OUT"
set -eu
OUT=${1:?usage: ptx_save.sh OUT}
[ -d /tmp/mlx ] || { echo "ptx_save: no /tmp/mlx on this host (no kernel built yet)"; exit 0; }
cd /tmp/mlx
python3 - > /tmp/ptx_whole.txt <<'PY'
import glob, os, struct
for f in sorted(glob.glob("*/ptx/*.ptx")):
    b = open(f, "rb").read()
    if b[:4] != b"\x7fELF" or len(b) < 0x40 or not os.path.exists(f[:-4] + ".txt"):
        continue
    (shoff,) = struct.unpack_from("<Q", b, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", b, 0x3A)
    if len(b) >= shoff + shentsize * shnum:
        print(f, f[:-4] + ".txt", sep="\n")
PY
tar czf "$OUT/ptx.tgz" -T /tmp/ptx_whole.txt
echo "ptx_save: $(( $(wc -l < /tmp/ptx_whole.txt) / 2 )) of $(find /tmp/mlx -name '*.ptx' | wc -l) kernels whole, $(du -h "$OUT/ptx.tgz" | cut -f1) in $OUT/ptx.tgz"

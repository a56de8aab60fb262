#!/usr/bin/env bash
# Keep MLX's CUDA kernel cache (/tmp/mlx/<version>/ptx) for the next host: packed into OUT/ptx.tgz,
# which comes back with the call's files; carry its folder to the next host's scripts/gpu/setup.sh
# (mkdir .ptx && cp ptx.tgz .ptx/; setup.sh .ptx). The kernels are built for the card's
# architecture (sm_90a for H100 and H200 alike) and MLX's version names the folder, so a cache from
# another version is not read. Only whole kernels are packed: the files are copied first and the
# copies checked (the .ptx an ELF as long as its section table says, its .txt a non-empty list of
# "name<TAB>mangled name" lines), since a process may be writing one; MLX would fail to load a
# broken one on the next host instead of building it again.
#   bash scripts/gpu/ptx_save.sh "$OUT"
set -eu
OUT=$(realpath "${1:?usage: ptx_save.sh OUT}")
[ -d /tmp/mlx ] || { echo "ptx_save: no /tmp/mlx on this host (no kernel built yet)"; exit 0; }
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
cp -r /tmp/mlx/. "$STAGE/"
python3 - "$STAGE" <<'PY'
import glob, os, struct, sys

stage = sys.argv[1]
kept = dropped = 0
for f in sorted(glob.glob(f"{stage}/*/ptx/*.ptx")):
    txt = f[:-4] + ".txt"
    b = open(f, "rb").read()
    whole = b[:4] == b"\x7fELF" and len(b) >= 0x40
    if whole:
        (shoff,) = struct.unpack_from("<Q", b, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", b, 0x3A)
        whole = len(b) >= shoff + shentsize * shnum
    lines = open(txt).read().splitlines() if os.path.exists(txt) else []
    if whole and lines and all("\t" in line for line in lines):
        kept += 1
        continue
    dropped += 1
    for p in (f, txt, f[:-4] + ".cu"):
        if os.path.exists(p):
            os.remove(p)
print(f"ptx_save: {kept} kernels whole, {dropped} left out")
PY
tar czf "$OUT/ptx.tgz" -C "$STAGE" .
echo "ptx_save: $(du -h "$OUT/ptx.tgz" | cut -f1) in $OUT/ptx.tgz"

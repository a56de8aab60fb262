"""Regenerate the committed gRPC stubs from the .proto files: `python -m moe_cluster.proto.generate`.

protoc writes top-level imports (`import envoy_pb2`); they are rewritten to package-relative ones
so the stubs import as `moe_cluster.proto.*`. `tests/unit/test_proto_stubs.py` fails when the
committed stubs differ from what this produces.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PROTOS = ("envoy.proto", "node.proto", "ship.proto")
_IMPORT = re.compile(r"^import (\w+_pb2) as (\w+)$", re.MULTILINE)


def generated_names() -> list[str]:
    return [f"{Path(p).stem}{suffix}" for p in PROTOS for suffix in ("_pb2.py", "_pb2_grpc.py")]


def generate(out_dir: Path) -> list[Path]:
    """Run protoc on PROTOS into `out_dir`; returns the files written."""
    from grpc_tools import protoc  # the `test` extra; not needed at run time

    import grpc_tools

    include = Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"-I{include}",
            f"--python_out={tmp}",
            f"--grpc_python_out={tmp}",
            *PROTOS,
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {', '.join(PROTOS)} in {PROTO_DIR}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in generated_names():
            text = (Path(tmp) / name).read_text()
            text = _IMPORT.sub(r"from . import \1 as \2", text)
            (out_dir / name).write_text(text)
            written.append(out_dir / name)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default=str(PROTO_DIR), help="output folder (default: next to the .proto files)"
    )
    args = parser.parse_args(argv)
    for path in generate(Path(args.out)):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Print the README's table of families from the sweep: `python tests/families/table.py`.

Each row is measured now, on the installed mlx-lm: float32 at N = 2 and 3 (tokens and the largest
|Δlogit| against stock), and the family's quantization mode at N = 2.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import sweep  # noqa: E402
import tiny  # noqa: E402


def row(family: str, tmp: Path) -> str:
    kind = tiny.bank_kind(family)
    if tiny.needs_metal(family):
        return (f"| {family} | — | — | — | refused off Metal in one line: it calls mlx-lm's Metal-only kernels "
                "(stock mlx-lm cannot run it here either); untested on Metal |")
    path = sweep.checkpoint(family, tmp)
    ref = tiny.stock_tokens(path, sweep.PROMPT, sweep.STEPS)
    cells = []
    for nodes in (2, 3):
        got = sweep.check(path, nodes, ref)
        ok = got["tokens_match"] and got["max_abs_logit_diff"] <= sweep.TOLERANCE
        cells.append(f"{'exact' if ok else 'DIFFERS'} ({got['max_abs_logit_diff']:.0e})")
    mode = sweep.quant_mode(family)
    q = sweep.check(sweep.checkpoint(family, tmp, mode), 2)
    qok = q["tokens_match"] and q["max_abs_logit_diff"] <= sweep.QUANT_TOLERANCE
    return f"| {family} | {cells[0]} | {cells[1]} | {mode}: {'exact' if qok else 'DIFFERS'} | {kind} |"


def main() -> None:
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):  # some mlx-lm modules print on import
        families = tiny.families()
    print("| family | N = 2 (max \\|Δlogit\\|) | N = 3 | quantized, N = 2 | note |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for family in families:
            print(row(family, Path(tmp)), flush=True)


if __name__ == "__main__":
    main()

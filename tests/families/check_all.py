"""Build a tiny checkpoint of every mlx-lm MoE family, load it with stock mlx-lm, decode 8 tokens.

    python tests/families/check_all.py [family ...] [--quantize 4bit|8bit|mxfp4|mxfp8]

Prints one row per family: bank kind, MoE layers, experts hit (the fewest distinct experts any
bank ran while decoding: routing is not degenerate), seconds, ok / error with the reason.
Exit status 1 when any family fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import tiny  # noqa: E402

PROMPT = [1, 17, 42, 99, 7, 200, 3]


def check(model_type: str, quantize: str | None) -> tuple[str, str, float]:
    """(status, experts hit: the fewest distinct experts any bank ran over the decode, seconds)."""
    t0 = time.perf_counter()
    if tiny.needs_metal(model_type):
        return "skip: calls mlx_lm.kernels Metal kernels, no Metal back-end here", "-", 0.0
    hit = "-"
    try:
        from mlx_lm.utils import load_model

        with tempfile.TemporaryDirectory() as d:
            tiny.make_checkpoint(model_type, d, quantize=quantize)
            model, _ = load_model(Path(d))
            with tiny.record_routing(model) as seen:
                tokens, logits = tiny.decode(model, PROMPT, 8)
        if seen:
            hit = f"{min(len(v) for v in seen.values())}/{tiny.EXPERTS}"
        if len(tokens) != 8 or not (logits == logits).all():
            raise AssertionError(f"bad output: tokens={tokens} nan={not (logits == logits).all()}")
        status = "ok " + " ".join(map(str, tokens))
    except Exception as exc:
        if os.environ.get("TINY_TRACE"):
            traceback.print_exc()
        last = traceback.extract_tb(exc.__traceback__)[-1]
        where = f"{Path(last.filename).name}:{last.lineno}"
        status = (
            f"error {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''} ({where})"[
                :200
            ]
        )
    return status, hit, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("families", nargs="*")
    ap.add_argument("--quantize", choices=sorted(tiny.QUANT_MODES))
    args = ap.parse_args()
    t0 = time.perf_counter()
    found = tiny.families()
    survey = tiny._survey()
    names = args.families or found
    print(f"{len(found)} families with routed experts (survey {time.perf_counter() - t0:.1f}s)")
    for name, why in tiny.survey_errors().items():
        print(f"  not classified: {name}: {why}")
    print(f"{'family':22} {'bank':16} {'moe':>3} {'hit':>4} {'sec':>5}  status")
    failed = 0
    for name in names:
        kind, nmoe, _ = survey.get(name, ("?", 0, ""))
        status, hit, sec = check(name, args.quantize)
        failed += status.startswith("error")
        print(f"{name:22} {kind:16} {nmoe:>3} {hit:>4} {sec:5.2f}  {status}", flush=True)
    skipped = sum(tiny.needs_metal(n) for n in names)
    print(
        f"{len(names) - failed - skipped}/{len(names)} ok, {skipped} skipped, total {time.perf_counter() - t0:.1f}s"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

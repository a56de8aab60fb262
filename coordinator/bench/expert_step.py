"""`moe-cluster bench expert-step`: does a node at N > 1 read only its own experts?

One decode token's expert step (the local experts' MLP over the k positions the router picked) of
rank 0 of two nodes, each holding half of 2E experts, with m of the k positions this node's and
the rest the other node's, for m = 0 … k, timed through the node's own kernels
(node/moe/kernels.py):

- `redirected`: the device route (`Gather`): the other node's positions repeat a slot this node
  computes and are zeroed afterwards; gather_mm / gather_qmm read one expert per position;
- `sorted`: the same rows with the matmul told they are sorted, mlx-lm's path for wide batches
  (the node tells it so only from `SORTED_FROM` rows);
- `skip`: the skip route (`Skip`: skip_gemv for bfloat16/float16 weights, qskip for quantized
  ones; CUDA only): nothing read for the other node's positions.

If a node reads only its own experts, the skip route's time grows with m, about m experts' bytes,
while the redirected route's stays at k experts' whatever m. Before timing, the skip kernels pass
the check a node runs at load against gather_mm / gather_qmm at the weight's own shape
(`skip_fits`); each step also gives the largest difference between the two routes' outputs. Where
a route cannot run here (no CUDA device, float32 weights, MLX's CPU backend without a bfloat16
gather_mm), the case says why instead of a time.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import asdict, dataclass

from ...proto.errors import UserError


@dataclass(frozen=True)
class Shape:
    """A node's share of one MoE layer at N = 2: its local experts, each `width` wide on a
    `hidden`-wide model, and the router's top-k."""

    experts: int  # local to the node: half the layer's
    width: int
    hidden: int
    top_k: int


SHAPES = {
    "dbrx": Shape(8, 10752, 6144, 4),
    "qwen3-30b-a3b": Shape(64, 768, 2048, 8),
}
# --small: the same expert counts and top-k, 128 × 256 experts (a CPU runs it in seconds; still a
# multiple of the largest quantization group)
SMALL = (128, 256)
FORMATS = ("float", "affine-4-64", "affine-8-64", "mxfp4")  # mlx-community's usual ones
DTYPES = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class Format:
    """The experts' weights: `float` in the activations' dtype, or quantized (`mode`, bits,
    group) with scales in that dtype."""

    name: str
    mode: str | None = None  # None: not quantized
    bits: int = 0
    group: int = 0

    @classmethod
    def parse(cls, text: str) -> Format:
        if text == "float":
            return cls(text)
        if text == "mxfp4":
            return cls(text, "mxfp4", 4, 32)
        parts = text.split("-")
        if len(parts) == 3 and parts[0] == "affine" and parts[1].isdigit() and parts[2].isdigit():
            return cls(text, "affine", int(parts[1]), int(parts[2]))
        raise UserError(
            f"--formats: {text!r} is not float, mxfp4 or affine-BITS-GROUP (e.g. affine-4-64)"
        )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shapes",
        default=",".join(SHAPES),
        help=f"comma-separated expert shapes at N = 2, of {', '.join(SHAPES)} (default: both)",
    )
    p.add_argument(
        "--formats",
        default=",".join(FORMATS),
        help="comma-separated weight formats: float (the --dtype), affine-BITS-GROUP, mxfp4 "
        f"(default: {','.join(FORMATS)})",
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="activations and float weights (default: bfloat16 on a GPU, float32 on a CPU, whose "
        "MLX backend has no bfloat16 gather_mm)",
    )
    p.add_argument("--iters", type=int, default=30, help="timed calls per route and m (median)")
    p.add_argument(
        "--small", action="store_true", help="128 × 256 experts of the same counts (a quick run)"
    )
    p.add_argument("--json", action="store_true", help="print the JSON only")


def _shapes(text: str) -> list[str]:
    names = [s for s in text.split(",") if s]
    bad = [s for s in names if s not in SHAPES]
    if bad or not names:
        raise UserError(f"--shapes: {','.join(bad) or text!r} not among {', '.join(SHAPES)}")
    return names


def _median_s(fn, iters: int) -> float:
    """Seconds per call of `fn` (an MLX graph), evaluated: the median of `iters` calls after one
    untimed call (kernels built, weights read once)."""
    import mlx.core as mx

    mx.eval(fn())
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _projections(shape: Shape, fmt: Format, dtype):
    """gate, up, down as the node holds them (ShardLinear), random, in `fmt`."""
    import mlx.core as mx

    from ...node.moe.kernels import ShardLinear

    e, f, d = shape.experts, shape.width, shape.hidden
    out = []
    for dims in ((e, f, d), (e, f, d), (e, d, f)):
        w = (mx.random.normal(dims) * 0.02).astype(dtype)
        if fmt.mode is None:
            mx.eval(w)
            out.append(ShardLinear(w))
            continue
        q = mx.quantize(w, group_size=fmt.group, bits=fmt.bits, mode=fmt.mode)
        mx.eval(*q)
        quant = {"group_size": fmt.group, "bits": fmt.bits, "mode": fmt.mode}
        out.append(ShardLinear(q[0], scales=q[1], biases=q[2] if len(q) > 2 else None, quant=quant))
        del w
    return out


def _routed(shape: Shape, mine: int):
    """The plan of one token on rank 0 whose first `mine` positions pick its own experts (m
    distinct ones) and the rest the other node's (expert e < E is rank 0's slot e)."""
    import mlx.core as mx
    import numpy as np

    from ...node.moe.plan import Routed, SlotTables

    e = shape.experts
    slot = np.where(np.arange(2 * e) < e, np.arange(2 * e), -1)
    inds = [i for i in range(mine)] + [e + i for i in range(shape.top_k - mine)]
    return Routed(mx.array([inds], dtype=mx.int32), SlotTables.fixed(slot))


def _sorted_step(mlp, x, r):
    """The redirected rows (as `Gather` makes them) with gather_mm / gather_qmm told they are
    sorted: mlx-lm's path, which the node takes only from SORTED_FROM rows."""
    import mlx.core as mx

    rows = mx.expand_dims(x, (-2, -3))  # (1, 1, 1, D)
    slots = mx.where(r.mine, r.safe, r.safe.max())  # (1, k)
    gate, up, down = mlp.projections
    h = mlp.activation(up.gather(rows, slots, True), gate.gather(rows, slots, True))
    y = down.gather(h, slots, True).squeeze(-2)  # (1, k, D)
    return mx.where(r.mine[..., None], y, 0.0)


def measure_case(name: str, fmt: Format, dtype_name: str, iters: int, small: bool) -> dict:
    """One shape in one format: why a route cannot run, or its time at every m."""
    import mlx.core as mx
    from mlx_lm.models.switch_layers import SwiGLU

    from ...node.moe import skip_gemv
    from ...node.moe.kernels import ExpertMLP, Gather, Skip, skip_fits

    shape = SHAPES[name]
    if small:
        shape = Shape(shape.experts, *SMALL, shape.top_k)
    dtype = getattr(mx, dtype_name)
    case = {"shape": name, **asdict(shape), "format": fmt.name, "dtype": dtype_name}
    try:
        projs = _projections(shape, fmt, dtype)
    except (ValueError, RuntimeError) as exc:  # a format MLX does not quantize to here
        return {**case, "error": f"{type(exc).__name__}: {exc}"}
    mlp = ExpertMLP(projs, "glu", SwiGLU())
    case["expert_bytes"] = (
        sum(
            sum(a.nbytes for a in (p.weight, p.get("scales"), p.get("biases")) if a is not None)
            for p in projs
        )
        // shape.experts
    )
    gather = Gather(mlp)
    case["redirected"] = (
        None
        if mlp.gathered
        else f"MLX's {mx.default_device().type.name.upper()} backend has no {dtype_name} "
        "gather_mm: a node takes the host route"
    )
    if skip_gemv.available():
        why, skip_dtype = skip_fits(mlp)  # the check a node runs at load
    else:
        why, skip_dtype = f"no skip kernel on {mx.default_device()} (CUDA only)", None
    case["skip"] = why
    skip = Skip(mlp, skip_dtype, gather) if why is None else None
    x = (mx.random.normal((1, shape.hidden)) * 0.5).astype(dtype)
    steps = []
    for m in range(shape.top_k + 1):
        r = _routed(shape, m)
        step = {"mine": m}
        if case["redirected"] is None:
            step["redirected_ms"] = 1e3 * _median_s(lambda: gather(x, r), iters)
            step["sorted_ms"] = 1e3 * _median_s(lambda: _sorted_step(mlp, x, r), iters)
            step["redirected_GB_per_s_if_k_read"] = (
                shape.top_k * case["expert_bytes"] / step["redirected_ms"] / 1e6
            )
        if skip is not None:
            step["skip_ms"] = 1e3 * _median_s(lambda: skip(x, r), iters)
            if m:
                step["skip_GB_per_s_of_mine"] = m * case["expert_bytes"] / step["skip_ms"] / 1e6
            if case["redirected"] is None:
                got, want = skip(x, r).astype(mx.float32), gather(x, r).astype(mx.float32)
                step["max_abs_diff"] = mx.abs(got - want).max().item()
                step["speedup"] = step["redirected_ms"] / step["skip_ms"]
        steps.append(step)
        mx.clear_cache()
    case["steps"] = steps
    return case


def run(shapes: list[str], formats: list[Format], dtype: str | None, iters: int, small: bool):
    import mlx.core as mx

    from ...node.moe import skip_gemv

    on_gpu = mx.default_device().type == mx.DeviceType.gpu
    dtype = dtype or ("bfloat16" if on_gpu else "float32")
    return {
        "device": str(mx.default_device()),
        "host": platform.node(),
        "mlx": mx.__version__,
        "skip_kernels": skip_gemv.available(),
        "dtype": dtype,
        "iters": iters,
        "small": small,
        "cases": [measure_case(s, f, dtype, iters, small) for s in shapes for f in formats],
    }


def _ms(v) -> str:
    return "–" if v is None else f"{v:.3f}"


def report(out: dict) -> str:
    lines = [
        f"{out['device']}, MLX {out['mlx']}, {out['dtype']} activations, median of "
        f"{out['iters']} calls; ms per decode token's expert step, rank 0 of 2"
    ]
    for c in out["cases"]:
        lines.append("")
        head = f"{c['shape']} ({c['experts']} local experts, {c['width']} × {c['hidden']}, "
        lines.append(head + f"top-{c['top_k']}), {c['format']}")
        if "error" in c:
            lines.append(f"  not run: {c['error']}")
            continue
        for route in ("redirected", "skip"):
            if c[route]:
                lines.append(f"  {route}: not run: {c[route]}")
        lines.append("  mine  redirected  sorted  skip")
        for s in c["steps"]:
            lines.append(
                f"  {s['mine']:>4}  {_ms(s.get('redirected_ms')):>10}  "
                f"{_ms(s.get('sorted_ms')):>6}  {_ms(s.get('skip_ms')):>6}"
            )
    return "\n".join(lines)


def main(args) -> int:
    if args.iters < 1:
        raise UserError(f"--iters must be at least 1 (got {args.iters})")
    formats = [Format.parse(f) for f in args.formats.split(",") if f]
    out = run(_shapes(args.shapes), formats, args.dtype, args.iters, args.small)
    print(json.dumps(out) if args.json else report(out))
    return 0

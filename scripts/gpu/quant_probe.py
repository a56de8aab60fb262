"""Why do the family sweep's quantized rows fail on CUDA (GPU run 10: 39 of them, stock mlx-lm's own
reference NaN in the one read)? Two parts, one JSON line each:

1. `op`: MLX's quantized matmuls on this device against the same weights dequantized, per mode
   and shape of the tiny checkpoints (in 32/64, batch 1 and 8): finite or not, and |Δ|.
2. `module`: for a few families' quantized checkpoints, each quantized module with its own weights
   on a random input, on the GPU against the CPU, and the GPU twice (is it deterministic?).
3. `family`: every MoE family's quantized tiny checkpoint (the sweep's mode for it), decoded by
   stock mlx-lm on the GPU and on the CPU, and by the cluster path at N = 2 on the GPU: whether each
   is finite, and which agree.

    PYTHONPATH=/tmp/site python3 scripts/gpu/quant_probe.py [--modules-only] > quant.jsonl
"""

import json
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "families"))
import sweep  # noqa: E402
import tiny  # noqa: E402

MODES = {
    "4bit": ("affine", 32, 4),
    "8bit": ("affine", 32, 8),
    "mxfp4": ("mxfp4", 32, 4),
    "mxfp8": ("mxfp8", 32, 8),
}


def ops() -> None:
    for name, (mode, group, bits) in MODES.items():
        for d_in, d_out in ((64, 32), (32, 64), (64, 64)):
            w = mx.random.normal((4, d_out, d_in)) * 0.05
            q = mx.quantize(w, group_size=group, bits=bits, mode=mode)
            wq, scales = q[0], q[1]
            biases = q[2] if len(q) > 2 else None
            dense = mx.dequantize(wq, scales, biases, group_size=group, bits=bits, mode=mode)
            for batch in (1, 8):
                x = mx.random.normal((batch, d_in))
                got = mx.quantized_matmul(
                    x,
                    wq[1],
                    scales[1],
                    None if biases is None else biases[1],
                    transpose=True,
                    group_size=group,
                    bits=bits,
                    mode=mode,
                )
                inds = mx.array([2] * batch, dtype=mx.uint32)
                gathered = mx.gather_qmm(
                    x[:, None, :],
                    wq,
                    scales,
                    biases,
                    rhs_indices=inds,
                    transpose=True,
                    group_size=group,
                    bits=bits,
                    mode=mode,
                )[:, 0, :]
                for op, y, ref in (
                    ("quantized_matmul", got, x @ dense[1].T),
                    ("gather_qmm", gathered, x @ dense[2].T),
                ):
                    y32, r32 = np.array(y.astype(mx.float32)), np.array(ref.astype(mx.float32))
                    print(
                        json.dumps(
                            {
                                "part": "op",
                                "op": op,
                                "mode": name,
                                "in": d_in,
                                "out": d_out,
                                "batch": batch,
                                "finite": bool(np.isfinite(y32).all()),
                                "max_abs_diff": float(np.nanmax(np.abs(y32 - r32)))
                                if np.isfinite(y32).any()
                                else None,
                            }
                        ),
                        flush=True,
                    )


MODULE_FAMILIES = ("qwen3_moe", "gpt_oss", "mixtral")


def modules(tmp: Path) -> None:
    import mlx.nn as nn
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear
    from mlx_lm.utils import load_model

    for family in MODULE_FAMILIES:
        model, _ = load_model(sweep.checkpoint(family, tmp, sweep.quant_mode(family)))
        for name, m in model.named_modules():
            kind = type(m).__name__
            if isinstance(m, nn.QuantizedEmbedding):
                x = mx.array([[1, 5, 9, 200 % m.num_embeddings]])
                run = (
                    (lambda m=m, x=x: m(x)),
                    (lambda m=m, x=x: m.as_linear(mx.ones((1, 4, m.dims)))),
                )
            elif isinstance(m, nn.QuantizedLinear):
                d_in = m.scales.shape[-1] * m.group_size
                x = mx.random.normal((1, 8, d_in), key=mx.random.key(1))
                run = (lambda m=m, x=x: m(x),)
            elif isinstance(m, QuantizedSwitchLinear):
                d_in = m.scales.shape[-1] * m.group_size
                x = mx.random.normal((1, 8, 1, 1, d_in), key=mx.random.key(1))
                inds = mx.array(
                    [[[i % m.num_experts, (i + 1) % m.num_experts] for i in range(8)]],
                    dtype=mx.uint32,
                )
                run = (lambda m=m, x=x, inds=inds: m(x, inds),)
            else:
                continue
            for i, f in enumerate(run):
                gpu, again = np.array(f().astype(mx.float32)), np.array(f().astype(mx.float32))
                with mx.stream(mx.cpu):
                    cpu = np.array(f().astype(mx.float32))
                print(
                    json.dumps(
                        {
                            "part": "module",
                            "family": family,
                            "module": name,
                            "kind": kind,
                            "call": i,
                            "gpu_vs_cpu": float(np.max(np.abs(gpu - cpu))),
                            "gpu_vs_gpu": float(np.max(np.abs(gpu - again))),
                        }
                    ),
                    flush=True,
                )


def families(tmp: Path) -> None:
    from moe_cluster.node.moe.load import load_in_process

    for family in tiny.families():
        row = {"part": "family", "family": family, "mode": sweep.quant_mode(family)}
        try:
            if tiny.needs_metal(family):
                row["skipped"] = "Metal-only kernels"
                print(json.dumps(row), flush=True)
                continue
            path = sweep.checkpoint(family, tmp, row["mode"])
            gpu_tokens, gpu_logits = tiny.stock_tokens(path, sweep.PROMPT, sweep.STEPS)
            with mx.stream(mx.cpu):
                cpu_tokens, cpu_logits = tiny.stock_tokens(path, sweep.PROMPT, sweep.STEPS)
            sm = load_in_process(str(path), 2, keepalive="lru")
            ours_tokens, ours_logits = tiny.decode(sm.model, sweep.PROMPT, sweep.STEPS)
            finite = {
                k: bool(np.isfinite(v).all())
                for k, v in (
                    ("stock_gpu", gpu_logits),
                    ("stock_cpu", cpu_logits),
                    ("ours_gpu", ours_logits),
                )
            }
            row.update(
                finite=finite,
                stock_gpu_vs_cpu=float(np.max(np.abs(gpu_logits - cpu_logits))),
                ours_vs_stock_gpu=float(np.max(np.abs(ours_logits - gpu_logits))),
                ours_vs_stock_cpu=float(np.max(np.abs(ours_logits - cpu_logits))),
                tokens={"stock_gpu": gpu_tokens, "stock_cpu": cpu_tokens, "ours_gpu": ours_tokens},
            )
        except Exception as e:  # one family's failure is a finding, not the end of the probe
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    print(
        json.dumps({"part": "device", "device": str(mx.default_device()), "mlx": mx.__version__}),
        flush=True,
    )
    ops()
    with tempfile.TemporaryDirectory() as d:
        modules(Path(d))
        if "--modules-only" not in sys.argv:
            families(Path(d))

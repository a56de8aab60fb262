"""Why a 4-bit DBRX shape fails inside MLX on CUDA (scripts/gpu/issue_run.sh part P): stock
mlx-lm's DBRX block calls each routed expert's QuantizedLinear on one token at a time, a 1-D
input; this calls one (DBRX's expert shape, 4-bit, group 64) with a 1-D and a 2-D input."""

import mlx.core as mx
import mlx.nn as nn

q = nn.QuantizedLinear(6144, 10752, bias=False, group_size=64, bits=4)
print("device:", mx.default_device(), flush=True)
for shape in ((6144,), (1, 6144)):
    try:
        y = q(mx.ones(shape, dtype=mx.bfloat16))
        mx.eval(y)
        print(f"input {shape}: output {y.shape}", flush=True)
    except Exception as exc:  # noqa: BLE001 - the probe reports what MLX does
        print(f"input {shape}: {type(exc).__name__}: {exc}", flush=True)

# stock mlx-lm's DBRX block itself, small and 4-bit, on one token and on two
import traceback  # noqa: E402

from mlx_lm.models import dbrx  # noqa: E402

args = dbrx.ModelArgs(
    model_type="dbrx",
    vocab_size=256,
    d_model=256,
    ffn_config={"ffn_hidden_size": 128, "moe_num_experts": 16, "moe_top_k": 4},
    attn_config={"kv_n_heads": 2, "clip_qkv": 8, "rope_theta": 10000},
    n_layers=1,
    n_heads=4,
)
block = dbrx.SparseMoeBlock(args)
nn.quantize(block, group_size=64, bits=4)
for tokens in (1, 2):
    try:
        y = block(mx.ones((1, tokens, 256), dtype=mx.bfloat16))
        mx.eval(y)
        print(f"dbrx block, {tokens} token(s): output {y.shape}", flush=True)
    except Exception as exc:  # noqa: BLE001
        frames = traceback.extract_tb(exc.__traceback__)[-3:]
        where = "; ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.line}" for f in frames)
        print(f"dbrx block, {tokens} token(s): {type(exc).__name__}: {exc} ({where})", flush=True)

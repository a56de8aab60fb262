"""gpt-oss: the Hugging Face release stores experts in mxfp4 with gate and up rows interleaved.

The bank itself is a generic `SwitchGLU` (with biases and the clamped SwiGLU of gpt-oss), so only
reading differs: `mlp.experts.gate_up_proj_blocks` (E, 2F, D/32, 16) uint8 with `_scales` and
`_bias`, rows g0, u0, g1, u1, ...; `down_proj_blocks`/`_scales`/`_bias`.
"""

from __future__ import annotations

import mlx.core as mx

from ...checkpoint import read_tensor


def find_bank(model, path, module):
    return None


def _blocks_to_weight(blocks: mx.array) -> mx.array:
    """(E, out, in/32, 16) uint8 -> (E, out, in/8) uint32, as mlx-lm's sanitize does."""
    return blocks.view(mx.uint32).flatten(-2)


def read_experts(ckpt, block, local):
    t = ckpt.tensors
    base = block.bank_path
    if f"{base}.gate_up_proj_blocks" not in t:
        return None
    if not local:
        return {p: {"weight": None} for p in ("gate_proj", "up_proj", "down_proj")}
    gu_w = _blocks_to_weight(read_tensor(t[f"{base}.gate_up_proj_blocks"], local))
    gu_s = read_tensor(t[f"{base}.gate_up_proj_scales"], local)
    gu_b = read_tensor(t[f"{base}.gate_up_proj_bias"], local)
    out = {}
    for proj, start in (("gate_proj", 0), ("up_proj", 1)):
        out[proj] = {
            "weight": mx.contiguous(gu_w[:, start::2]),
            "scales": mx.contiguous(gu_s[:, start::2]),
            "bias": mx.contiguous(gu_b[:, start::2]),
        }
    out["down_proj"] = {
        "weight": _blocks_to_weight(read_tensor(t[f"{base}.down_proj_blocks"], local)),
        "scales": read_tensor(t[f"{base}.down_proj_scales"], local),
        "bias": read_tensor(t[f"{base}.down_proj_bias"], local),
    }
    return out


def forward(block):
    return None

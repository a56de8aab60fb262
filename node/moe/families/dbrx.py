"""DBRX: its experts are a Python list of MLP modules run token by token, not a SwitchGLU bank.

mlx-lm's `SparseMoeBlock` loops over tokens and calls `experts[e](x_t)`, so there is no bank to
swap. This adapter treats `ffn.experts` as the bank (w1 = gate, v1 = up, w2 = down), gives the
cluster layer a forward with the same routing math that calls the bank once for all tokens, and reads
the fused Hugging Face layout (`ffn.experts.mlp.{w1,v1,w2}`, shape (E*F, D), w2 transposed).
"""

from __future__ import annotations

import mlx.core as mx

from ...checkpoint import read_tensor


def _is_dbrx_block(module) -> bool:
    from mlx_lm.models.dbrx import SparseMoeBlock

    return isinstance(module, SparseMoeBlock)


def _swiglu(up, gate):
    from mlx_lm.models.activations import swiglu

    return swiglu(gate, up)


def find_bank(model, path, module):
    if not _is_dbrx_block(module):
        return None
    from ..bank import Bank

    return Bank(
        "experts",
        module.experts,
        "glu",
        _swiglu,
        module.num_experts,
        module.d_model,
        module.d_model,
        "list",
    )


def read_experts(ckpt, block, local):
    if not _is_dbrx_block(block.block):
        return None
    fused = {w: ckpt.tensors.get(f"{block.path}.experts.mlp.{w}") for w in ("w1", "v1", "w2")}
    if not all(fused.values()):
        return None  # the mlx layout: one tensor per expert, read generically
    out = {}
    for w, proj in (("w1", "gate_proj"), ("v1", "up_proj"), ("w2", "down_proj")):
        info = fused[w]
        ffn = info.shape[0] // block.num_experts
        if not local:
            out[proj] = {"weight": None}
            continue
        rows = [e * ffn + i for e in local for i in range(ffn)]
        v = read_tensor(info, rows).reshape(len(local), ffn, -1)  # (E_local, F, D)
        out[proj] = {"weight": mx.contiguous(v.swapaxes(1, 2)) if w == "w2" else v}
    return out


def _forward(self, x: mx.array) -> mx.array:
    """mlx-lm's DBRX routing (softmax in float32, top-k, L1-normalised), experts in one call."""
    ne = self.num_experts_per_tok
    orig_shape = x.shape
    x = x.reshape(-1, x.shape[-1])
    gates = mx.softmax(self.router(x).astype(mx.float32), axis=-1)
    inds = mx.stop_gradient(mx.argpartition(-gates, kth=ne - 1, axis=-1)[:, :ne])
    scores = mx.take_along_axis(gates, inds, axis=-1)
    scores = scores / mx.linalg.norm(scores, ord=1, axis=-1, keepdims=True)
    scores = scores.astype(x.dtype)
    y = self.experts(x, inds)  # (T, ne, D)
    y = (y * scores[:, :, None]).sum(axis=1)
    return y.reshape(orig_shape)


def forward(block):
    return _forward if _is_dbrx_block(block) else None

"""`moe-cluster profile`: which experts a model's routers pick on real prompts, per MoE layer.

Runs the model on one machine (stock mlx-lm, every expert present), records each token's selected
experts in every MoE layer during prefill and generation, and writes
`{"model", "num_experts", "top_k", "layers": {"<layer>": {"counts", "tokens", "sets"}}}` — the
input of profile-guided placement (cluster.yaml `placement.profile`) and of `plan --profile`.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ...proto.errors import UserError

MAX_SETS = 50_000  # token selections kept per layer (the counts always cover every token)


class _Recorder(nn.Module):
    """Stands in for an expert bank: notes the selection, then computes exactly as the bank does."""

    def __init__(self, bank, sink: list):
        super().__init__()
        self.bank = bank
        self._sink = sink

    def __call__(self, x, inds):
        self._sink.append(np.array(inds).reshape(-1, inds.shape[-1]))
        if isinstance(self.bank, list):  # DBRX keeps its experts as a list of modules
            flat = x.reshape(-1, x.shape[-1])
            rows = np.array(inds).reshape(flat.shape[0], -1)
            out = [
                mx.stack([self.bank[int(e)](flat[t]) for e in rows[t]])
                for t in range(flat.shape[0])
            ]
            return mx.stack(out).reshape(*inds.shape, x.shape[-1])
        return self.bank(x, inds)


class _Forward(nn.Module):
    """A MoE block called through its described forward (a family adapter's calls the bank once)."""

    def __init__(self, moe):
        super().__init__()
        self.block = moe.block
        self._forward = moe.forward

    def __call__(self, x, *args, **kwargs):
        return self._forward(self.block, x, *args, **kwargs)


def profile(model_spec: str, prompts: list[str], max_tokens: int) -> dict:
    from mlx_lm import load

    from ...node.checkpoint import Checkpoint
    from ...node.engine import generate_tokens
    from ...proto.records import Sampling
    from ...node.moe.layer import install
    from ...node.moe.load import ShardError
    from ...node.describe import describe
    from ...node.moe.structure import rebind, set_bank
    from .run_local import encode_prompt

    ckpt = Checkpoint.open(model_spec)
    desc = describe(ckpt)  # probed on a model of its own: the loaded weights stay as they are
    model, tokenizer = load(str(ckpt.path))
    blocks = rebind(desc.blocks, model)
    if not blocks:
        raise ShardError(f"{ckpt.path} has no MoE layers to profile")
    sinks: dict[int, list] = {}
    for b in blocks:
        sinks[b.layer] = []
        set_bank(b.block, b.bank_attr, _Recorder(b.bank.module, sinks[b.layer]))
        install(model, b.path, _Forward(b))
    top_k = 0
    for text in prompts:
        ids = encode_prompt(tokenizer, text)
        for _ in generate_tokens(
            model, ids, Sampling(max_tokens=max_tokens), eos_token_ids=tokenizer.eos_token_ids
        ):
            pass
    layers = {}
    num_experts = blocks[0].num_experts
    for b in blocks:
        sel = np.concatenate(sinks[b.layer]) if sinks[b.layer] else np.zeros((0, 1), dtype=np.int64)
        top_k = max(top_k, sel.shape[1])
        counts = np.bincount(sel.reshape(-1), minlength=b.num_experts)
        step = max(1, len(sel) // MAX_SETS)
        layers[str(b.layer)] = {
            "counts": [int(c) for c in counts],
            "tokens": int(len(sel)),
            "sets": [sorted(int(e) for e in row) for row in sel[::step]],
        }
    return {
        "model": str(ckpt.path),
        "num_experts": num_experts,
        "top_k": top_k,
        "layers": layers,
        "prompts": len(prompts),
        "max_tokens": max_tokens,
    }


def read_prompts(path: str) -> list[str]:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise UserError(f"cannot read prompts file {path}: {exc.strerror or exc}") from None
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if p.suffix == ".jsonl":
        try:
            prompts = [
                json.loads(line)["prompt"] if line.startswith("{") else line for line in prompts
            ]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise UserError(
                f'prompts file {path}: a line is not {{"prompt": ...}} JSON ({exc})'
            ) from None
    if not prompts:
        raise UserError(f"prompts file {path} has no prompts (one per line)")
    return prompts


def main(args) -> int:
    out = profile(args.model, read_prompts(args.prompts), args.max_tokens)
    Path(args.out).write_text(json.dumps(out) + "\n")
    skew = []
    for layer, v in out["layers"].items():
        c = np.array(v["counts"], dtype=float)
        skew.append(c.max() / max(c.mean(), 1e-9))
    print(
        f"profiled {len(out['layers'])} MoE layers over {next(iter(out['layers'].values()))['tokens']} tokens "
        f"-> {args.out} (hottest expert {np.mean(skew):.1f}x the mean load)"
    )
    return 0

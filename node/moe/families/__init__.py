"""Adapters for model families that break the generic MoE rule, one module per family.

The generic rule (node/shard.py): a MoE block owns a `SwitchGLU`/`SwitchMLP` bank whose experts
are stacked or stored one tensor per expert. An adapter says why its family differs and supplies
only the part that differs:

- `find_bank(model, path, module)`: the bank of a block the generic search cannot see;
- `read_experts(ckpt, block, local)`: expert tensors in a checkpoint layout of its own;
- `patch_forward(block)`: a block forward that calls the bank as `bank(x, inds)`.
"""

from __future__ import annotations

from . import dbrx, gpt_oss

_ADAPTERS = (dbrx, gpt_oss)


def find_bank(model, path, module):
    for a in _ADAPTERS:
        found = a.find_bank(model, path, module)
        if found is not None:
            return found
    return None


def read_experts(ckpt, block, local):
    for a in _ADAPTERS:
        out = a.read_experts(ckpt, block, local)
        if out is not None:
            return out
    return None


def patch_forward(block) -> None:
    for a in _ADAPTERS:
        a.patch_forward(block)

"""Adapters for model families whose structure the generic rule cannot read, one module per family.

The generic rule (node/moe/structure.py): a MoE block owns a `SwitchGLU`/`SwitchMLP` bank whose
experts are stacked or stored one tensor per expert, and calls it as `bank(x, inds)`. An adapter
says why its family differs and supplies only the part that differs:

- `find_bank(model, path, module)`: the bank (a `bank.Bank`) of a block the generic search
  cannot see;
- `read_experts(ckpt, block, local)`: expert tensors in a checkpoint layout of its own;
- `forward(block)`: a block forward that calls the bank as `bank(x, inds)`, or None.
"""

from __future__ import annotations

from . import dbrx, gpt_oss

_ADAPTERS = (dbrx, gpt_oss)


def _first(method: str, *args):
    for a in _ADAPTERS:
        found = getattr(a, method)(*args)
        if found is not None:
            return found
    return None


def find_bank(model, path, module):
    return _first("find_bank", model, path, module)


def read_experts(ckpt, block, local):
    return _first("read_experts", ckpt, block, local)


def forward(block):
    return _first("forward", block)

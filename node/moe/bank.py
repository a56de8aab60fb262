"""An expert bank as the structure rule finds it in a module tree: a record shared by the rule
(structure.py) and the family adapters (families/), which must not import the rule back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

GLU_PROJ = ("gate_proj", "up_proj", "down_proj")
MLP_PROJ = ("fc1", "fc2")


@dataclass
class Bank:
    """An expert bank as found in the module tree."""

    attr: (
        str  # attribute path from the block to the bank, e.g. "switch_mlp" or "experts.switch_mlp"
    )
    module: object
    kind: str  # "glu" (gate/up/down) or "mlp" (fc1/fc2)
    activation: Callable
    num_experts: int
    in_dims: int
    out_dims: int
    layout: str  # "stacked" (one (E, ...) tensor per projection) or "list" (one module per expert)

    @property
    def projections(self) -> tuple[str, ...]:
        return GLU_PROJ if self.kind == "glu" else MLP_PROJ

"""How many of a node's experts stay resident: `placement.expert_cache` (off | auto | SIZE | PCT%).

Shared by cluster.yaml, the CLI and the node; imports no mlx.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Mapping

from .errors import UserError

SIZE_UNITS = {  # also cluster.yaml's sizes (coordinator/serve/config.py)
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


@dataclass(frozen=True)
class ExpertCacheSpec:
    """off: every local expert resident (today's behaviour); fraction: that share of each layer's
    local experts; bytes: a budget for the resident experts of all layers; auto: sized from the
    node's memory budget (the caller passes it as bytes)."""

    mode: str = "off"  # off | auto | fraction | bytes
    value: float = 0.0

    @classmethod
    def parse(cls, text: str | int | float | None) -> "ExpertCacheSpec":
        if text is None:
            return cls()
        if isinstance(text, (int, float)) and not isinstance(text, bool):
            if text <= 0:
                raise UserError(f"expert_cache must be positive (got {text})")
            return cls("bytes", float(text))
        s = str(text).strip().lower()
        if s in ("off", "auto"):
            return cls(s)
        m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*%", s)
        if m:
            pct = float(m[1])
            if not 0 < pct <= 100:
                raise UserError(f"expert_cache percent must be in (0, 100] (got {text!r})")
            return cls("fraction", pct / 100)
        m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]*)", s)
        if not m or m[2] not in SIZE_UNITS or float(m[1]) <= 0:
            raise UserError(
                f"expert_cache must be off, auto, a size (8GB) or a percent (50%) (got {text!r})"
            )
        return cls("bytes", float(m[1]) * SIZE_UNITS[m[2]])

    @property
    def active(self) -> bool:
        return self.mode != "off"

    def __str__(self) -> str:
        if self.mode == "fraction":
            return f"{self.value * 100:g}%"
        if self.mode == "bytes":
            return f"{int(self.value)}B"
        return self.mode

    def capacities(
        self,
        local: Mapping[int, int],
        expert_bytes: Mapping[int, int],
        budget_bytes: int | None = None,
    ) -> dict[int, int]:
        """{layer: C}, 1 <= C <= E_local: resident slots per MoE layer for `local` experts per layer
        of `expert_bytes` each. `auto` needs `budget_bytes` (what the node may spend on experts);
        without one it keeps everything."""
        if self.mode == "off" or (self.mode == "auto" and budget_bytes is None):
            return dict(local)
        if self.mode == "fraction":
            return {l: min(n, max(1, math.ceil(n * self.value))) for l, n in local.items()}
        budget = self.value if self.mode == "bytes" else float(budget_bytes)
        full = sum(local[l] * expert_bytes[l] for l in local)
        if full <= budget:
            return dict(local)
        # the same share of every layer, at least one slot each
        share = max(budget, 0) / full if full else 1.0
        return {l: min(n, max(1, math.floor(n * share))) for l, n in local.items()}


def auto_budget(
    replicated_bytes: int,
    reserve_bytes: int,
    *,
    metal: Mapping | None = None,
    given_bytes: int | None = None,
) -> int | None:
    """Bytes `auto` may keep resident of a node's experts.

    Args:
        metal: MLX's description of the node's Metal GPU (`mx.device_info()` on a Mac; None or {}
            elsewhere). Its `max_recommended_working_set_size`, less the replicated weights and
            `reserve_bytes` (the KV and prompt caches), bounds the experts.
        given_bytes: a budget from elsewhere (the coordinator's): the bound off Metal, and on Metal
            the experts stay within both. None off Metal: no bound, every expert resident.

    At least 0: a node that cannot even hold its replicated weights keeps one expert per layer
    (`ExpertCacheSpec.capacities`' floor).
    """
    working_set = int((metal or {}).get("max_recommended_working_set_size") or 0)
    if working_set:
        room = max(working_set - int(replicated_bytes) - int(reserve_bytes), 0)
        return room if given_bytes is None else min(room, int(given_bytes))
    return None if given_bytes is None else int(given_bytes)

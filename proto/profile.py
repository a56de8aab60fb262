"""A routing profile, the record `moe-cluster profile` writes: per decoder layer, how often each
expert was selected and the selections themselves. The planner reads it for E and hot-expert
replication, `up` for a profile-guided placement; it imports no mlx.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from .errors import UserError


class ProfileError(UserError):
    """A routing profile that does not hold what it must; the message names the file and field."""


@dataclass(frozen=True)
class LayerProfile:
    counts: tuple[int, ...]  # tokens that selected each expert
    tokens: int
    sets: tuple[tuple[int, ...], ...]  # the experts selected for each recorded token


@dataclass(frozen=True)
class RoutingProfile:
    """`moe-cluster profile` output: per decoder layer, expert counts and recorded selections."""

    model: str
    num_experts: int
    top_k: int
    layers: Mapping[int, LayerProfile]


def parse_profile(obj, where: str = "profile") -> RoutingProfile:
    """Check a routing profile `{"model", "num_experts", "top_k", "layers": {"<layer>": {"counts",
    "tokens", "sets"}}}`; errors name the file and the field."""
    if not isinstance(obj, dict):
        raise ProfileError(f"{where}: expected a JSON object")
    for key in ("model", "num_experts", "top_k", "layers"):
        if key not in obj:
            raise ProfileError(f"{where}: missing field {key!r}")
    E, k = obj["num_experts"], obj["top_k"]
    if not isinstance(E, int) or E < 2 or not isinstance(k, int) or not 1 <= k <= E:
        raise ProfileError(
            f"{where}: num_experts ({E!r}) and top_k ({k!r}) must be whole numbers, 1 <= top_k <= num_experts"
        )
    if not isinstance(obj["layers"], dict) or not obj["layers"]:
        raise ProfileError(
            f"{where}: 'layers' must be a non-empty object keyed by decoder layer index"
        )
    layers: dict[int, LayerProfile] = {}
    for key, layer in obj["layers"].items():
        lw = f"{where}: layers[{key!r}]"
        if not str(key).isdigit():
            raise ProfileError(f"{lw}: the key must be a decoder layer index")
        if not isinstance(layer, dict) or not all(f in layer for f in ("counts", "tokens", "sets")):
            raise ProfileError(f"{lw}: expected an object with counts, tokens and sets")
        counts, sets = layer["counts"], layer["sets"]
        if (
            not isinstance(counts, list)
            or len(counts) != E
            or not all(isinstance(c, int) and c >= 0 for c in counts)
        ):
            raise ProfileError(f"{lw}: counts must be {E} whole numbers >= 0")
        if not isinstance(sets, list) or not sets:
            raise ProfileError(
                f"{lw}: sets must be a non-empty list of selections (one list of expert ids per token)"
            )
        clean = []
        for s in sets:
            if (
                not isinstance(s, list)
                or not s
                or len(s) > k
                or len(set(s)) != len(s)
                or not all(isinstance(e, int) and 0 <= e < E for e in s)
            ):
                raise ProfileError(
                    f"{lw}: selection {s!r} must hold 1..{k} distinct expert ids in 0..{E - 1}"
                )
            clean.append(tuple(s))
        layers[int(key)] = LayerProfile(tuple(counts), int(layer["tokens"]), tuple(clean))
    return RoutingProfile(str(obj["model"]), E, k, layers)

"""The placement a node loads: for each MoE layer, which experts each rank holds."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from .errors import UserError


class PlacementError(UserError):
    """A placement that cannot run, with the reason."""


def even_counts(num_experts: int, world_size: int) -> list[int]:
    """How many experts each rank holds under the even split: the first `num_experts % world_size`
    ranks hold one more."""
    base, extra = divmod(num_experts, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


@dataclass(frozen=True)
class Placement:
    """`layers[layer][rank]` = sorted expert ids that rank holds in that (decoder) layer.

    An expert may be held by several ranks (replication); `node.routing.assign` then decides
    which of them computes it.
    """

    world_size: int
    layers: Mapping[int, Mapping[int, tuple[int, ...]]]

    @classmethod
    def even(cls, moe_layers: Mapping[int, int], world_size: int) -> "Placement":
        """Contiguous, even split of every layer's experts: {layer: num_experts} -> Placement."""
        if world_size < 1:
            raise PlacementError(f"world size must be at least 1 (got {world_size})")
        layers = {}
        for layer, n in moe_layers.items():
            start, per_rank = 0, {}
            for r, size in enumerate(even_counts(n, world_size)):
                per_rank[r] = tuple(range(start, start + size))
                start += size
            layers[layer] = per_rank
        return cls(world_size, layers)

    @classmethod
    def from_json(cls, data: dict | str | Path, world_size: int) -> "Placement":
        """Parse `{"layers": {"<layer>": {"<rank>": [expert ids]}}}` (a dict, JSON text or a file)."""
        where = "placement"
        if isinstance(data, Path) or (
            isinstance(data, str) and not data.lstrip().startswith(("{", "["))
        ):
            where = str(data)
            try:
                data = Path(data).read_text()
            except OSError as exc:
                raise PlacementError(f"cannot read placement file {where}: {exc.strerror}") from exc
        if isinstance(data, str):
            try:
                data = json.loads(data)
            except json.JSONDecodeError as exc:
                raise PlacementError(f"{where} is not valid JSON: {exc}") from exc
        if not isinstance(data, dict) or not isinstance(data.get("layers"), dict):
            raise PlacementError(
                f'{where} must be a JSON object {{"layers": {{"<layer>": {{"<rank>": [experts]}}}}}}'
            )
        layers = {}
        for lk, ranks in data["layers"].items():
            try:
                layer = int(lk)
            except ValueError:
                raise PlacementError(f"{where}: layer key {lk!r} is not an integer") from None
            if not isinstance(ranks, dict):
                raise PlacementError(f"{where}: layer {layer} must map ranks to expert lists")
            per_rank = {}
            for rk, experts in ranks.items():
                try:
                    rank = int(rk)
                except ValueError:
                    raise PlacementError(
                        f"{where}: layer {layer}: rank key {rk!r} is not an integer"
                    ) from None
                if not 0 <= rank < world_size:
                    raise PlacementError(
                        f"{where}: layer {layer}: rank {rank} is out of range 0..{world_size - 1}"
                    )
                if not isinstance(experts, list) or not all(isinstance(e, int) for e in experts):
                    raise PlacementError(
                        f"{where}: layer {layer}, rank {rank}: experts must be a list of integers"
                    )
                per_rank[rank] = tuple(sorted(experts))
            layers[layer] = {r: per_rank.get(r, ()) for r in range(world_size)}
        return cls(world_size, layers)

    def to_json(self) -> dict:
        return {
            "layers": {
                str(l): {str(r): list(es) for r, es in ranks.items()}
                for l, ranks in sorted(self.layers.items())
            }
        }

    def check(self, moe_layers: Mapping[int, int]) -> None:
        """Validate against the model's MoE layers {layer: num_experts}."""
        missing = sorted(set(moe_layers) - set(self.layers))
        if missing:
            raise PlacementError(f"placement has no entry for MoE layers {missing}")
        extra = sorted(set(self.layers) - set(moe_layers))
        if extra:
            raise PlacementError(
                f"placement names layers {extra}, which are not MoE layers of this model "
                f"(MoE layers: {sorted(moe_layers)})"
            )
        for layer, n in moe_layers.items():
            try:
                holders_of(self.layers[layer], n)
            except ValueError as exc:
                raise PlacementError(f"layer {layer}: {exc}") from exc

    def local(self, rank: int) -> dict[int, tuple[int, ...]]:
        return {layer: ranks.get(rank, ()) for layer, ranks in self.layers.items()}

    def holders(self, layer: int, num_experts: int) -> dict[int, tuple[int, ...]]:
        return holders_of(self.layers[layer], num_experts)

    def experts_per_layer(self, rank: int) -> dict[int, int]:
        return {layer: len(ranks.get(rank, ())) for layer, ranks in self.layers.items()}


def holders_of(
    layer_placement: Mapping[int, Sequence[int]], num_experts: int
) -> dict[int, tuple[int, ...]]:
    """Invert {rank: [experts]} into {expert: (ranks...)}; every expert must have a holder."""
    out: dict[int, list[int]] = {e: [] for e in range(num_experts)}
    for rank in sorted(layer_placement):
        for e in layer_placement[rank]:
            if not 0 <= e < num_experts:
                raise PlacementError(
                    f"expert id {e} on rank {rank} is out of range 0..{num_experts - 1}"
                )
            if rank in out[e]:
                raise PlacementError(f"expert {e} is listed twice on rank {rank}")
            out[e].append(rank)
    missing = [e for e, rs in out.items() if not rs]
    if missing:
        raise PlacementError(f"experts {missing} are on no node")
    return {e: tuple(rs) for e, rs in out.items()}


def copy_everywhere(
    held: Mapping[int, Sequence[int]], free: Sequence[int], order: Sequence[int]
) -> dict[int, list[int]]:
    """Replicas as full copies: each expert of `order` (hottest first) goes to every rank that
    lacks it, wherever each of those ranks still has one of its `free[rank]` slots (one that does
    not fit everywhere is skipped for the next). A replica held by every rank is assigned on the
    device (node/moe/routing.py ArrayRule); one held by some ranks is assigned on the host at every
    MoE layer, a host sync per layer that cut decode to a third on 2 GPUs. -> sorted ids per rank."""
    out = {r: list(es) for r, es in held.items()}
    have = {r: set(es) for r, es in held.items()}
    room = {r: free[r] for r in out}
    for e in order:
        if not any(room.values()):
            break
        lacking = [r for r in out if e not in have[r]]
        if lacking and all(room[r] > 0 for r in lacking):
            for r in lacking:
                out[r].append(e)
                have[r].add(e)
                room[r] -= 1
    return {r: sorted(es) for r, es in out.items()}

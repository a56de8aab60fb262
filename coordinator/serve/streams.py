"""Which node attends for each stream (cluster.yaml's `serving.attention`).

With attention by stream each running stream has one owner, the only node that runs its attention
and holds its KV cache and prompt cache entry; every node still computes its experts for it. The
coordinator picks the owner when it sends a request to the nodes:

- a follow-up (a new prompt that starts with an earlier stream's tokens: the next turn of a chat)
  goes to the node that owned that stream, whose prompt cache holds the longest prefix of it;
- any other stream goes to the node with the most KV room (the fewest tokens reserved by the
  streams it attends for), ties to the one with the fewest streams, then the lowest rank.

`replicated` gives every stream to every node (-1); `auto` does so for a stream that finds nothing
else running, so one user alone pays no more than replicated attention (one all-reduce per MoE layer
instead of a gather and a scatter), and owns the rest as `by-stream` does.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

REPLICATED = -1  # a stream every node attends for
MIN_PREFIX = 16  # tokens a follow-up must share with an earlier stream to go to its node
REMEMBERED = 256  # ended streams whose owner is remembered for follow-ups


@dataclass(frozen=True)
class NodeStreams:
    """What one node attends for, as the coordinator counts it."""

    streams: int  # running streams it owns (replicated ones count on every node)
    tokens: int  # their prompts and max_tokens: the KV positions reserved for them


class Owners:
    """The owner of every running stream, and the owners of recently ended ones (for follow-ups)."""

    def __init__(self, mode: str, world: int):
        self.mode = mode
        self.world = world
        self._running: dict[str, tuple[int, int]] = {}  # request id -> (owner, tokens reserved)
        self._ended: OrderedDict[tuple[int, ...], int] = OrderedDict()  # tokens -> owner

    def choose(self, request_id: str, prompt: Sequence[int], max_tokens: int) -> int:
        """The owner of a new stream (REPLICATED: every node), which is now running."""
        owner = self._pick(prompt)
        self._running[request_id] = (owner, len(prompt) + max_tokens)
        return owner

    def _pick(self, prompt: Sequence[int]) -> int:
        if self.world < 2 or self.mode == "replicated":
            return REPLICATED
        if self.mode == "auto" and not self._running:
            return REPLICATED
        followed = self._follow_up(prompt)
        if followed is not None:
            return followed
        load = self.load()
        return min(range(self.world), key=lambda r: (load[r].tokens, load[r].streams, r))

    def _follow_up(self, prompt: Sequence[int]) -> int | None:
        """The owner of the ended stream sharing the longest prefix (at least MIN_PREFIX) with
        `prompt`, or None."""
        best, owner = MIN_PREFIX - 1, None
        for tokens, o in self._ended.items():
            n = _common_prefix(tokens, prompt)
            if n > best and o != REPLICATED:
                best, owner = n, o
        return owner

    def ended(self, request_id: str, tokens: Sequence[int]) -> None:
        """A stream ended; `tokens`: its prompt and what it generated (its owner's prompt cache
        holds them now). It stops counting against its owner's room."""
        owner, _ = self._running.pop(request_id, (REPLICATED, 0))
        if owner == REPLICATED or not tokens:
            return
        key = tuple(tokens)
        self._ended.pop(key, None)
        self._ended[key] = owner
        while len(self._ended) > REMEMBERED:
            self._ended.popitem(last=False)

    def load(self) -> list[NodeStreams]:
        """Per rank: the running streams it attends for and the KV tokens reserved for them."""
        streams, tokens = [0] * self.world, [0] * self.world
        for owner, n in self._running.values():
            for r in range(self.world) if owner == REPLICATED else (owner,):
                streams[r] += 1
                tokens[r] += n
        return [NodeStreams(s, t) for s, t in zip(streams, tokens)]

    def clear(self) -> None:
        """The nodes were loaded again: nothing runs, and no prompt cache holds anything."""
        self._running.clear()
        self._ended.clear()


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n

"""How a Generate call hears its sequence from the worker thread that runs it (node/agent.py): the
sink handing tokens, the result or the error to the call's event loop, and what GenerateDone and
GenerateError carry."""

from __future__ import annotations

import asyncio

from ..proto.errors import ErrorKind, kind_of
from ..proto.records import NodeError


class QueueSink:
    """A sequence's results, handed from the worker thread to its Generate call's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, events: asyncio.Queue):
        self._loop, self._events = loop, events

    def _put(self, kind: str, value) -> None:
        try:
            self._loop.call_soon_threadsafe(self._events.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed: nobody listens any more
            pass

    def tokens(self, ids: list[int]) -> None:
        self._put("tokens", ids)

    def done(self, result) -> None:
        self._put("done", result)

    def failed(self, exc: BaseException) -> None:
        self._put("failed", exc)


def node_error(exc: BaseException, rank: int) -> NodeError:
    """What the coordinator hears of a failure: the kind, and the text (a bug's text names its type)."""
    kind = kind_of(exc)
    message = str(exc) if kind is not ErrorKind.INTERNAL else f"{type(exc).__name__}: {exc}"
    return NodeError(kind, message, rank)


def done_figures(f, moe_layers: int) -> dict[str, float]:
    """A request's own decoding figures (node/batch.py SequenceFigures), for GenerateDone."""
    return {
        "decode_steps": float(f.steps),
        "drafted": float(f.drafted),
        "accepted": float(f.accepted),
        "moe_layers": float(moe_layers),
    }

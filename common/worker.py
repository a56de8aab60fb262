"""One owned thread for work that must stay off an asyncio event loop: the node agent's MLX work
(MLX is driven from one thread) and the coordinator API's CPU-bound work (JSON of big bodies,
tokenizing, chat templates), so each loop keeps answering while the work runs. It imports no mlx."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Any, Callable

logger = logging.getLogger(__name__)


class Worker:
    """Jobs run one at a time, in order, on one thread; results and errors come back as values."""

    def __init__(self, name: str = "worker"):
        self._jobs: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, deliver = job
            try:
                value, error = fn(), None
            except BaseException as exc:  # noqa: BLE001 - handed back to the caller, which re-raises it
                value, error = None, exc
            deliver(value, error)

    async def run(self, fn: Callable[[], Any]) -> tuple[Any, BaseException | None]:
        """(fn's result, None), or (None, the exception it raised): the caller decides what to raise."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def settle(value, error) -> None:
            if not fut.done():  # the caller may have gone (client disconnected)
                fut.set_result((value, error))

        def deliver(value, error) -> None:
            try:
                loop.call_soon_threadsafe(settle, value, error)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                pass

        self._jobs.put((fn, deliver))
        return await fut

    async def call(self, fn: Callable[[], Any]) -> Any:
        """fn's result, or its exception re-raised here, on the caller's side."""
        value, error = await self.run(fn)
        if error is not None:
            raise error
        return value

    def close(self, timeout: float = 5.0) -> None:
        self._jobs.put(None)
        self._thread.join(timeout)

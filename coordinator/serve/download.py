"""`up`'s download phase: a Hugging Face repo's weights fetched into this machine's cache (the
nodes receive their shards from here, as from any folder), with progress in `up`'s log and on the
dashboard at the API's address (`holding.py`'s page, which answers with the download's state until
the API itself comes up). Ctrl-C, SIGTERM or the page's shutdown stop it; a second `up` fetches
only what is missing.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from ...node.checkpoint import resolve_model_path
from ...node.hub import LogLines, Transfer
from .config import ClusterConfig
from .holding import HoldingPage


async def fetch_weights(c: ClusterConfig, page: HoldingPage, stop: asyncio.Event) -> Path:
    """The repo `c.model` in the cache: its snapshot folder, once every file is there."""
    page.say("downloading", "")
    lines = LogLines(note=f"; progress on {page.url}/")

    def report(t: Transfer) -> None:  # on the hub's worker threads
        page.transfer = t
        lines(t)

    cancel = threading.Event()

    async def on_stop() -> None:
        await stop.wait()
        cancel.set()

    watch = asyncio.create_task(on_stop())
    try:
        return await asyncio.to_thread(resolve_model_path, c.model, report=report, cancel=cancel)
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        page.say("loading", "the weights are here; loading the nodes")

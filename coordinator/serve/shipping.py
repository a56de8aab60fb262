"""The Ship service as `up` runs it with `checkpoint: coordinator`: started from cluster.yaml's
`ship` while the nodes may (re)load, stopped with `up`, and what it sent said (ship.py serves)."""

from __future__ import annotations

import asyncio
import logging
import sys

from ...node.describe import ModelDescription
from .cluster import Member
from .config import ClusterConfig, ConfigError, tls_files

logger = logging.getLogger(__name__)


def say_shipped(ship: ShipService, members: list[Member]) -> None:
    """What the Ship service sent each node, and what it hashed of the checkpoint."""
    sent = ship.shipper.bytes_sent()
    print(
        "shipped: "
        + ", ".join(f"{m.name} {sent.get(m.name, 0)} bytes" for m in members)
        + f" (total {sum(sent.values())} bytes)",
        file=sys.stderr,
        flush=True,
    )
    d = ship.shipper.digests
    print(
        f"digests: hashed {d.hashed_bytes} bytes of the checkpoint this run; {d.known()} blobs known"
        + (f" (kept in {d.path})" if d.path else " (kept in memory only)"),
        file=sys.stderr,
        flush=True,
    )


class ShipService:
    """The Ship service `up` runs while nodes may (re)load: what they are told, and its server."""

    def __init__(self, shipper, server, source):
        self.shipper, self.server, self.source = shipper, server, source

    async def close(self) -> None:
        await asyncio.to_thread(lambda: self.server.stop(1.0).wait())


async def start_ship(c: ClusterConfig, desc: ModelDescription, secret: str) -> ShipService:
    """With `checkpoint: coordinator`: serve the nodes their shards from this machine's checkpoint."""
    from ...common.ports import check_port_free
    from ...proto.records import ShipSource
    from .digests import default_digest_dir
    from .ship import Shipper, start_server

    if c.ship.port:
        try:
            check_port_free(c.ship.host, c.ship.port, "ship.port picks another")
        except OSError as exc:
            raise ConfigError(f"{c.source}: ship: {exc}") from None
    # on a terminal the per-node bars carry bytes, rate and ETA; lines from the Ship service would
    # break them, so they go to the log there
    report = (lambda line: logger.info("%s", line)) if sys.stderr.isatty() else None
    shipper = Shipper(
        desc,
        chunk_bytes=c.ship.chunk,
        max_rate=c.ship.max_rate,
        report=report,
        digest_dir=default_digest_dir(),
    )
    server, port = start_server(shipper, c.ship.host, c.ship.port, secret, tls_files(c))
    print(
        f"shipping shards of {desc.checkpoint.path} (model {shipper.fingerprint[:16]}) on port {port}",
        file=sys.stderr,
        flush=True,
    )
    return ShipService(shipper, server, ShipSource(shipper.fingerprint, f":{port}"))

"""mDNS (zeroconf): nodes advertise `_moe-cluster._tcp.local.`; the coordinator browses for them.

The TXT record carries what the coordinator needs before it talks to a node: name, version,
memory bytes, backend, device, agent port and cluster name. Never the secret.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass
from typing import Sequence

from ..proto.errors import NotFoundError

logger = logging.getLogger(__name__)

SERVICE_TYPE = "_moe-cluster._tcp.local."


class DiscoveryError(NotFoundError):
    """Nodes that could not be found, or an interface that does not exist."""


@dataclass(frozen=True)
class Advert:
    """What a node says about itself on the network."""

    name: str
    address: str  # IPv4 the agent listens on
    port: int  # agent (gRPC) port
    version: str
    memory_bytes: int
    backend: str  # "metal", "cuda", "cpu"
    device: str
    cluster: str

    def properties(self) -> dict[str, str]:
        return {
            "name": self.name,
            "version": self.version,
            "memory": str(self.memory_bytes),
            "backend": self.backend,
            "device": self.device,
            "port": str(self.port),
            "cluster": self.cluster,
        }

    @classmethod
    def from_properties(cls, props: dict, address: str, port: int) -> "Advert":
        p = {
            (k.decode() if isinstance(k, bytes) else k): (
                v.decode() if isinstance(v, bytes) else v or ""
            )
            for k, v in props.items()
        }
        return cls(
            p.get("name", ""),
            address,
            int(p.get("port") or port),
            p.get("version", ""),
            int(p.get("memory") or 0),
            p.get("backend", ""),
            p.get("device", ""),
            p.get("cluster", ""),
        )


def interface_addresses(interfaces: Sequence[str]) -> list[str]:
    """Interface names or IPv4 addresses -> IPv4 addresses (zeroconf binds to addresses)."""
    import ifaddr

    adapters = {a.nice_name: a for a in ifaddr.get_adapters()}
    out = []
    for item in interfaces:
        if item in adapters:
            ips = [ip.ip for ip in adapters[item].ips if isinstance(ip.ip, str)]
            if not ips:
                raise DiscoveryError(f"interface {item} has no IPv4 address")
            out.extend(ips)
            continue
        try:
            socket.inet_aton(item)
        except OSError:
            raise DiscoveryError(
                f"no interface or IPv4 address {item!r} (interfaces: {', '.join(adapters)})"
            ) from None
        out.append(item)
    return out


def _zeroconf(interfaces: Sequence[str] | None):
    from zeroconf import InterfaceChoice, IPVersion
    from zeroconf.asyncio import AsyncZeroconf

    if interfaces:
        return AsyncZeroconf(
            interfaces=interface_addresses(interfaces), ip_version=IPVersion.V4Only
        )
    return AsyncZeroconf(interfaces=InterfaceChoice.All, ip_version=IPVersion.V4Only)


class Advertiser:
    """Registers one node's service for as long as it runs."""

    def __init__(self, advert: Advert, interfaces: Sequence[str] | None = None):
        self.advert = advert
        self.interfaces = interfaces
        self._zc = None
        self._info = None

    async def start(self) -> None:
        from zeroconf.asyncio import AsyncServiceInfo

        self._zc = _zeroconf(self.interfaces)
        a = self.advert
        self._info = AsyncServiceInfo(
            SERVICE_TYPE,
            f"{a.name}.{SERVICE_TYPE}",
            addresses=[socket.inet_aton(a.address)],
            port=a.port,
            properties=a.properties(),
            server=f"{a.name}.local.",
        )
        await self._zc.async_register_service(self._info, allow_name_change=False)
        logger.info("advertising %s on %s:%d via mDNS", a.name, a.address, a.port)

    async def close(self) -> None:
        if self._zc is not None:
            try:
                if self._info is not None:
                    await self._zc.async_unregister_service(self._info)
            finally:
                await self._zc.async_close()
                self._zc = None


async def browse(
    cluster: str, wanted: Sequence[str], timeout_s: float, interfaces: Sequence[str] | None = None
) -> dict[str, Advert]:
    """Find the named nodes of a cluster within `timeout_s`; returns all adverts seen by then.

    Returns early once every wanted node has been seen.
    """
    from zeroconf import ServiceStateChange
    from zeroconf.asyncio import AsyncServiceBrowser, AsyncServiceInfo

    zc = _zeroconf(interfaces)
    seen: dict[str, Advert] = {}
    pending: set[asyncio.Task] = set()
    done = asyncio.Event()

    async def resolve(name: str) -> None:
        info = AsyncServiceInfo(SERVICE_TYPE, name)
        if not await info.async_request(zc.zeroconf, 3000):
            return
        addrs = info.parsed_addresses()
        if not addrs:
            return
        advert = Advert.from_properties(info.properties or {}, addrs[0], info.port or 0)
        if advert.cluster and cluster and advert.cluster != cluster:
            logger.debug("ignoring %s: cluster %r, not %r", advert.name, advert.cluster, cluster)
            return
        seen[advert.name] = advert
        if all(w in seen for w in wanted):
            done.set()

    def on_change(zeroconf, service_type, name, state_change):
        if state_change in (ServiceStateChange.Added, ServiceStateChange.Updated):
            task = asyncio.get_running_loop().create_task(resolve(name))
            pending.add(task)
            task.add_done_callback(pending.discard)

    browser = AsyncServiceBrowser(zc.zeroconf, [SERVICE_TYPE], handlers=[on_change])
    try:
        try:
            await asyncio.wait_for(done.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
    finally:
        await browser.async_cancel()
        for t in list(pending):
            t.cancel()
        await zc.async_close()
    return seen

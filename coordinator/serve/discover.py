"""Where cluster.yaml's nodes are: the static addresses it gives, the others found by mDNS."""

from __future__ import annotations

from .config import ClusterConfig

DEFAULT_AGENT_PORT = 7700  # `moe-cluster node` listens here unless told otherwise
DEFAULT_ENVOY_PORT = 7701


async def remote_members(c: ClusterConfig) -> list[tuple[str, str, str]]:
    """(name, agent address, node host) of every configured node: static or found by mDNS."""
    out, wanted = [], [n.name for n in c.nodes if not n.address]
    seen = {}
    if wanted:
        from ...common.mdns import DiscoveryError, browse

        seen = await browse(c.name, wanted, c.timeouts.discovery, c.discovery.interfaces or None)
        missing = [w for w in wanted if w not in seen]
        if missing:
            raise DiscoveryError(
                f"nodes not found by mDNS within {c.timeouts.discovery:.0f} s: {', '.join(missing)}; "
                f"seen: {', '.join(sorted(seen)) or 'none'} (cluster {c.name!r})"
            )
    for n in c.nodes:
        if n.address:
            host, _, port = n.address.rpartition(":") if ":" in n.address else (n.address, "", "")
            host = host or n.address
            port = int(port) if port else (n.port or DEFAULT_AGENT_PORT)
            out.append((n.name, f"{host}:{port}", host))
        else:
            a = seen[n.name]
            out.append((n.name, f"{a.address}:{a.port}", a.address))
    return out

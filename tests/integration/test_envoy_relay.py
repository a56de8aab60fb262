"""A TLS data channel relayed to the nodes (envoy/data.py `relay`): the envoys carry the bytes
both ways unparsed, past every buffer on the way, with what followed the handshake first."""

from __future__ import annotations

import os
import threading

import pytest

from tls_certs import make_tls

uvloop = pytest.importorskip("uvloop")


def test_a_relayed_tls_channel_carries_every_byte_both_ways_at_once_then_its_end(tmp_path):
    pytest.importorskip("cryptography", reason="the test extra makes its certificate with it")
    import asyncio

    from moe_cluster.common.auth import ssl_client_context, ssl_server_context
    from moe_cluster.envoy.data import DataConnection, token_ok
    from moe_cluster.proto.frame import handshake

    tls = make_tls(tmp_path)
    size = 8 << 20  # bytes each way: far past the socket pairs' and the TLS transports' buffers
    sent = {0: os.urandom(size), 1: os.urandom(size)}  # by the dialer's node, the listener's
    early = b"sent before the relay was there"

    def pump(node_end, mine: int, want: int, got: dict) -> None:
        """One node: write its bytes and read `want` of the other's at once (a thread each way)."""
        node_end.settimeout(20)  # a relay that loses or holds bytes fails the test, not hangs it
        writer = threading.Thread(target=node_end.sendall, args=(sent[mine],), daemon=True)
        writer.start()
        buf = bytearray()
        while len(buf) < want:
            try:
                chunk = node_end.recv(1 << 20)
            except TimeoutError:
                break
            if not chunk:
                break
            buf += chunk
        writer.join(60)
        got[mine] = bytes(buf)

    async def run() -> tuple[dict, bytes]:
        loop = asyncio.get_running_loop()
        claimed: list[DataConnection] = []

        def claim(rank, token, conn):
            claimed.append(conn)
            return "" if token_ok(token, "t" * 32) else "wrong"

        server = await loop.create_server(
            lambda: DataConnection(claim=claim),
            "127.0.0.1",
            0,
            ssl=ssl_server_context(tls.cert, tls.key, tls.ca),
        )
        port = server.sockets[0].getsockname()[1]
        # a frame may follow the handshake at once, in the same read: held for the node
        _, dialer = await loop.create_connection(
            lambda: DataConnection(hello=handshake(0, "t" * 32) + early),
            "127.0.0.1",
            port,
            ssl=ssl_client_context(tls.ca, tls.cert, tls.key),
            server_hostname="127.0.0.1",
        )
        await asyncio.wait_for(dialer.ready, 10)
        assert not dialer.plain
        while not claimed or not claimed[0].ready.done():
            await asyncio.sleep(0.01)
        listener = claimed[0]
        a, b = await dialer.relay(), await listener.relay()
        got: dict = {}
        threads = [
            threading.Thread(target=pump, args=(a, 0, size, got), daemon=True),
            threading.Thread(target=pump, args=(b, 1, len(early) + size, got), daemon=True),
        ]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            await asyncio.sleep(0.05)
        a.close()  # the dialer's node drops its channel: the listener's node reads the end
        b.settimeout(10)
        end = await loop.run_in_executor(None, b.recv, 1)
        b.close()
        dialer.close()
        server.close()
        return got, end

    got, end = uvloop.run(run())
    assert got[1] == early + sent[0] and got[0] == sent[1]
    assert end == b""

"""`moe-cluster bench ship`: shipping throughput against raw TCP between the same two endpoints.

This process plays the coordinator (the Ship service and a plain TCP sender, both reading the same
file by byte range); a receiver process — in a network namespace with `--netns` or `--link` — takes
the bytes over one plain socket and throws them away (raw TCP), then fetches every blob into a fresh
cache (each piece checked against the coordinator's digests, written to disk, the manifest written)
`1 + --rounds` times, taking the raw bytes again after each later fetch.

The first fetch is the first ship of this checkpoint: the coordinator hashes each blob (sha256 and
the piece digests, coordinator/serve/digests.py) a couple of blobs ahead of sending it
(`first_ship_*`). The later ones are every later ship — another node, a changed placement, a lost
cache, the next `up` — with the digests kept: `seconds` is their median, `raw_tcp_bytes_per_s` the
raw runs' median, `ratio` = ship / raw, and `rounds` lists every run of both. The median, because on
a VM each fetch's time depends on whether the guest's free memory is still backed by the host (this
development VM reports freed pages to its host: one fetch of 512 MB into /dev/shm took 0.25 to
0.78 s while raw TCP held 2.2-2.7 GB/s).
The coordinator's memory while shipping is measured too: Python's traced peak (tracemalloc) and the
growth of its resident set (ru_maxrss), next to the largest blob.

`--link RATE` (e.g. 10gbit) measures over a link of that rate instead of loopback: the bench makes a
network namespace of its own for the receiver, joined by a veth whose sending side a token bucket
(`tc qdisc ... tbf`) holds to RATE, and removes both afterwards (root; no traffic leaves them).
`--link veth` makes the same namespace and veth with no limit: another host, as fast as the kernel
moves packets between namespaces.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from contextlib import contextmanager
from pathlib import Path

SECRET = "bench-ship-secret"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default="512MB", help="bytes to ship (e.g. 256MB, 2GB)")
    p.add_argument(
        "--blob", default="32MB", help="bytes per blob (one expert tensor's slice; DBRX's is 132MB)"
    )
    p.add_argument("--chunk", default="1MiB", help="bytes per streamed chunk")
    p.add_argument(
        "--host", default="127.0.0.1", help="address the receiver reaches this process at"
    )
    p.add_argument(
        "--netns", default=None, help="run the receiver in this network namespace (`ip netns exec`)"
    )
    p.add_argument(
        "--link",
        default=None,
        help="ship over a link of this rate (e.g. 10gbit, 5gbit), or over an unlimited veth (`veth`), "
        "between this process and a namespace the bench makes and removes (root), instead of loopback",
    )
    p.add_argument(
        "--dir",
        default=None,
        help="where the source file and the receiver's cache go (default: a temp dir)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="later ships (and raw TCP runs after them) to take the median of",
    )
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--receive", default=None, help=argparse.SUPPRESS
    )  # the receiver's own entry point


def _size(text: str) -> int:
    from ...proto.expert_cache import SIZE_UNITS
    from ..serve.config_reader import parse_units

    return int(parse_units(text, SIZE_UNITS, "size"))


def _write_source(root: Path, size: int, blob: int) -> tuple[Path, object]:
    """A checkpoint-like folder: one safetensors file of `size // blob` uint8 tensors, and its catalog
    (the catalog a real model would have, minus the MoE structure a byte count does not need)."""
    import struct

    from ...node.catalog import Catalog

    n = max(1, size // blob)
    names = [f"t{i:05d}" for i in range(n)]
    header = {
        k: {"dtype": "U8", "shape": [blob], "data_offsets": [i * blob, (i + 1) * blob]}
        for i, k in enumerate(names)
    }
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    src = root / "src"
    src.mkdir(parents=True, exist_ok=True)
    (src / "config.json").write_text(json.dumps({"model_type": "bench"}))
    with open(src / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        block = os.urandom(1 << 20)
        for _ in range(n * blob // len(block)):
            f.write(block)
        f.write(block[: n * blob % len(block)])
    from ...node.checkpoint import Checkpoint
    from ...node.catalog import fingerprint

    ckpt = Checkpoint(src)
    catalog = Catalog(
        fingerprint(ckpt),
        (src / "config.json").read_text(),
        tuple((k, "U8", (blob,)) for k in names),
        {},
    )
    return src, (ckpt, catalog)


_RATE = re.compile(r"^\d+(\.\d+)?[kmg]?bit$")


@contextmanager
def _shaped_link(rate: str):
    """A namespace for the receiver, joined to this one by a veth held to `rate` in the shipping
    direction; yields (namespace, the address the receiver reaches this process at)."""
    from ...proto.errors import UserError

    if rate.lower() != "veth" and not _RATE.match(rate.lower()):
        raise UserError(
            f"--link must be a rate like 10gbit, 2.5gbit or 800mbit, or veth (got {rate!r})"
        )
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        raise UserError(
            "--link makes a network namespace and shapes a veth: it needs root, iproute2's `ip` and `tc`"
        )
    tag = f"mcs{os.getpid() % 100000}"
    ns, subnet = f"{tag}ns", f"10.214.{os.getpid() % 250}"

    def run(*cmd: str) -> None:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise UserError(f"--link: `{' '.join(cmd)}` failed: {r.stderr.strip()}")

    try:
        run("ip", "netns", "add", ns)
        run("ip", "link", "add", f"{tag}a", "type", "veth", "peer", "name", f"{tag}b", "netns", ns)
        run("ip", "addr", "add", f"{subnet}.1/24", "dev", f"{tag}a")
        run("ip", "link", "set", f"{tag}a", "up")
        run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{subnet}.2/24", "dev", f"{tag}b")
        run("ip", "netns", "exec", ns, "ip", "link", "set", f"{tag}b", "up")
        if rate.lower() != "veth":
            run(
                "tc",
                "qdisc",
                "add",
                "dev",
                f"{tag}a",
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "4mb",
                "latency",
                "100ms",
            )
        yield ns, f"{subnet}.1"
    finally:
        subprocess.run(
            ["ip", "link", "del", f"{tag}a"], capture_output=True
        )  # its peer goes with it
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def main(args) -> int:
    if args.receive:
        return _receive(json.loads(args.receive))
    if args.link:
        if args.netns:
            from ...proto.errors import UserError

            raise UserError("--link makes its own namespace: give --link or --netns, not both")
        with _shaped_link(args.link) as (ns, host):
            return _main(argparse.Namespace(**{**vars(args), "netns": ns, "host": host}))
    return _main(args)


def _main(args) -> int:
    size, blob, chunk = _size(args.size), _size(args.blob), _size(args.chunk)
    if args.rounds < 1:
        from ...proto.errors import UserError

        raise UserError(f"--rounds must be at least 1 (got {args.rounds})")
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-ship-") as tmp:
        root = Path(tmp)
        src, (ckpt, catalog) = _write_source(root, size, blob)
        from ..serve.ship import Shipper, start_server

        quiet = lambda line: None  # noqa: E731 - the bench prints one result
        shipper = Shipper(ckpt, chunk_bytes=chunk, report=quiet, catalog=catalog)
        server, port = start_server(shipper, "0.0.0.0", 0, SECRET)
        raw = socket.create_server(("0.0.0.0", 0))
        raw_port = raw.getsockname()[1]
        ranges = sorted(shipper.ranges.values(), key=lambda r: r[1])
        raw_thread = threading.Thread(
            target=_raw_send,
            args=(raw, ranges, chunk, args.rounds + 1),
            name="raw-sender",
            daemon=True,
        )
        raw_thread.start()
        total = sum(r[2] for r in ranges)
        job = {
            "ship": f"{args.host}:{port}",
            "raw": f"{args.host}:{raw_port}",
            "fingerprint": shipper.fingerprint,
            "caches": [str(root / f"cache-{i}") for i in range(args.rounds + 1)],
            "total": total,
        }
        cmd = [
            sys.executable,
            "-m",
            "moe_cluster.coordinator.cli",
            "bench",
            "ship",
            "--receive",
            json.dumps(job),
        ]
        if args.netns:
            cmd = ["ip", "netns", "exec", args.netns, *cmd]
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        tracemalloc.start()
        try:
            r = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=600,
                env=dict(os.environ, MOE_CLUSTER_SECRET=SECRET),
            )
        finally:
            traced_peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            server.stop(0.5).wait()
            raw.close()
        rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        if r.returncode != 0:
            print(
                f"bench ship: the receiver failed: {(r.stderr or r.stdout).strip().splitlines()[-1:]}",
                file=sys.stderr,
            )
            return 1
        got = json.loads(r.stdout.strip().splitlines()[-1])
    first, *later_runs = got["seconds"]
    later = statistics.median(later_runs)
    raw_rate = got["raw_bytes"] / statistics.median(got["raw_seconds"])
    out = {
        "bytes": got["bytes"],
        "seconds": later,
        "rate_bytes_per_s": got["bytes"] / later,
        "raw_tcp_bytes_per_s": raw_rate,
        "ratio": got["bytes"] / later / raw_rate,
        "rounds": {"ship_seconds": later_runs, "raw_tcp_seconds": got["raw_seconds"]},
        "first_ship_seconds": first,
        "first_ship_rate_bytes_per_s": got["bytes"] / first,
        "first_ship_ratio": got["bytes"] / first / raw_rate,
        "coordinator_hashed_bytes": shipper.digests.hashed_bytes,
        "chunk_bytes": chunk,
        "blob_bytes": blob,
        "coordinator_traced_peak_bytes": traced_peak,
        "coordinator_rss_growth_bytes": max(0, rss1 - rss0),
        "netns": args.netns or "",
        "link": args.link or "",
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(
            f"shipped {out['bytes'] / 1e6:.0f} MB in {out['seconds']:.2f}s: {out['rate_bytes_per_s'] / 1e6:.0f} MB/s; "
            f"raw TCP {out['raw_tcp_bytes_per_s'] / 1e6:.0f} MB/s; ratio {out['ratio']:.2f} (the first ship, hashing "
            f"the checkpoint as it went: {out['first_ship_rate_bytes_per_s'] / 1e6:.0f} MB/s, ratio "
            f"{out['first_ship_ratio']:.2f}); coordinator peak "
            f"{traced_peak / 1e6:.1f} MB traced, RSS +{out['coordinator_rss_growth_bytes'] / 1e6:.1f} MB "
            f"(blob {blob / 1e6:.0f} MB, chunk {chunk / 1e6:.1f} MB)"
        )
    return 0


def _raw_send(server: socket.socket, ranges, chunk: int, runs: int) -> None:
    """The same bytes, the same chunks, over one plain socket, `runs` times (before the ships, and
    after each later one)."""
    for _ in range(runs):
        try:
            conn, _ = server.accept()
        except OSError:
            return
        with conn:
            _send_all(conn, ranges, chunk)


def _send_all(conn: socket.socket, ranges, chunk: int) -> None:
    for path, start, n in ranges:
        fd = os.open(path, os.O_RDONLY)
        try:
            off = 0
            while off < n:
                k = min(chunk, n - off)
                conn.sendall(os.pread(fd, k, start + off))
                off += k
        finally:
            os.close(fd)


def _receive(job: dict) -> int:
    """The receiver: raw TCP, then a ship into each fresh cache in turn, raw TCP again after each
    but the first (the machine's load drifts: the two alternate); prints one JSON line of timings."""
    import grpc

    from ...common.auth import call_metadata
    from ...node.cache import ShardCache
    from ...node.catalog import Catalog
    from ...node.ship import fetcher
    from ...proto import CHANNEL_OPTIONS, convert
    from ...proto import ship_pb2_grpc as spb_grpc

    md = call_metadata(os.environ["MOE_CLUSTER_SECRET"])
    raw = [_raw_receive(job)]
    seconds = []
    with grpc.insecure_channel(job["ship"], options=CHANNEL_OPTIONS) as channel:
        stub = spb_grpc.ShipStub(channel)
        reply = stub.Catalog(
            convert.catalog_request_to_proto(job["fingerprint"]), metadata=md, timeout=30
        )
        catalog = Catalog.from_json(json.loads(convert.catalog_reply_from_proto(reply)), "bench")
        for folder in job["caches"]:
            t0 = time.perf_counter()
            cache = ShardCache(Path(folder), catalog, {})
            plan = cache.scan()
            cache.fill(
                plan,
                fetcher(
                    stub,
                    md,
                    reply,
                    job["fingerprint"],
                    "bench",
                    job["ship"],
                    None,
                    catalog.blob_nbytes(),
                ),
            )
            seconds.append(time.perf_counter() - t0)
            shutil.rmtree(folder)  # the next fill's pages come from the memory this one used
            if len(seconds) > 1:
                raw.append(_raw_receive(job))
    print(
        json.dumps(
            {
                "bytes": plan.fetch_bytes,
                "seconds": seconds,
                "raw_bytes": job["total"],
                "raw_seconds": raw,
            }
        )
    )
    return 0


def _raw_receive(job: dict) -> float:
    """Seconds to take job["total"] bytes from the raw sender."""
    host, port = job["raw"].rsplit(":", 1)
    view = memoryview(bytearray(1 << 20))
    t = time.perf_counter()
    got = 0
    with socket.create_connection((host, int(port))) as s:
        while got < job["total"]:
            n = s.recv_into(view)
            if not n:
                raise ConnectionError(f"the raw sender stopped after {got} of {job['total']} bytes")
            got += n
    return time.perf_counter() - t

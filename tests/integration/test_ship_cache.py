"""A node's shard cache against a real Ship service on loopback: corrupt chunks, wrong secrets, a dead
coordinator, a full disk and bad manifests each end in one line (or a repair), never a traceback.
Chunk-level faults are injected into the gRPC stream (`data_channel=False`); the plain-TCP data
channel, which the other tests take, has tests of its own at the end."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from moe_cluster.coordinator.serve.ship import Shipper, blob_header, start_server
from moe_cluster.node import cache as cache_mod
from moe_cluster.node import catalog as catalog_mod
from moe_cluster.node.cache import _inside
from moe_cluster.node.cache_command import list_shards, remove_shard
from moe_cluster.node.catalog import CacheError
from moe_cluster.node.checkpoint import Checkpoint, CheckpointError, read_tensor
from moe_cluster.node.ship import fill_cache
from moe_cluster.proto.errors import UnavailableError
from moe_cluster.proto.records import ShipSource

SECRET = "cache-test-secret"


class Corrupting(Shipper):
    """Flips one byte of the first chunk of the `nth` blob it sends, once (its crc32 stays the true one)."""

    nth = 3

    def Fetch(self, request, context):
        i = 0
        for chunk in super().Fetch(request, context):
            if chunk.offset == 0:
                i += 1
            if i == self.nth and chunk.offset == 0 and not getattr(self, "done", False):
                self.done = True
                data = bytearray(chunk.data)
                data[7] ^= 0x01
                chunk.data = bytes(data)
            yield chunk


@pytest.fixture(scope="module")
def server():
    ckpt = Checkpoint.open("demo")
    shipper = Corrupting(
        ckpt, report=lambda line: None, data_channel=False
    )  # its chunks go over gRPC
    srv, port = start_server(shipper, "127.0.0.1", 0, SECRET)
    yield ckpt, shipper, f"127.0.0.1:{port}"
    srv.stop(0.5).wait()


def fill(address: str, fp: str, cache_dir: Path, secret: str = SECRET, rank: int = 0):
    return fill_cache(
        ShipSource(fp, address),
        address,
        cache_dir=cache_dir,
        secret=secret,
        tls=None,
        node=f"t{rank}",
        placement=None,
        rank=rank,
        world_size=2,
        progress=lambda *a: None,
    )


def test_a_corrupt_chunk_is_fetched_again_and_the_shard_reads_as_the_checkpoint(
    server, tmp_path, caplog
):
    ckpt, shipper, address = server
    view = fill(address, shipper.fingerprint, tmp_path)
    assert "arrived corrupt (crc32)" in caplog.text
    key = "model.layers.2.mlp.switch_mlp.up_proj.weight"
    local = list(view.tensors[key].held)
    assert local == list(range(8))  # rank 0 of 2, an even split
    assert np.array_equal(
        np.array(read_tensor(view.tensors[key], [1, 5])),
        np.array(read_tensor(ckpt.tensors[key], [1, 5])),
    )
    assert np.array_equal(
        np.array(read_tensor(view.tensors["model.norm.weight"])),
        np.array(read_tensor(ckpt.tensors["model.norm.weight"])),
    )
    with pytest.raises(
        CheckpointError, match=r"expert 9 is not in this cached shard \(it holds \[0, 1, 2"
    ):
        read_tensor(view.tensors[key], [9])
    # a second fill finds everything verified and asks for nothing
    before = dict(shipper.bytes_sent())
    fill(address, shipper.fingerprint, tmp_path)
    assert shipper.bytes_sent() == before


def _flip(path: Path, at: int) -> None:
    """Flip one bit of the byte `at` bytes past a safetensors file's header, in place."""
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        f.seek(8 + n + at)
        b = f.read(1)
        f.seek(8 + n + at)
        f.write(bytes([b[0] ^ 0x10]))


def test_a_warm_fill_hashes_nothing_until_a_file_changes(server, tmp_path, monkeypatch):
    """A shard just filled, or once verified, is trusted while its files stay as they were (size,
    mtime, ctime, inode): a warm start reads none of its bytes. A byte flipped in place, even with the
    mtime put back, moves the file's ctime: that file is hashed again and its bad blob fetched."""
    import os

    ckpt, shipper, address = server
    fill(address, shipper.fingerprint, tmp_path)
    hashed = []
    real_sha = cache_mod._sha
    monkeypatch.setattr(cache_mod, "_sha", lambda f, at, n: hashed.append(n) or real_sha(f, at, n))
    before = dict(shipper.bytes_sent())
    fill(address, shipper.fingerprint, tmp_path)
    assert hashed == [] and shipper.bytes_sent() == before  # nothing read, nothing sent
    (shard,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    target = next(shard.glob("layer-0002-*.safetensors"))  # MoE layer 2's experts
    st = target.stat()
    _flip(target, 100)
    os.utime(
        target, ns=(st.st_atime_ns, st.st_mtime_ns)
    )  # the mtime as it was: only the ctime tells
    view = fill(address, shipper.fingerprint, tmp_path)
    assert hashed, "the changed file was trusted without hashing"
    assert sum(shipper.bytes_sent().values()) > sum(before.values())  # its corrupt blob came again
    key = "model.layers.2.mlp.switch_mlp.up_proj.weight"
    assert np.array_equal(
        np.array(read_tensor(view.tensors[key], [0, 1])),
        np.array(read_tensor(ckpt.tensors[key], [0, 1])),
    )
    hashed.clear()
    fill(address, shipper.fingerprint, tmp_path)
    assert hashed == []  # repaired and stamped: trusted again


def test_cache_verify_finds_what_a_warm_start_trusts(server, tmp_path):
    """Corruption that leaves a file's metadata as it was (a failing disk; made here by re-stamping
    the file after the flip) passes a warm start's stat check. `moe-cluster cache verify` hashes
    everything, names it (exit 1), and drops the file's stamp: the next fill fetches the blob again."""
    import subprocess
    import sys

    ckpt, shipper, address = server
    fill(address, shipper.fingerprint, tmp_path)
    (shard,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    target = next(shard.glob("layer-0001-*.safetensors"))
    _flip(target, 10)
    cache_mod.write_stamps(
        shard, [target.name]
    )  # the stat check now passes: as if the disk had rotted

    def cli(*args):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "moe_cluster.coordinator.cli",
                "cache",
                *args,
                "--cache-dir",
                str(tmp_path),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )

    r = cli("verify")
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"{shard.name}: " in r.stdout and "do not (first model.layers.1." in r.stdout, r.stdout
    assert target.name not in cache_mod.read_stamps(shard)
    before = sum(shipper.bytes_sent().values())
    fill(address, shipper.fingerprint, tmp_path)
    assert sum(shipper.bytes_sent().values()) > before  # the bad blob came again
    r = cli("verify", shard.name)
    assert r.returncode == 0 and "do not" not in r.stdout, r.stdout + r.stderr
    r = cli("verify", "nonsense")
    assert (
        r.returncode != 0
        and "is not a cached shard name" in r.stderr
        and "Traceback" not in r.stderr
    )


def test_a_wrong_secret_gets_nothing(server, tmp_path):
    _, shipper, address = server
    with pytest.raises(UnavailableError) as exc:
        fill(address, shipper.fingerprint, tmp_path, secret="not-the-secret", rank=1)
    assert "UNAUTHENTICATED" in str(exc.value) and "\n" not in str(exc.value)
    assert not any(tmp_path.iterdir())


def test_a_dead_coordinator_is_one_line_quickly(server, tmp_path):
    import socket

    _, shipper, _ = server
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = f"127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: nobody answers there
    t = time.monotonic()
    try:
        with pytest.raises(
            UnavailableError, match="cannot get the model's catalog from the coordinator at"
        ) as exc:
            fill(dead, shipper.fingerprint, tmp_path)
    finally:
        s.close()
    assert "\n" not in str(exc.value) and dead in str(exc.value), str(
        exc.value
    )  # one line, naming the address
    assert time.monotonic() - t < 20


def test_a_full_disk_is_refused_before_anything_is_sent(server, tmp_path, monkeypatch):
    _, shipper, address = server
    monkeypatch.setattr(cache_mod.shutil, "disk_usage", lambda p: type("U", (), {"free": 1000})())
    sent = dict(shipper.bytes_sent())
    with pytest.raises(
        CacheError,
        match=r"not enough free disk in .*: the shard needs \d+ bytes .*, 1000 bytes .* are free",
    ):
        fill(address, shipper.fingerprint, tmp_path / "small", rank=1)
    assert shipper.bytes_sent() == sent


def test_bad_manifests_and_names(server, tmp_path, caplog):
    _, shipper, address = server
    fill(address, shipper.fingerprint, tmp_path, rank=1)
    (shard,) = [p for p in tmp_path.iterdir()]
    manifest = json.loads((shard / "manifest.json").read_text())
    manifest["catalog"]["layers"]["0"]["experts"] = "many"
    (shard / "manifest.json").write_text(json.dumps(manifest))
    (line,) = [s for s in list_shards(tmp_path)]
    assert (
        line.state.startswith("unusable: ")
        and "malformed catalog" in line.state
        and "\n" not in line.state
    )
    fill(address, shipper.fingerprint, tmp_path, rank=1)  # refetched, with a one-line warning
    assert "malformed catalog" in caplog.text
    assert list_shards(tmp_path)[0].state == "complete"
    for name in (
        "../evil.safetensors",
        "/etc/passwd",
        "layer-0001-../../x.safetensors",
        "manifest.json",
    ):
        with pytest.raises(CacheError, match="refusing"):
            _inside(shard, name)
    with pytest.raises(CacheError, match="is not a cached shard name"):
        remove_shard(tmp_path, "..")
    remove_shard(tmp_path, shard.name)
    assert not shard.exists()


def test_an_unwritable_cache_and_a_shared_one_are_one_line(server, tmp_path):
    _, shipper, address = server
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    with pytest.raises(CacheError, match=r"^cache .*file/[0-9a-f]{16}: ") as exc:
        fill(address, shipper.fingerprint, blocked)
    assert "\n" not in str(exc.value)
    from moe_cluster.node.cache import ShardCache
    from moe_cluster.node.catalog import Catalog

    catalog = Catalog.from_json(json.loads(shipper.catalog_bytes), "test")
    first = ShardCache(tmp_path / "shared", catalog, {})
    with first.locked():
        with pytest.raises(CacheError, match="is in use by another node agent"):
            with ShardCache(tmp_path / "shared", catalog, {}).locked():
                pass


def test_shards_travel_over_tls(tmp_path):
    pytest.importorskip(
        "cryptography", reason="the test extra makes its certificate with cryptography"
    )
    from tls_certs import make_tls

    tls = make_tls(tmp_path)
    shipper = Shipper(Checkpoint.open("demo"), report=lambda line: None)
    srv, port = start_server(shipper, "127.0.0.1", 0, SECRET, tls)
    try:
        address = f"127.0.0.1:{port}"
        source = ShipSource(shipper.fingerprint, address)
        view = fill_cache(
            source,
            address,
            cache_dir=tmp_path / "c",
            secret=SECRET,
            tls=tls,
            node="tls",
            placement=None,
            rank=1,
            world_size=2,
            progress=lambda *a: None,
        )
        assert list(view.tensors["model.layers.0.mlp.switch_mlp.up_proj.weight"].held) == list(
            range(8, 16)
        )
        assert (
            shipper.data is not None and shipper.bytes_sent()["tls"] > 0
        )  # the bytes took the TLS data channel
        import socket

        with socket.create_connection(
            ("127.0.0.1", shipper.data.port), timeout=10
        ) as s:  # plaintext, right token
            s.sendall(
                json.dumps(
                    {
                        "token": shipper.data_token,
                        "fingerprint": shipper.fingerprint,
                        "blobs": ["model.norm.weight"],
                    }
                ).encode()
                + b"\n"
            )
            try:
                got = s.makefile("rb").read()
            except ConnectionResetError:
                got = b""
            assert got == b""  # the handshake fails: closed or reset, not one byte
        with pytest.raises(UnavailableError):  # plaintext to a TLS port gets nothing
            fill_cache(
                source,
                address,
                cache_dir=tmp_path / "d",
                secret=SECRET,
                tls=None,
                node="plain",
                placement=None,
                rank=0,
                world_size=2,
                progress=lambda *a: None,
            )
    finally:
        srv.stop(0.5).wait()


def test_a_placement_change_copies_what_is_held_and_fetches_the_rest(server, tmp_path):
    ckpt, shipper, address = server
    fill(address, shipper.fingerprint, tmp_path, rank=0)  # experts 0..7 of 16 per layer
    before = shipper.bytes_sent().get("t0", 0)
    source = ShipSource(shipper.fingerprint, address)
    view = fill_cache(
        source,
        address,
        cache_dir=tmp_path,
        secret=SECRET,
        tls=None,
        node="t0",
        placement=None,
        rank=0,
        world_size=1,
        progress=lambda *a: None,
    )  # alone: all 16
    key = "model.layers.3.mlp.switch_mlp.gate_proj.weight"
    per_expert = sum(
        ckpt.tensors[f"model.layers.0.mlp.switch_mlp.{p}.weight"].nbytes // 16
        for p in ("gate_proj", "up_proj", "down_proj")
    )
    assert (
        shipper.bytes_sent()["t0"] - before == 4 * 8 * per_expert
    )  # 8 new experts in each of 4 layers
    assert list(view.tensors[key].held) == list(range(16))
    assert np.array_equal(
        np.array(read_tensor(view.tensors[key], list(range(16)))),
        np.array(read_tensor(ckpt.tensors[key])),
    )
    assert (
        len(list(next(tmp_path.iterdir()).glob("layer-*"))) == 4
    )  # the old placement's files are gone


def test_a_checkpoint_file_gone_from_the_coordinator_is_one_line(tmp_path):
    import shutil

    from moe_cluster.node.demo import MODEL_DIR

    src = tmp_path / "ckpt"
    shutil.copytree(MODEL_DIR, src)
    shipper = Shipper(Checkpoint.open(src), report=lambda line: None)
    srv, port = start_server(shipper, "127.0.0.1", 0, SECRET)
    try:
        (src / "model.safetensors").unlink()
        with pytest.raises(UnavailableError) as exc:
            fill(f"127.0.0.1:{port}", shipper.fingerprint, tmp_path / "c")
        assert (
            "cannot read" in str(exc.value)
            and "model.safetensors" in str(exc.value)
            and "\n" not in str(exc.value)
        )
    finally:
        srv.stop(0.5).wait()


@pytest.mark.parametrize(
    "spec",
    [
        dict(
            arch="mixtral", layout="hf"
        ),  # one tensor per expert: stacked (E_local, ...) in the cache
        dict(
            arch="qwen3_moe", quantize=4, shard_bytes=200_000
        ),  # quantized stacked experts over several files
    ],
    ids=["mixtral-hf", "qwen3_moe-q4-sharded"],
)
def test_a_shipped_shard_loads_as_the_checkpoint_does(spec, tmp_path):
    from mlx.utils import tree_flatten

    from moe_cluster.node.demo.make import DemoSpec, make_checkpoint
    from moe_cluster.node.moe.load import _Seat, load_shard

    src = tmp_path / "ckpt"
    make_checkpoint(DemoSpec(**spec), src)
    shipper = Shipper(Checkpoint.open(src), report=lambda line: None)
    srv, port = start_server(shipper, "127.0.0.1", 0, SECRET)
    try:
        view = fill(f"127.0.0.1:{port}", shipper.fingerprint, tmp_path / "c", rank=1)
    finally:
        srv.stop(0.5).wait()
    a = dict(
        tree_flatten(
            load_shard(view, None, 1, collective=_Seat(1, 2), warm_up=False).model.parameters()
        )
    )
    b = dict(
        tree_flatten(
            load_shard(str(src), None, 1, collective=_Seat(1, 2), warm_up=False).model.parameters()
        )
    )
    assert a.keys() == b.keys()
    assert [k for k in a if not np.array_equal(np.array(a[k]), np.array(b[k]))] == []


class CutOnce(Shipper):
    """Ends the stream once, UNAVAILABLE, after `cut_at` bytes of the largest blob; records each
    request's first blob and offset."""

    cut_at = 300 << 10

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.big = max(self.ranges, key=lambda b: self.ranges[b][2])
        self.requests: list[tuple[str, int]] = []
        self.cut = False

    def Fetch(self, request, context):
        self.requests.append((request.blobs[0], request.first_offset))
        for chunk in super().Fetch(request, context):
            yield chunk
            if (
                not self.cut
                and chunk.blob == self.big
                and chunk.offset + len(chunk.data) >= self.cut_at
            ):
                self.cut = True
                context.abort(grpc.StatusCode.UNAVAILABLE, "cut for the test")


def assert_holds_the_source(view, ckpt, shipper, cache_dir: Path) -> None:
    """The cached shard reads the largest blob as the checkpoint holds it, and its manifest records
    that blob's sha256 as the checkpoint's bytes give it."""
    assert np.array_equal(
        np.array(read_tensor(view.tensors[shipper.big])),
        np.array(read_tensor(ckpt.tensors[shipper.big])),
    )
    path, start, n = shipper.ranges[shipper.big]
    with open(path, "rb") as f:
        f.seek(start)
        truth = hashlib.sha256(f.read(n)).hexdigest()
    manifest = json.loads(
        (cache_mod.shard_dir(cache_dir, shipper.fingerprint) / cache_mod.MANIFEST).read_text()
    )
    assert manifest["sha256"][shipper.big] == truth


def test_a_transfer_cut_inside_a_blob_resumes_from_its_durable_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(
        cache_mod, "PROGRESS_BYTES", 64 << 10
    )  # the demo's blobs are at most 512 KiB
    ckpt = Checkpoint.open("demo")
    shipper = CutOnce(ckpt, chunk_bytes=16 << 10, report=lambda line: None, data_channel=False)
    srv, port = start_server(shipper, "127.0.0.1", 0, SECRET)
    try:
        address = f"127.0.0.1:{port}"
        with pytest.raises(UnavailableError, match="cut for the test"):
            fill(address, shipper.fingerprint, tmp_path)
        sent_before = shipper.bytes_sent()["t0"]
        view = fill(address, shipper.fingerprint, tmp_path)
        size = shipper.ranges[shipper.big][2]
        blob, offset = shipper.requests[-1]
        assert blob == shipper.big and shipper.cut_at - (64 << 10) <= offset < size, (
            shipper.requests[-1]
        )
        resent = shipper.bytes_sent()["t0"] - sent_before
        fresh = tmp_path / "fresh"  # what one uninterrupted fill fetches, from an empty cache
        fill(address, shipper.fingerprint, fresh, rank=0)
        needed = shipper.bytes_sent()["t0"] - sent_before - resent
        # sent twice: only the big blob's bytes between its last durable mark and the cut (at most
        # one mark's worth and a chunk), not the 300 KiB of it sent before the cut
        excess = sent_before + resent - needed
        assert 0 <= excess <= (64 << 10) + (16 << 10), (sent_before, resent, needed)
        assert shipper.big in ckpt.tensors  # the demo's largest blob is a whole replicated tensor
        assert_holds_the_source(view, ckpt, shipper, tmp_path)
        assert not (cache_mod.shard_dir(tmp_path, shipper.fingerprint) / "journal").exists()
    finally:
        srv.stop(0.5).wait()


def test_the_data_channel_carries_the_shard_and_refuses_a_wrong_token(tmp_path):
    import socket

    ckpt = Checkpoint.open("demo")
    shipper = Shipper(ckpt, report=lambda line: None)
    srv, port = start_server(shipper, "127.0.0.1", 0, SECRET)
    try:
        assert shipper.data is not None and shipper.data.port
        view = fill(f"127.0.0.1:{port}", shipper.fingerprint, tmp_path)
        key = "model.layers.1.mlp.switch_mlp.down_proj.weight"
        assert np.array_equal(
            np.array(read_tensor(view.tensors[key], [0, 3])),
            np.array(read_tensor(ckpt.tensors[key], [0, 3])),
        )
        assert shipper.bytes_sent()["t0"] > 0
        with socket.create_connection(("127.0.0.1", shipper.data.port), timeout=10) as s:
            s.sendall(
                json.dumps(
                    {
                        "token": "guess",
                        "fingerprint": shipper.fingerprint,
                        "blobs": ["model.norm.weight"],
                    }
                ).encode()
                + b"\n"
            )
            answer = s.makefile("rb").read()
        assert (
            answer.startswith(b"-wrong data token") and b"model.norm" not in answer
        )  # no byte of any blob
    finally:
        srv.stop(0.5).wait()
    with pytest.raises(OSError):  # the data channel ended with the service
        socket.create_connection(("127.0.0.1", shipper.data.port), timeout=2).close()


class FaultyData(Shipper):
    """Over the data channel, the first answer goes wrong (`fault`) on the largest blob, which the demo
    sends first; later answers are the real ones. Records each request's (first blob, offset)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.big = max(self.ranges, key=lambda b: self.ranges[b][2])
        self.requests: list[tuple[str, int]] = []

    def send_blobs(self, conn, name, blobs, first_offset):
        import struct

        self.requests.append((blobs[0], first_offset))
        if len(self.requests) > 1:
            return super().send_blobs(conn, name, blobs, first_offset)
        assert blobs[0] == self.big and first_offset == 0  # the demo's first blob is its largest
        path, start, n = self.ranges[self.big]
        with open(path, "rb") as f:
            f.seek(start)
            data = self.fault(bytearray(f.read(n)))
        conn.sendall(struct.pack("<Q", n) + blob_header(self.digests.get(self.big)) + data)


class CutData(FaultyData):
    """Closes the connection after `cut_at` bytes of the largest blob."""

    cut_at = 300 << 10

    def fault(self, data: bytearray) -> bytearray:
        return data[: self.cut_at]  # and the connection closes: a node's link cut mid-blob


def test_a_data_channel_cut_inside_a_blob_resumes_from_its_durable_bytes(tmp_path, monkeypatch):
    monkeypatch.setattr(cache_mod, "PROGRESS_BYTES", 64 << 10)
    monkeypatch.setattr(catalog_mod, "PIECE_BYTES", 16 << 10)
    ckpt = Checkpoint.open("demo")
    shipper = CutData(ckpt, report=lambda line: None)
    srv, port = start_server(shipper, "127.0.0.1", 0, SECRET)
    try:
        with pytest.raises(
            UnavailableError, match=r"data channel .* stopped in model.embed_tokens.weight"
        ):
            fill(f"127.0.0.1:{port}", shipper.fingerprint, tmp_path)
        view = fill(f"127.0.0.1:{port}", shipper.fingerprint, tmp_path)
        blob, offset = shipper.requests[-1]
        assert blob == shipper.big and shipper.cut_at - (64 << 10) <= offset < shipper.cut_at, (
            shipper.requests
        )
        assert np.array_equal(
            np.array(read_tensor(view.tensors[shipper.big])),
            np.array(read_tensor(ckpt.tensors[shipper.big])),
        )
    finally:
        srv.stop(0.5).wait()


class CorruptData(FaultyData):
    """The second piece of the largest blob arrives with one bit flipped (the digests in front of it
    are the checkpoint's)."""

    def fault(self, data: bytearray) -> bytearray:
        data[catalog_mod.PIECE_BYTES + 5] ^= 0x10
        return data


def test_a_corrupt_piece_on_the_data_channel_is_fetched_again_from_that_piece(
    tmp_path, monkeypatch, caplog
):
    """Each piece is checked against the coordinator's digest of its checkpoint's bytes: a flipped bit
    on the way is caught, and the stream restarts at that piece, not at the blob or the shard."""
    monkeypatch.setattr(catalog_mod, "PIECE_BYTES", 64 << 10)
    ckpt = Checkpoint.open("demo")
    shipper = CorruptData(ckpt, report=lambda line: None)
    srv, port = start_server(shipper, "127.0.0.1", 0, SECRET)
    try:
        view = fill(f"127.0.0.1:{port}", shipper.fingerprint, tmp_path)
        assert "arrived corrupt (its digest differs from the coordinator's)" in caplog.text
        assert shipper.requests[1] == (shipper.big, 64 << 10), shipper.requests
        assert_holds_the_source(view, ckpt, shipper, tmp_path)
    finally:
        srv.stop(0.5).wait()


def test_the_coordinator_hashes_a_checkpoint_once_and_again_only_what_changed(tmp_path):
    """The digests are kept across runs in the folder `up` gives (one line per blob): a second
    coordinator on the same checkpoint ships a fresh node without reading a byte to hash it, and a
    checkpoint file written since is hashed again."""
    import shutil

    src = tmp_path / "ckpt"
    shutil.copytree(Checkpoint.open("demo").path, src)
    digests = tmp_path / "digests"

    def ship_once(cache: Path) -> Shipper:
        shipper = Shipper(Checkpoint.open(src), report=lambda line: None, digest_dir=digests)
        srv, port = start_server(shipper, "127.0.0.1", 0, SECRET)
        try:
            fill(f"127.0.0.1:{port}", shipper.fingerprint, cache)
        finally:
            srv.stop(0.5).wait()
        return shipper

    first = ship_once(tmp_path / "a")
    sent = first.bytes_sent()["t0"]
    assert (
        first.digests.hashed_bytes >= sent > 0
    )  # what rank 0 needs, hashed once (some ahead of it)
    assert len(list(digests.glob("*.jsonl"))) == 1
    second = ship_once(tmp_path / "b")
    assert second.bytes_sent()["t0"] == sent and second.digests.hashed_bytes == 0
    f = src / "model.safetensors"  # the demo's weights (its MTP layer is in mtp.safetensors)
    os.utime(f)  # a checkpoint written since (its mtime moved): its digests are not trusted
    third = ship_once(tmp_path / "c")
    assert third.digests.hashed_bytes >= sent


def test_a_digest_file_of_stale_lines_is_compacted_and_a_torn_line_skipped(tmp_path):
    """Lines of a checkpoint file that changed since, repeated lines and a line cut short by a crash
    are skipped when a coordinator starts; when they outnumber the good ones, the file is rewritten
    with the good ones only."""
    from moe_cluster.coordinator.serve.digests import Digests

    ckpt = Checkpoint.open("demo")
    shipper = Shipper(ckpt, report=lambda line: None)
    blobs = sorted(shipper.ranges)[:3]
    first = Digests(
        shipper.ranges, shipper.fingerprint, tmp_path, piece_bytes=catalog_mod.PIECE_BYTES
    )
    truth = {b: first.get(b) for b in blobs}
    first.close()
    (path,) = tmp_path.glob("*.jsonl")
    good = path.read_text().splitlines()
    stale = [json.dumps({**json.loads(line), "stat": [1, 2, 3]}) for line in good] * 20
    path.write_text("\n".join(stale + good) + "\n" + good[0][:40])  # and a torn last line
    again = Digests(
        shipper.ranges, shipper.fingerprint, tmp_path, piece_bytes=catalog_mod.PIECE_BYTES
    )
    assert {b: again.get(b) for b in blobs} == truth and again.hashed_bytes == 0
    assert sorted(path.read_text().splitlines()) == sorted(good)
    again.close()


def test_a_blob_is_hashed_before_its_look_ahead_and_again_after_its_file_changes(tmp_path):
    """The blob a stream sends next is hashed first, its look-ahead after it (one worker here); a
    digest kept in memory is not trusted once its file has changed (it is hashed again), nor is a
    kept line for another byte range of the file."""
    from moe_cluster.coordinator.serve import digests as digests_mod
    from moe_cluster.coordinator.serve.digests import Digests

    f = tmp_path / "w.bin"
    f.write_bytes(bytes(range(256)) * 64)
    ranges = {f"b{i}": (f, i * 4096, 4096) for i in range(4)}
    order: list[str] = []

    class Recording(Digests):
        def _hash(self, blob):
            order.append(blob)
            return super()._hash(blob)

    d = Recording(ranges, "f" * 64, tmp_path / "dg", piece_bytes=1024, workers=1)
    d.start("b0", ["b1", "b2", "b3"])
    first = d.get("b0")
    d.get("b2")
    assert order[0] == "b0" and order[1:3] == ["b1", "b2"], order  # at most AHEAD ahead
    with open(f, "r+b") as fh:  # the checkpoint rewritten in place while the coordinator runs
        fh.seek(10)
        fh.write(b"\xff")
    again = d.get("b0")
    assert (
        again.sha256 != first.sha256
        and again.sha256 == hashlib.sha256(f.read_bytes()[:4096]).hexdigest()
    )
    d.close()
    moved = {
        b: (p, start + 1, n) for b, (p, start, n) in ranges.items()
    }  # a later version places blobs elsewhere
    fresh = Digests(moved, "f" * 64, tmp_path / "dg", piece_bytes=1024)
    assert fresh.known() == 0
    fresh.close()
    assert digests_mod.AHEAD == 2


def test_the_data_channel_refuses_a_negative_offset_and_the_node_a_wrong_length(tmp_path):
    import socket
    import struct

    ckpt = Checkpoint.open("demo")

    class Short(Shipper):  # announces one byte less than the blob has
        def send_blobs(self, conn, name, blobs, first_offset):
            path, start, n = self.ranges[blobs[0]]
            conn.sendall(struct.pack("<Q", n - 1) + blob_header(self.digests.get(blobs[0])))

    for cls in (Shipper, Short):
        shipper = cls(ckpt, report=lambda line: None)
        srv, port = start_server(shipper, "127.0.0.1", 0, SECRET)
        try:
            if cls is Shipper:
                with socket.create_connection(("127.0.0.1", shipper.data.port), timeout=10) as s:
                    s.sendall(
                        json.dumps(
                            {
                                "token": shipper.data_token,
                                "fingerprint": shipper.fingerprint,
                                "blobs": ["model.norm.weight"],
                                "first_offset": -65536,
                            }
                        ).encode()
                        + b"\n"
                    )
                    answer = s.makefile("rb").read()
                assert answer.startswith(b"-first_offset -65536 is not inside the blob"), answer[
                    :100
                ]
            else:
                with pytest.raises(
                    CacheError, match=r"sends \d+ bytes of blob .* the catalog gives it \d+"
                ):
                    fill(f"127.0.0.1:{port}", shipper.fingerprint, tmp_path / "short")
        finally:
            srv.stop(0.5).wait()

"""The Ship service (proto/ship.proto): shards of a checkpoint only the coordinator holds."""

from __future__ import annotations


def catalog_request_to_proto(fingerprint: str):
    from .. import ship_pb2 as spb

    return spb.CatalogRequest(fingerprint=fingerprint)


def catalog_reply_to_proto(catalog: bytes, data_port: int = 0, data_token: str = ""):
    from .. import ship_pb2 as spb

    return spb.CatalogReply(catalog=catalog, data_port=data_port, data_token=data_token)


def catalog_reply_from_proto(msg) -> bytes:
    return msg.catalog


def data_channel_from_proto(msg) -> tuple[int, str]:
    """(port, token) of a CatalogReply's plain-TCP data channel; port 0 when it has none."""
    return msg.data_port, msg.data_token


def fetch_request_to_proto(spec):
    from .. import ship_pb2 as spb

    return spb.FetchRequest(
        fingerprint=spec.fingerprint,
        blobs=list(spec.blobs),
        node=spec.node,
        first_offset=spec.first_offset,
        chunk_bytes=spec.chunk_bytes,
    )


def fetch_request_from_proto(msg):
    from ..records import FetchSpec

    return FetchSpec(msg.fingerprint, tuple(msg.blobs), msg.node, msg.first_offset, msg.chunk_bytes)


def chunk_to_proto(blob: str, offset: int, data: bytes, crc32: int, last: bool, sha256: str = ""):
    from .. import ship_pb2 as spb

    return spb.Chunk(blob=blob, offset=offset, data=data, crc32=crc32, last=last, sha256=sha256)


def chunk_from_proto(msg):
    from ..records import ShipChunk

    return ShipChunk(
        msg.blob, msg.offset, msg.data, msg.crc32, msg.last, msg.sha256
    )  # each read of msg.data copies it: once

"""The files of one cached shard: `replicated.safetensors` and one file per MoE layer holding this
node's experts stacked, where each tensor and each blob goes in them, and the shard seen as the
checkpoint it came from (`CachedCheckpoint`). File names come from here, never from a manifest.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from .catalog import CacheError, Catalog
from .checkpoint import _DTYPES, Checkpoint, TensorInfo, read_config

REPLICATED = "replicated.safetensors"
_ALIGN = 64  # bytes: tensor data starts aligned, so mmap'd reads are too


@dataclass(frozen=True)
class Slot:
    """One tensor of a cached file: its bytes are `blobs` in order, from `offset`."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute, bytes
    blobs: tuple[str, ...]


@dataclass(frozen=True)
class FileSet:
    """One cached file: its header bytes and where each tensor goes."""

    name: str
    header: bytes  # 8-byte length + JSON, padded
    slots: tuple[Slot, ...]
    size: int  # bytes, header included

    def blob_offsets(self, sizes: dict[str, int]) -> dict[str, int]:
        out = {}
        for s in self.slots:
            at = s.offset
            for b in s.blobs:
                out[b] = at
                at += sizes[b]
        return out


def _fileset(
    name: str, tensors: list[tuple[str, str, tuple[int, ...], tuple[str, ...]]], meta: dict
) -> FileSet:
    entries, at = {}, 0
    for tname, dtype, shape, _ in tensors:
        n = math.prod(shape) * _DTYPES[dtype][2]
        entries[tname] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + n]}
        at += -(-n // _ALIGN) * _ALIGN if n else 0
        entries[tname]["data_offsets"][1] = entries[tname]["data_offsets"][0] + n
    head = json.dumps({"__metadata__": meta, **entries}, separators=(",", ":")).encode()
    head += b" " * (-(len(head) + 8) % _ALIGN)
    base = 8 + len(head)
    slots = tuple(
        Slot(tname, dtype, shape, base + entries[tname]["data_offsets"][0], blobs)
        for tname, dtype, shape, blobs in tensors
    )
    return FileSet(name, struct.pack("<Q", len(head)) + head, slots, base + at)


def layer_file_name(layer: int, local: Sequence[int]) -> str:
    digest = hashlib.sha256(",".join(map(str, local)).encode()).hexdigest()[:12]
    return f"layer-{layer:04d}-{digest}.safetensors"


def layout(catalog: Catalog, local: dict[int, Sequence[int]]) -> list[FileSet]:
    """The files of a shard holding experts `local` ({MoE layer: experts}) of `catalog`."""
    files = [
        _fileset(
            REPLICATED,
            [(k, d, s, (k,)) for k, d, s in catalog.replicated],
            {"format": "moe-cluster"},
        )
    ]
    for layer, (n, groups) in sorted(catalog.layers.items()):
        experts = sorted(local.get(layer, ()))
        if any(not 0 <= e < n for e in experts):
            raise CacheError(f"layer {layer}: experts {experts} out of range 0..{n - 1}")
        if not experts:
            continue
        tensors = []
        for g in groups:
            shape = (len(experts) * g.expert_shape()[0],) + g.expert_shape()[1:]
            tname = g.key if g.stacked else g.key.replace("{e}", "*")
            tensors.append((tname, g.dtype, shape, tuple(g.blob(e) for e in experts)))
        files.append(
            _fileset(
                layer_file_name(layer, experts),
                tensors,
                {"format": "moe-cluster", "experts": ",".join(map(str, experts))},
            )
        )
    return files


class CachedCheckpoint(Checkpoint):
    """A shard directory seen as the checkpoint it came from: the same tensor names and shapes;
    expert tensors hold only this node's experts (reading another one is an error)."""

    def __init__(self, root: Path, catalog: Catalog, local: dict[int, tuple[int, ...]]):
        self.path = root
        self.config = read_config(root)
        self.tensors = {}
        sizes = catalog.blob_nbytes()
        files = {fs.name: fs for fs in layout(catalog, local)}
        rep = files[REPLICATED]
        for s in rep.slots:
            self.tensors[s.name] = TensorInfo(
                s.name, root / REPLICATED, s.dtype, s.shape, s.offset, s.offset + sizes[s.blobs[0]]
            )
        for layer, (n, groups) in catalog.layers.items():
            experts = local.get(layer, ())
            fs = files.get(layer_file_name(layer, experts)) if experts else None
            offsets = fs.blob_offsets(sizes) if fs else {}
            path = root / fs.name if fs else root / REPLICATED
            for g in groups:
                if g.stacked:
                    start = offsets[g.blob(experts[0])] if experts else 0
                    full = math.prod(g.shape) * _DTYPES[g.dtype][2]
                    self.tensors[g.key] = TensorInfo(
                        g.key,
                        path,
                        g.dtype,
                        g.shape,
                        start,
                        start + full,
                        held=tuple(experts),
                        per=g.per,
                    )
                    continue
                for e in range(n):
                    key = g.key.format(e=e)
                    if e in experts:
                        at = offsets[g.blob(e)]
                        self.tensors[key] = TensorInfo(
                            key, path, g.dtype, g.shape, at, at + g.expert_nbytes()
                        )
                    else:
                        self.tensors[key] = TensorInfo(
                            key,
                            path,
                            g.dtype,
                            g.shape,
                            0,
                            g.expert_nbytes(),
                            held=(),
                            per=g.shape[0] if g.shape else 1,
                        )

"""What a model is made of, as blobs: the catalog the coordinator describes it to a node by, where
each blob lies in the checkpoint, and how a blob's pieces are digested on the way.

A blob is the unit of shipping and of repair: one replicated tensor, or one expert's slice of one
expert tensor. The catalog decides the files a node writes (shard_layout.py), so one read from the
wire is checked field by field.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from pathlib import Path

import xxhash

from ..proto.errors import UserError
from .checkpoint import _DTYPES, Checkpoint
from .describe import Group, ModelDescription

PIECE_BYTES = 4 << 20  # the unit of the source's piece digests (coordinator/serve/digests.py)
SHA256_HEX = re.compile(
    r"[0-9a-f]{64}"
)  # a blob's sha256 as manifests and digests write it (fullmatch)


class CacheError(UserError):
    """A cache directory, manifest or catalog that cannot be used, with the reason."""


def piece_hasher():
    """The digest of one piece of a blob, as the coordinator computes it from its checkpoint and the
    node checks it on arrival, a part at a time (`update`, then `intdigest`; the node hashes each
    part as it lands, while it is in the CPU's cache): xxh3-64, ~30 GB/s on one core (sha256: ~2)."""
    return xxhash.xxh3_64()


def fingerprint(ckpt: Checkpoint) -> str:
    """sha256 of config.json and every safetensors header: changes when any weight's name, dtype,
    shape or place changes, costs no weight reads (a re-quantized or retrained checkpoint with the
    same headers is caught by the per-blob sha256 instead, when a node next loads). Taken from the
    bytes the Checkpoint read when it opened: nothing is read again."""
    h = hashlib.sha256()
    h.update(ckpt.config_bytes)
    for name in sorted({t.file.name for t in ckpt.tensors.values()}):
        h.update(name.encode() + b"\0" + ckpt.headers[name])
    return h.hexdigest()


@dataclass(frozen=True)
class Catalog:
    """The model as the coordinator describes it to a node: fingerprint, config, tensors by role."""

    fingerprint: str
    config_text: str
    replicated: tuple[tuple[str, str, tuple[int, ...]], ...]  # (key, dtype, shape)
    layers: dict[int, tuple[int, tuple[Group, ...]]]  # MoE layer -> (experts, groups)

    def to_json(self) -> dict:
        return {
            "fingerprint": self.fingerprint,
            "config": self.config_text,
            "replicated": [[k, d, list(s)] for k, d, s in self.replicated],
            "layers": {
                str(l): {
                    "experts": n,
                    "groups": [
                        {
                            "key": g.key,
                            "dtype": g.dtype,
                            "shape": list(g.shape),
                            "stacked": g.stacked,
                            "per": g.per,
                        }
                        for g in groups
                    ],
                }
                for l, (n, groups) in sorted(self.layers.items())
            },
        }

    @classmethod
    def of(cls, desc: ModelDescription) -> "Catalog":
        """The catalog of a described checkpoint (its headers and the node's own MoE rule)."""
        desc.require_moe()
        ckpt = desc.checkpoint
        layers = {}
        grouped: set[str] = set()
        for m in desc.moe:
            if m.layout_error:
                raise CacheError(m.layout_error)
            layers[m.layer] = (m.num_experts, m.groups)
            for g in m.groups:
                grouped.update({g.key} if g.stacked else {g.blob(e) for e in range(m.num_experts)})
        replicated = tuple(
            (k, t.dtype, t.shape) for k, t in sorted(ckpt.tensors.items()) if k not in grouped
        )
        return cls(fingerprint(ckpt), ckpt.config_bytes.decode(), replicated, layers)

    @classmethod
    def from_json(cls, d, where: str) -> "Catalog":
        """Strict: a catalog decides file contents, so every field is checked and a bad one named."""
        try:
            fp, config = d["fingerprint"], d["config"]
            if not (isinstance(fp, str) and re.fullmatch(r"[0-9a-f]{64}", fp)) or not isinstance(
                config, str
            ):
                raise ValueError("fingerprint must be 64 hex digits and config a string")
            replicated = tuple((_s(k), _dtype(dt), _shape(s)) for k, dt, s in d["replicated"])
            layers = {}
            for l, v in d["layers"].items():
                n = int(v["experts"])
                groups = tuple(
                    Group(
                        _s(g["key"]),
                        _dtype(g["dtype"]),
                        _shape(g["shape"]),
                        bool(g["stacked"]),
                        int(g["per"]),
                    )
                    for g in v["groups"]
                )
                if n < 1 or not groups:
                    raise ValueError(f"layer {l} has {n} experts and {len(groups)} expert tensors")
                for g in groups:
                    if g.stacked and (g.per < 1 or not g.shape or g.shape[0] != n * g.per):
                        raise ValueError(
                            f"{g.key}: leading dimension {g.shape[:1]} is not {n} experts × {g.per}"
                        )
                    if not g.stacked and "{e}" not in g.key:
                        raise ValueError(f"{g.key}: a per-expert tensor name needs {{e}}")
                layers[int(l)] = (n, groups)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CacheError(f"{where}: malformed catalog ({type(exc).__name__}: {exc})") from None
        return cls(fp, config, replicated, layers)

    def blob_nbytes(self) -> dict[str, int]:
        """{blob id: bytes} of every blob of the model."""
        out = {k: math.prod(s) * _DTYPES[d][2] for k, d, s in self.replicated}
        for n, groups in self.layers.values():
            for g in groups:
                out.update({g.blob(e): g.expert_nbytes() for e in range(n)})
        return out


def _s(x) -> str:
    if not isinstance(x, str) or not x or len(x) > 1000:
        raise ValueError(f"{x!r} is not a tensor name")
    return x


def _dtype(x) -> str:
    if x not in _DTYPES:
        raise ValueError(f"unknown dtype {x!r}")
    return x


def _shape(x) -> tuple[int, ...]:
    if not isinstance(x, list) or not all(isinstance(i, int) and 0 <= i < 1 << 40 for i in x):
        raise ValueError(f"{x!r} is not a shape")
    return tuple(x)


def source_ranges(ckpt: Checkpoint, catalog: Catalog) -> dict[str, tuple[Path, int, int]]:
    """{blob id: (file, start, bytes)} in the checkpoint: where the coordinator reads each blob."""
    out = {
        k: (ckpt.tensors[k].file, ckpt.tensors[k].start, ckpt.tensors[k].nbytes)
        for k, _, _ in catalog.replicated
    }
    for n, groups in catalog.layers.values():
        for g in groups:
            nb = g.expert_nbytes()
            for e in range(n):
                if g.stacked:
                    t = ckpt.tensors[g.key]
                    out[g.blob(e)] = (t.file, t.start + e * nb, nb)
                else:
                    t = ckpt.tensors[g.key.format(e=e)]
                    out[g.blob(e)] = (t.file, t.start, t.nbytes)
    return out

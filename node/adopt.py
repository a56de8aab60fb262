"""Whether a node may keep what it has loaded for a coordinator that asks it to adopt.

A coordinator that restarts (a crash, a `kill -9`, a reboot under its service) sends every node
the Load it would send anyway, marked `adopt`. A node whose loaded model is what that Load
describes keeps it and only re-joins; any difference and the coordinator loads every node afresh,
as before. What must match, and why:

- the model: the same folder (`model`) and, where the coordinator ships shards, the same model
  fingerprint (`ship.fingerprint`: config.json and every safetensors header); and the files the
  node read are unchanged since (`identity`: name, size and mtime of each, no byte read);
- where its experts sit: `placement`, `rank`, `world_size`: a node's shard is its rank's share;
- how it reaches its peers: `transport` (every envoy address, ports, TLS files, timeouts; the mlx
  hostfile and backend): its envoy, or its `mx.distributed` group, was started with these;
- what the load built around the weights: `keepalive`, `route` (timed at load), `expert_cache`
  and `heat` (the resident set), `prompt_cache_bytes`, `draft_model`, `speculative` and
  `mtp_experts` (the MTP layer's experts, whole or sharded);
- how its running batch was made: `max_batch`, `prefill_budget`, `kv_budget_bytes`,
  `prefill_step`, `draft_tokens`, `overlap`, `attention` (by stream, each MoE layer's exchange is
  built for it at load).

Only what concerns the coordinator itself may differ: the address of its Ship service (a new
process may listen on another port), how long the node waits for it before dropping its
sequences (`orphan_after_s`), and the `adopt` mark.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from ..proto.records import LoadSpec

# the coordinator's own: a new one may say otherwise without the node loading again
SESSION_FIELDS = ("orphan_after_s", "adopt")


def mismatch(loaded: LoadSpec, wanted: LoadSpec) -> str:
    """Why a node that loaded `loaded` cannot adopt `wanted` ("" when it can): the first field that
    differs, with both values (the secret never: a transport is named, not shown)."""
    for f in dataclasses.fields(LoadSpec):
        if f.name in SESSION_FIELDS:
            continue
        a, b = getattr(loaded, f.name), getattr(wanted, f.name)
        if f.name == "ship" and a is not None and b is not None:
            a, b = a.fingerprint, b.fingerprint  # the Ship service's address is the coordinator's
            if a != b:
                return f"another model (fingerprint {b[:16]}, loaded {a[:16]})"
            continue
        if a != b:
            if f.name == "transport":
                return "another transport (peers, ports, TLS or timeouts differ)"
            if f.name in ("placement", "heat"):
                return f"another {f.name}"
            return f"{f.name} {_short(b)}, loaded {_short(a)}"
    return ""


def identity(folder: str | os.PathLike) -> tuple:
    """What a node read its model from, as it stands: (name, bytes, mtime) of every file of the
    folder that a load reads (config, index, safetensors). Stat only: no byte of a weight is read.
    A copied, re-quantized or replaced checkpoint changes it; () where the folder is gone."""
    path = Path(folder)
    try:
        files = sorted(p for p in path.iterdir() if p.suffix in (".json", ".safetensors"))
        return tuple((p.name, (s := p.stat()).st_size, s.st_mtime_ns) for p in files)
    except OSError:
        return ()


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."

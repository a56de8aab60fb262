"""Plumbing every process of the project shares, and nothing else: the worker thread that owns
MLX, gRPC's event loop and authentication, free ports, mDNS, the parent watchdog, the cache folder.
It imports only proto/, so node/, envoy/ and coordinator/ all stand on it and none reaches into
another for it."""

import os
from pathlib import Path

# grpc's older polling engine reads the socket on the thread that waits for events, one thread
# hop less per message than the EventEngine default; measured faster on this workload (the envoy's
# all-reduce; the coordinator's CPU per streamed token, 0.33 -> 0.19 ms). Must be set before grpc
# is imported (the `moe-cluster` entry point and run_grpc_loop do); a caller's own setting wins.
GRPC_EXPERIMENTS = "-event_engine_client,-event_engine_listener"


def cache_home() -> Path:
    """~/.cache/moe-cluster (or under $XDG_CACHE_HOME): a node's shards, the coordinator's digests,
    transformers' import structure (common/importcache.py)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "moe-cluster"

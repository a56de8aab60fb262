"""`transport: mlx`: the collective over `mx.distributed` (ring over TCP; JACCL RDMA on macOS 26.2+).

Each all-reduce is an `all_gather` of the partials followed by `envoy.reduce` in rank order, so
the sum is the same bytes as the envoy transport's on every node (a ring `all_sum` adds in a
different order per chunk and in the payload dtype). The ring backend reads the hostfile named by
MLX_HOSTFILE (JSON: per rank, a list of "ip:port") and the rank from MLX_RANK; this module writes
the file and sets both before `mx.distributed.init`. JACCL is the same code with its own
variables (MLX_IBV_DEVICES, MLX_JACCL_COORDINATOR); whether it exists is feature-detected.

`mx.distributed` has no timeout of its own: a dead peer surfaces as an error from the ring, but a
stalled one would block forever. A watchdog thread therefore ends the node process when one
all-reduce outlasts `timeout_s` (an MLX group cannot be rebuilt inside a process anyway).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from ...envoy.reduce import Reducer
from .base import CollectiveError, from_wire, to_wire
from .specs import MlxSpec

logger = logging.getLogger(__name__)

EXIT_STALLED = 75  # exit status of a node whose all-reduce outlasted the timeout


def write_hostfile(spec: MlxSpec, folder: str | Path) -> dict[str, str]:
    """Write what the backend reads into `folder`; returns the environment variables to set."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if spec.backend == "ring":
        path = folder / "mlx-ring-hosts.json"
        path.write_text(json.dumps([list(h) for h in spec.hosts]))
        return {"MLX_HOSTFILE": str(path)}
    path = folder / "mlx-jaccl-devices.json"
    path.write_text(json.dumps([list(row) for row in spec.jaccl_devices]))
    return {"MLX_IBV_DEVICES": str(path), "MLX_JACCL_COORDINATOR": spec.jaccl_coordinator}


class _Watchdog:
    """Ends the process if one collective call outlasts the timeout (no way to interrupt MLX)."""

    def __init__(self, rank: int, timeout_s: float):
        self._rank = rank
        self._timeout = timeout_s
        self._since: float | None = None
        self._what = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlx-collective-watchdog", daemon=True)
        self._thread.start()

    def enter(self, what: str) -> None:
        self._what = what
        self._since = time.monotonic()

    def leave(self) -> None:
        self._since = None

    def _run(self) -> None:
        period = min(max(self._timeout / 20, 0.05), 1.0)  # seconds
        while not self._stop.wait(period):
            since = self._since
            if since is not None and time.monotonic() - since > self._timeout:
                msg = (f"rank {self._rank}: mx.distributed {self._what} did not complete within {self._timeout:g} s "
                       f"(a peer stalled or the network is down); the MLX group cannot recover, exiting")
                logger.critical("%s", msg)
                print(f"moe-cluster node: {msg}", file=sys.stderr, flush=True)
                os._exit(EXIT_STALLED)

    def close(self) -> None:
        self._stop.set()


class MlxCollective:
    """The Collective of `transport: mlx`."""

    def __init__(self, spec: MlxSpec, rank: int):
        if not mx.distributed.is_available(spec.backend):
            raise CollectiveError(f"mx.distributed backend {spec.backend!r} is not available in this MLX build "
                                  f"(jaccl needs macOS 26.2+ with Thunderbolt 5 RDMA)")
        self.rank = rank
        self.world_size = spec.world_size
        self._tmp = None
        self._watchdog = None
        if spec.world_size == 1:  # a ring of one cannot form (it dials itself); the sum is the partial
            self.group = None
            return
        folder = spec.hostfile_dir
        if not folder:
            self._tmp = tempfile.TemporaryDirectory(prefix=f"moe-mlx-{rank}-")
            folder = self._tmp.name
        env = write_hostfile(spec, folder)
        env["MLX_RANK"] = str(rank)
        os.environ.update(env)
        try:
            self.group = mx.distributed.init(strict=True, backend=spec.backend)
        except RuntimeError as exc:
            raise CollectiveError(f"rank {rank}: mx.distributed {spec.backend} init failed: {exc}") from exc
        if self.group.size() != spec.world_size or self.group.rank() != rank:
            raise CollectiveError(f"mx.distributed made rank {self.group.rank()} of {self.group.size()}, "
                                  f"expected rank {rank} of {spec.world_size}")
        self._reduce = Reducer()
        self._watchdog = _Watchdog(rank, spec.timeout_s)
        logger.info("rank %s joined mx.distributed %s group of %s", rank, spec.backend, spec.world_size)

    def begin(self, request_id: str) -> None:
        pass  # the ring has no per-request state; a failed request leaves the group unusable anyway

    def all_reduce(self, partial: mx.array, layer: int) -> mx.array:
        if self.group is None:
            return partial
        self._watchdog.enter(f"all_gather at layer {layer}")
        try:
            gathered = mx.distributed.all_gather(partial.reshape(1, -1), group=self.group)  # (N, numel)
            mx.eval(gathered)
        except RuntimeError as exc:
            raise CollectiveError(f"rank {self.rank}: mx.distributed all_gather at layer {layer} failed: {exc}") from exc
        finally:
            self._watchdog.leave()
        raw, dtype = to_wire(gathered)
        parts = list(np.ascontiguousarray(raw).reshape(self.world_size, -1))
        return from_wire(self._reduce(parts, dtype), dtype, partial.shape)

    def failure(self) -> str | None:
        return None  # no child process to lose: a peer's loss fails the step itself

    def abort(self, request_id: str) -> None:
        pass  # a step waits out its own timeout

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.close()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

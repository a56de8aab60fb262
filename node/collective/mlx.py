"""`transport: mlx`: the collective over `mx.distributed` (ring over TCP; JACCL RDMA on macOS 26.2+;
NCCL on CUDA GPUs).

Each all-reduce is a graph operation: an `all_gather` of the partials, then the sum in rank order
in float32 (`base.rank_order_sum_rows`), so a token step stays one lazy graph with no host sync inside
it, and the sum is the same bytes as the envoy transport's on every node (a ring `all_sum` adds in
a different order per chunk and in the payload dtype). At two ranks over NCCL the backend's
`all_sum` of the float32 partials is those bytes too (one addition, either order), and costs
less. The first all-reduce of a step also carries the token agreement (`base.Rider`): every rank's sampled token
and cancel flag, as raw bytes beside the partial's, so all_gather shows every node what every other
sampled (summed by NCCL at two ranks: in slots of the payload, `base.ride_slots`).

Each backend reads its peers from the environment, set here before `mx.distributed.init`:
ring reads the hostfile named by MLX_HOSTFILE (JSON: per rank, a list of "ip:port") and MLX_RANK;
JACCL its own (MLX_IBV_DEVICES, MLX_JACCL_COORDINATOR); NCCL a rendezvous address
(NCCL_HOST_IP, NCCL_PORT) with MLX_RANK and MLX_WORLD_SIZE, the GPU being the launcher's choice
(CUDA_VISIBLE_DEVICES). Whether a backend exists is feature-detected.

`mx.distributed` has no timeout of its own: a dead peer surfaces as an error from the ring, but a
stalled one would block forever. The collective cannot time the all_gather itself any more (it
runs inside the graph), so the node arms a watchdog (`watch`) around every wait on a step's result
(the token read, a prefill chunk, the agreement), and the watchdog ends the node process when
one wait outlasts `timeout_s` (an MLX group cannot be rebuilt inside a process anyway). The bound
therefore covers a step's compute too, which is far below any sensible collective timeout once
MLX has built the step's kernels: the waits that may build them get COLD_STEP_S (proto/records.py).
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

from ...proto.errors import UserError
from ...proto.records import COLD_STEP_S, COLD_WAITS, wait_bound
from .base import (
    Agreement,
    Capabilities,
    CollectiveError,
    Epochs,
    Rider,
    rank_order_sum_rows,
    read_slots,
    ride_slots,
)
from .specs import MlxSpec

logger = logging.getLogger(__name__)

EXIT_STALLED = 75  # exit status of a node whose all-reduce outlasted the timeout


MLX_BACKENDS_CHOSEN = ("auto", "ring")  # cluster.yaml's `mlx_backend`, bench --mlx-backend


def mlx_backend(gpus: bool, choice: str = "auto") -> str:
    """The `mx.distributed` backend for nodes on this machine: NCCL where each node has its own CUDA
    GPU and MLX's CUDA build offers it (GPU to GPU, no host copy), else the ring over TCP; or the
    ring where `choice` says so (cluster.yaml's `mlx_backend: ring`: the host-mediated path, to
    compare the envoy with)."""
    if choice not in MLX_BACKENDS_CHOSEN:
        raise UserError(
            f"mlx_backend must be one of {', '.join(MLX_BACKENDS_CHOSEN)} (got {choice!r})"
        )
    if choice == "ring":
        return "ring"
    cuda = getattr(mx, "cuda", None)
    return (
        "nccl"
        if gpus and cuda is not None and cuda.is_available() and mx.distributed.is_available("nccl")
        else "ring"
    )


def write_hostfile(spec: MlxSpec, folder: str | Path) -> dict[str, str]:
    """Write what the backend reads into `folder`; returns the environment variables to set."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if spec.backend == "ring":
        path = folder / "mlx-ring-hosts.json"
        path.write_text(json.dumps([list(h) for h in spec.hosts]))
        return {"MLX_HOSTFILE": str(path)}
    if spec.backend == "nccl":  # no file: every rank meets at rank 0's first address
        host, _, port = spec.hosts[0][0].rpartition(":")
        return {"MLX_WORLD_SIZE": str(spec.world_size), "NCCL_HOST_IP": host, "NCCL_PORT": port}
    path = folder / "mlx-jaccl-devices.json"
    path.write_text(json.dumps([list(row) for row in spec.jaccl_devices]))
    return {"MLX_IBV_DEVICES": str(path), "MLX_JACCL_COORDINATOR": spec.jaccl_coordinator}


class _Watchdog:
    """Ends the process if one wait on the peers outlasts the timeout (no way to interrupt MLX)."""

    def __init__(self, rank: int, timeout_s: float, cold_s: float = COLD_STEP_S):
        self._rank = rank
        self._timeout = timeout_s
        self._cold_s = cold_s
        self._done = 0  # waits completed
        self._since: float | None = None
        self._limit = timeout_s
        self._what = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="mlx-collective-watchdog", daemon=True
        )
        self._thread.start()

    def enter(self, what: str, cold: bool = False) -> None:
        self._what = what
        # a node's first COLD_WAITS waits, and those its caller marks cold, may build kernels
        self._limit = wait_bound(self._timeout, cold or self._done < COLD_WAITS, self._cold_s)
        self._since = time.monotonic()

    def leave(self) -> None:
        if self._since is not None:
            self._done += 1
        self._since = None

    def _run(self) -> None:
        period = min(max(self._timeout / 20, 0.05), 1.0)  # seconds
        while not self._stop.wait(period):
            since, limit = self._since, self._limit
            if since is not None and time.monotonic() - since > limit:
                first = " (one that may build kernels)" if limit > self._timeout else ""
                msg = (
                    f"rank {self._rank}: {self._what}{first} did not complete within {limit:g} s "
                    f"(a peer stalled or the network is down); the MLX group cannot recover, exiting"
                )
                logger.critical("%s", msg)
                print(f"moe-cluster node: {msg}", file=sys.stderr, flush=True)
                os._exit(EXIT_STALLED)

    def close(self) -> None:
        self._stop.set()


class MlxCollective(Epochs):
    """The Collective of `transport: mlx`."""

    caps = Capabilities(in_graph=True)  # the MoE layer hands all_reduce the lazy partial
    # the world size at which the all-reduce is the backend's own all_sum (_summed): two ranks,
    # where it is the rank-order sum's bytes, and over NCCL, where it costs less than the
    # all_gather (in a graph, 42 against 77 µs a layer); the ring's all_sum took longer than its
    # all_gather and the local sum on a 2-vCPU CPU (150-226 against 77-133 µs, hidden 1024), so
    # the ring keeps the all_gather
    SUMMED_AT = 2

    def __init__(self, spec: MlxSpec, rank: int):
        if not mx.distributed.is_available(spec.backend):
            raise CollectiveError(
                f"mx.distributed backend {spec.backend!r} is not available in this MLX build "
                f"(jaccl needs macOS 26.2+ with Thunderbolt 5 RDMA, nccl MLX's CUDA build)"
            )
        self.rank = rank
        self.world_size = spec.world_size
        self.SUMMED_AT = 2 if spec.backend == "nccl" else 0
        self._scatters = spec.backend == "nccl"  # the backend has a reduce-scatter (sum_scatter)
        self._tmp = None
        self._watchdog = None
        self._rider = Rider(rank, spec.world_size)
        self._last: mx.array | None = None  # the latest all-gather: the next one goes after it
        if (
            spec.world_size == 1
        ):  # a ring of one cannot form (it dials itself); the sum is the partial
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
            raise CollectiveError(
                f"rank {rank}: mx.distributed {spec.backend} init failed: {exc}"
            ) from exc
        if self.group.size() != spec.world_size or self.group.rank() != rank:
            raise CollectiveError(
                f"mx.distributed made rank {self.group.rank()} of {self.group.size()}, "
                f"expected rank {rank} of {spec.world_size}"
            )
        self._watchdog = _Watchdog(rank, spec.timeout_s)
        logger.info(
            "rank %s joined mx.distributed %s group of %s", rank, spec.backend, spec.world_size
        )

    def begin(self, request_id: str) -> None:
        self._rider.clear()  # the ring has no per-request state; a failed request leaves the group unusable anyway

    def all_reduce(self, partial: mx.array, layer: int) -> mx.array:
        if self.group is None:
            return partial
        if self.world_size == self.SUMMED_AT:
            return self._summed(partial, layer)
        flat = self._after_last(partial.reshape(1, -1))
        ride = self._rider.take(layer)
        if ride is None:
            parts = self._all_gather(flat)  # (N, numel)
            self._last = parts
        else:
            nbytes = partial.nbytes
            extras = ride.reshape(-1).astype(mx.int32)
            payload = mx.concatenate([flat.reshape(-1).view(mx.uint8), extras.view(mx.uint8)])[None]
            gathered = self._all_gather(payload)  # (N, nbytes + 8) uint8
            self._last = gathered
            parts = gathered[:, :nbytes].view(partial.dtype)
            self._rider.carried(lambda: _agreement(gathered, nbytes))
        return rank_order_sum_rows(parts).reshape(partial.shape)

    def all_gather(self, rows: mx.array, counts: tuple[int, ...], layer: int) -> mx.array:
        """Every rank's rows in rank order (attention by stream), as one graph operation: each
        rank's padded to the largest count (the backend gathers equal shapes); the step's ride,
        if it waits, travels beside them as raw bytes."""
        if self.group is None:
            return rows
        width, most = rows.shape[-1], max(counts)
        flat = self._after_last(_padded(rows, most).reshape(1, -1))
        ride = self._rider.take(layer)
        if ride is None:
            parts = self._last = self._all_gather(flat)  # (N, most * width)
        else:
            nbytes = flat.nbytes
            extras = ride.reshape(-1).astype(mx.int32)
            payload = mx.concatenate([flat.reshape(-1).view(mx.uint8), extras.view(mx.uint8)])
            gathered = self._last = self._all_gather(payload[None])  # (N, nbytes + 4 n) uint8
            parts = gathered[:, :nbytes].view(rows.dtype)
            self._rider.carried(lambda: _agreement(gathered, nbytes))
        if all(n == most for n in counts):  # no padding: the rows are in rank order already
            return parts.reshape(-1, width)
        parts = parts.reshape(self.world_size, most, width)
        return mx.concatenate([parts[r, :n] for r, n in enumerate(counts)])

    def reduce_scatter(self, partial: mx.array, counts: tuple[int, ...], layer: int) -> mx.array:
        """This rank's rows of every rank's `partial`, summed in float32: NCCL's reduce-scatter
        over each rank's block of rows (padded to the largest count), else an all_gather of the
        partials and the rank-order sum of this rank's rows here."""
        if self.group is None:
            return partial
        width, n = partial.shape[-1], counts[self.rank]
        start = sum(counts[: self.rank])
        if self._scatters:
            most = max(counts)
            # each rank's block of rows, padded to the largest count; none to pad: `partial` itself
            x = partial if all(c == most for c in counts) else _blocks(partial, counts, most)
            x = self._after_last(x.astype(mx.float32))
            out = self._last = self._sum_scatter(x)  # (most, width)
            return out[:n].astype(partial.dtype)
        rows = partial.shape[0]
        gathered = self._last = self._all_gather(self._after_last(partial.reshape(1, -1)))
        mine = gathered.reshape(self.world_size, rows, width)[:, start : start + n]
        return rank_order_sum_rows(mine).reshape(n, width)

    def _after_last(self, x: mx.array) -> mx.array:
        if self._last is None:
            return x
        # the ranks' collectives pair up in the order each rank runs them: where a graph holds
        # independent ones (two micro-batches, node/overlap.py), MLX may run them in either
        # order, so each waits for the one this rank asked for before it
        return mx.depends(x, self._last)

    def _summed(self, partial: mx.array, layer: int) -> mx.array:
        """Two ranks: the backend's own sum of the float32 partials. One addition per element is
        the same bytes in either order, so this is the rank-order sum of the other path, at about
        half an all_gather's cost in a graph (NCCL, bfloat16 payloads: 42 against 77 µs a layer,
        the all_sum timed on float32 partials as here)."""
        flat = self._after_last(partial.reshape(-1).astype(mx.float32))
        n = flat.size
        ride = self._rider.take(layer)
        if ride is not None:  # the agreement in slots of its own: the sum shows every rank's
            flat = mx.concatenate([flat, ride_slots(self.rank, self.world_size, ride, mx.float32)])
        summed = self._all_sum(flat)
        self._last = summed
        if ride is None:
            return summed.astype(partial.dtype).reshape(partial.shape)
        # `summed` itself is read, as _agreement reads the gathered bytes: it is in the running
        # step's graph already, where a slice of it would queue behind the whole step
        self._rider.carried(lambda: read_slots(np.asarray(summed)[n:], self.world_size))
        return summed[:n].astype(partial.dtype).reshape(partial.shape)

    def _all_gather(self, x: mx.array) -> mx.array:
        return mx.distributed.all_gather(x, group=self.group)

    def _all_sum(self, x: mx.array) -> mx.array:
        return mx.distributed.all_sum(x, group=self.group)

    def _sum_scatter(self, x: mx.array) -> mx.array:
        return mx.distributed.sum_scatter(x, group=self.group)

    def ride(self, values: mx.array) -> None:
        self._rider.ride(values)

    def settle(self) -> Agreement | None:
        return self._rider.settle()

    def watch(self, what: str | None, cold: bool = False) -> None:
        if self._watchdog is None:
            return
        if what is None:
            self._watchdog.leave()
        else:
            self._watchdog.enter(what, cold)

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


class GraphOnly(MlxCollective):
    """`transport: mlx`'s all-reduce graph for `world_size` ranks without a group, as NCCL builds
    it: each all_gather is one Concatenate of this rank's part, each all_sum (two ranks) one
    Multiply, standing in for the collective's one primitive, the rest is MlxCollective's own
    (node/moe/opcount.py counts it). Evaluated, it sums `world_size` copies of this rank's
    partial: only its graph means anything."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self._scatters = False
        self._tmp = self._watchdog = None
        self._rider = Rider(rank, world_size)
        self._last = None
        self.group = self  # all_reduce gathers: a group of one would return the partial

    def _all_gather(self, x: mx.array) -> mx.array:
        return mx.concatenate([x] * self.world_size)

    def _all_sum(self, x: mx.array) -> mx.array:
        return x * self.world_size  # one primitive, as the backend's all_sum


def _padded(rows: mx.array, most: int) -> mx.array:
    """`rows` with zero rows after them up to `most` (the backend gathers equal shapes)."""
    if rows.shape[0] == most:
        return rows
    return mx.concatenate([rows, mx.zeros((most - rows.shape[0], rows.shape[-1]), rows.dtype)])


def _blocks(rows: mx.array, counts: tuple[int, ...], most: int) -> mx.array:
    """Each rank's `counts[r]` consecutive rows of `rows`, padded to `most` rows."""
    starts = [sum(counts[:r]) for r in range(len(counts))]
    return mx.concatenate([_padded(rows[a : a + c], most) for a, c in zip(starts, counts)])


def _agreement(gathered: mx.array, nbytes: int) -> Agreement:
    """Read every rank's ride values from the bytes after its partial in `gathered`.

    `gathered` itself, not a slice of it, is read: it is part of the step's graph already running
    (async_eval), so this waits only for the first MoE layer; a new slice op would queue behind the
    whole step."""
    extras = np.ascontiguousarray(np.asarray(gathered)[:, nbytes:]).view(np.int32)  # (N, n)
    return Agreement(tuple(tuple(int(v) for v in row) for row in extras))

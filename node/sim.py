"""One node process of `moe-cluster simulate`: load shards, generate in lock-step, report."""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass

from ..proto.errors import ErrorKind, kind_of
from ..proto.records import Sampling
from .device import release_memory


@dataclass(frozen=True)
class SimTask:
    """One model to load and one request to run on it (picklable)."""

    model: str
    prompt: tuple[int, ...]
    sampling: Sampling
    placement_json: dict | None = None
    keepalive: str = "lru"
    eos_token_ids: tuple[int, ...] = ()
    record_logits: bool = False
    repeats: int = 1  # run the request this many times and report the last (benchmarks)
    expert_cache: str = "off"  # placement.expert_cache: off | SIZE | PCT%
    profile: dict | None = None  # {MoE layer: (selections per expert, tokens)} of a routing profile
    prefetch: int | None = None  # expert cache read-ahead per layer (node.moe.load.load_shard); None: auto


@dataclass(frozen=True)
class SimJob:
    """Everything one simulated node needs: its rank, how to reach the others, its tasks."""

    rank: int
    world_size: int
    collective: object  # a transport spec (node.transports: ShmSpec, EnvoySpec or MlxSpec)
    tasks: tuple[SimTask, ...]


def run(job: SimJob, results) -> None:
    """Process entry point: puts one dict per task on `results` ("error" and its "kind" set if one failed)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        collective = _collective(job)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent as a value
        results.put(_error(job.rank, 0, exc))
        return
    try:
        for i, task in enumerate(job.tasks):
            try:
                release_memory()  # the previous task's model, before this one loads and is measured
                results.put(_run(job, i, task, collective))
            except BaseException as exc:  # noqa: BLE001
                results.put(_error(job.rank, i, exc))
                return
    finally:
        collective.close()


def _error(rank: int, task: int, exc: BaseException) -> dict:
    """The failure as a value: its kind (an ErrorKind's value) decides how the parent re-raises it."""
    kind = kind_of(exc)
    message = str(exc) if kind is not ErrorKind.INTERNAL else f"{type(exc).__name__}: {exc}"
    return {"rank": rank, "task": task, "kind": kind.value, "error": message, "traceback": traceback.format_exc()}


def _collective(job: SimJob):
    from .collective.specs import make_collective

    return make_collective(job.collective, job.rank)


def _run(job: SimJob, index: int, task: SimTask, collective) -> dict:
    import mlx.core as mx

    from ..proto.placement import Placement
    from .runtime import GenerateResult, NodeRuntime
    from ..proto.records import GenerateRequest
    from .moe.load import load_shard

    placement = Placement.from_json(task.placement_json, job.world_size) if task.placement_json else None
    sharded = load_shard(task.model, placement, job.rank, keepalive=task.keepalive, collective=collective,
                         expert_cache=task.expert_cache, profile=task.profile, prefetch=task.prefetch)
    runtime = NodeRuntime(sharded)
    result, wall = None, 0.0
    for i in range(task.repeats):
        sharded.state.reset_counters()
        sharded.state.timers.reset()
        result = GenerateResult()
        req = GenerateRequest(f"sim-{index}-{i}", task.prompt, task.sampling, task.eos_token_ids,
                              record_logits=task.record_logits and job.rank == 0)
        t0 = time.perf_counter()
        for n, _ in enumerate(runtime.generate(req, result=result)):
            if n == 0:  # from here on timers, counters and the peak cover decode steps only, like generation_seconds
                sharded.state.timers.reset()
                sharded.state.reset_counters()
                mx.reset_peak_memory()
        wall = time.perf_counter() - t0
    info = sharded.info
    return {
        "rank": job.rank,
        "task": index,
        "tokens": result.tokens,
        "logits": result.logits if job.rank == 0 else None,
        "experts_per_layer": {str(k): v for k, v in info.experts_per_layer.items()},
        "resident_weight_bytes": info.resident_weight_bytes,
        "replicated_bytes": info.replicated_bytes,
        "expert_bytes": info.expert_bytes,
        "peak_memory_bytes": info.peak_memory_bytes,
        "active_memory_bytes": info.active_memory_bytes,
        "load_seconds": info.load_seconds,
        "counters": sharded.state.means(),  # folds the device-side counts first
        "layer_counters": {str(layer): vars(c) for layer, c in sharded.state.counters.items()},
        "prompt_tps": result.stats.prompt_tps,
        "generation_tps": result.stats.generation_tps,
        "generated": result.stats.generated,
        "generation_seconds": result.stats.generation_seconds,
        "wall_seconds": wall,
        "timers": vars(sharded.state.timers),
        # MLX's peak over the last run's decode steps: weights, KV cache and activations (an expert
        # read waiting for its slot is host memory outside MLX: expert_cache.staged_peak_bytes)
        "peak_memory_decode_bytes": int(mx.get_peak_memory()),
        "expert_cache": sharded.state.cache_totals(),  # decode steps only, like the counters
    }

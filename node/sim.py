"""One node process of `moe-cluster simulate`: load a shard, generate in lock-step, report."""

from __future__ import annotations

import os
import resource
import sys
import time
import traceback
from dataclasses import dataclass

from .engine import Sampling


@dataclass(frozen=True)
class SimJob:
    """Everything a simulated node needs (picklable)."""

    model: str
    rank: int
    world_size: int
    placement_json: dict | None
    keepalive: str
    prompt: tuple[int, ...]
    sampling: Sampling
    eos_token_ids: tuple[int, ...]
    record_logits: bool
    shm: object  # collective.ShmSpec
    repeats: int = 1  # run the request this many times (benchmarks keep the last)


def _rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def run(job: SimJob, results) -> None:
    """Process entry point: puts one dict on `results` (with "error" if anything failed)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        results.put(_run(job))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent as a value
        results.put({"rank": job.rank, "error": f"{type(exc).__name__}: {exc}",
                     "traceback": traceback.format_exc()})


def _run(job: SimJob) -> dict:
    import mlx.core as mx

    from .collective import ShmCollective
    from .placement import Placement
    from .runtime import GenerateRequest, GenerateResult, NodeRuntime
    from .shard import load_shard

    collective = ShmCollective(job.shm, job.rank)
    placement = Placement.from_json(job.placement_json, job.world_size) if job.placement_json else None
    rss_before = _rss_bytes()
    sharded = load_shard(job.model, placement, job.rank, keepalive=job.keepalive, collective=collective)
    rss_load = _rss_bytes()
    runtime = NodeRuntime(sharded)
    result = None
    for i in range(job.repeats):
        sharded.state.reset_counters()
        sharded.state.timers.reset()
        result = GenerateResult()
        req = GenerateRequest(f"sim-{i}", job.prompt, job.sampling, job.eos_token_ids,
                              record_logits=job.record_logits and job.rank == 0)
        t0 = time.perf_counter()
        for n, _ in enumerate(runtime.generate(req, result=result)):
            if n == 0:  # from here on the timers cover decode steps only, like generation_seconds
                sharded.state.timers.reset()
        wall = time.perf_counter() - t0
    info = sharded.info
    timers = sharded.state.timers
    counters = {str(layer): vars(c) for layer, c in sharded.state.counters.items()}
    collective.close()
    return {
        "rank": job.rank,
        "tokens": result.tokens,
        "logits": result.logits if job.rank == 0 else None,
        "experts_per_layer": {str(k): v for k, v in info.experts_per_layer.items()},
        "resident_weight_bytes": info.resident_weight_bytes,
        "replicated_bytes": info.replicated_bytes,
        "expert_bytes": info.expert_bytes,
        "peak_memory_bytes": info.peak_memory_bytes,
        "rss_load_delta_bytes": max(rss_load - rss_before, 0),
        "load_seconds": info.load_seconds,
        "counters": sharded.state.means(),
        "layer_counters": counters,
        "prompt_tps": result.stats.prompt_tps,
        "generation_tps": result.stats.generation_tps,
        "generation_seconds": result.stats.generation_seconds,
        "wall_seconds": wall,
        "timers": vars(timers),
        "peak_memory_run_bytes": int(mx.get_peak_memory()),
    }

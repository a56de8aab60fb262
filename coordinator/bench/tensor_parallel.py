"""mlx-lm's own distributed decode on the same checkpoint: the peers `bench decode` and `bench race`
measure beside ours.

Tensor parallelism (`model.shard(group)`: every expert and every attention head split across the N
processes, which all-sum twice per layer, as exo runs it on Thunderbolt) or pipeline parallelism
(`model.model.pipeline(group)`: layers split across the processes, the hidden state sent from one to
the next, as exo runs it on Ethernet), under `mx.distributed` (NCCL where MLX's CUDA build offers
it, one GPU per process; else the ring over TCP). Each process runs `stream_generate` on the same
prompt; rank 0 reports its median generation speed over the rounds, its time to first token and,
with `streams`, mlx-lm's `BatchGenerator` on B prompts at once (every token's time).

The model is loaded as `mlx_lm.utils.sharded_load` loads it (lazy model, shard or pipeline, then
the weights), with one change: its closing barrier runs on the default stream, not the CPU stream
that MLX's NCCL backend refuses ("There is no Stream(gpu, 1) in current thread"), so NCCL is
compared with NCCL. Pipeline loading reads the whole checkpoint folder lazily, so it needs no
`model.safetensors.index.json`.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import statistics
import tempfile
import time
from pathlib import Path

from ...common import importcache
from ...common.ports import free_ports
from ...node.cores import pin, usable

MODES = {"tensor": "mlx_lm_tensor_parallel", "pipeline": "mlx_lm_pipeline"}


def supports(model_path: str, mode: str = "tensor") -> str | None:
    """None if mlx-lm can split this family across a tensor (or pipeline) group, else why not."""
    from ...node.checkpoint import Checkpoint, model_classes

    ckpt = Checkpoint.open(model_path)
    model_cls, args_cls = model_classes(ckpt.config, ckpt.path / "config.json")
    model_type = ckpt.config.get("model_type")
    if mode == "tensor" and not hasattr(model_cls, "shard"):
        return f"mlx-lm has no tensor-parallel path for model_type {model_type!r}"
    if mode == "pipeline":
        import importlib

        module = importlib.import_module(model_cls.__module__)
        inner = [
            c
            for c in vars(module).values()
            if isinstance(c, type) and hasattr(c, "pipeline") and c.__module__ == module.__name__
        ]
        if not inner:
            return f"mlx-lm has no pipeline path for model_type {model_type!r} (its model has no pipeline())"
    return None


def _load(path: str, mode: str, group):
    """`sharded_load`'s steps on a local folder, its barrier on the default stream (see above)."""
    import mlx.core as mx
    from mlx_lm.utils import load_model, load_tokenizer

    model, config = load_model(Path(path), lazy=True, strict=False)
    tokenizer = load_tokenizer(
        Path(path), {"trust_remote_code": True}, eos_token_ids=config.get("eos_token_id")
    )
    if mode == "tensor":
        model.shard(group)
    else:
        model.model.pipeline(group)
    mx.eval(model.parameters())
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group))
    return model, tokenizer


def _batch(model, prompts: list[list[int]], max_tokens: int, eos: tuple[int, ...] = ()) -> dict:
    """B prompts at once through mlx-lm's BatchGenerator (greedy, stopping at `eos` as
    stream_generate does): each stream's tokens and the perf_counter time each arrived, from t0
    (when they were inserted)."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(
        model,
        max_tokens=max_tokens,
        stop_tokens=[[t] for t in eos] or None,
        completion_batch_size=len(prompts),
        prefill_batch_size=len(prompts),
    )
    try:
        t0 = time.perf_counter()
        uids = gen.insert(prompts, [max_tokens] * len(prompts))
        tokens = {u: [] for u in uids}
        times = {u: [] for u in uids}
        while responses := gen.next_generated():
            now = time.perf_counter()
            for r in responses:
                if r.finish_reason != "stop":
                    tokens[r.uid].append(r.token)
                    times[r.uid].append(now)
    finally:
        gen.close()
    return {"t0": t0, "tokens": [tokens[u] for u in uids], "times": [times[u] for u in uids]}


def _barrier(group) -> None:
    """Every rank here before any goes on. BatchGenerator evaluates the step after the last one
    ahead of time; a rank that ends (or exits) first leaves the others' step without its peer."""
    import mlx.core as mx

    mx.synchronize()
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group))


def _worker(
    path: str,
    rank: int,
    hostfile: str,
    ids: list[int],
    max_tokens: int,
    rounds: int,
    out,
    env: dict,
    gpu: int | None,
    backend: str,
    mode: str = "tensor",
    streams: tuple[tuple[tuple[int, ...], ...], ...] = (),
    cores: tuple[int, ...] | None = None,
) -> None:
    os.environ.update(env, MLX_HOSTFILE=hostfile, MLX_RANK=str(rank))
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    importcache.install()  # a spawned worker imports mlx-lm, and with it transformers, afresh
    pin(cores)  # as ours' nodes are (node/cores.py), before MLX starts its threads
    try:
        import mlx.core as mx
        from mlx_lm.generate import stream_generate

        group = mx.distributed.init(backend=backend, strict=True)
        model, tokenizer = _load(path, mode, group)
        speeds, tokens, times, t0 = [], [], [], 0.0
        for i in range(rounds + 1):  # the first round warms up
            last, toks, stamps = None, [], []
            start = time.perf_counter()
            for last in stream_generate(model, tokenizer, ids, max_tokens=max_tokens):
                toks.append(last.token)
                stamps.append(time.perf_counter())
            if i:
                speeds.append(last.generation_tps)
                tokens, times, t0 = toks, stamps, start
        batches = []
        for prompts in streams:
            _batch(
                model, [list(p) for p in prompts], min(max_tokens, 4)
            )  # warms up this batch's shapes
            _barrier(group)
            eos = tuple(sorted(tokenizer.eos_token_ids or ()))
            batches.append(_batch(model, [list(p) for p in prompts], max_tokens, eos))
            _barrier(group)
        out.put(
            {
                "rank": rank,
                "cores": usable(),
                "tps": statistics.median(speeds),
                "tokens": tokens,
                "t0": t0,
                "times": times,
                "streams": batches,
            }
        )
    except BaseException as exc:  # noqa: BLE001 - reported to the parent as a value
        import traceback

        # where it failed, inside mlx-lm or MLX (on CUDA: "There is no Stream(gpu, 1) in current thread")
        where = " <- ".join(
            f"{Path(f.filename).name}:{f.lineno} {f.name}"
            for f in reversed(traceback.extract_tb(exc.__traceback__)[-3:])
        )
        out.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}", "where": where})


def measure(
    model_path: str,
    nodes: int,
    ids: list[int],
    max_tokens: int,
    rounds: int,
    timeout_s: float = 300.0,
    gpus: bool = False,
    backend: str | None = None,
    mode: str = "tensor",
    streams: tuple[tuple[tuple[int, ...], ...], ...] = (),
    cores: list[tuple[int, ...]] | None = None,
) -> dict:
    """{"name", "nodes", "backend", "tps", "tokens", "t0", "times", "streams"} of rank 0, or
    {"name", "nodes", "error", "where"}. `gpus`: process r on GPU r; `backend`: mx.distributed's, by
    default NCCL where MLX's CUDA build has it, else the ring over TCP. NCCL that fails falls back
    to the ring, its error kept as "nccl_error". `mode`: tensor or pipeline; `streams`: prompt sets
    to run through BatchGenerator after the single-prompt rounds (one entry each in "streams").
    `cores`: rank r's threads on cores[r] (node/cores.py); "cores" answers where each rank ran."""
    why = supports(model_path, mode)
    if why:
        return {"name": MODES[mode], "nodes": nodes, "error": why}
    peer = {"mode": mode, "streams": streams, "cores": cores}
    if backend is None:
        from ...node.collective.mlx import mlx_backend

        if mlx_backend(gpus=True) == "nccl":
            first = _measure(
                model_path, nodes, ids, max_tokens, rounds, timeout_s, gpus, "nccl", **peer
            )
            if "error" not in first:
                return first
            return {
                **_measure(
                    model_path, nodes, ids, max_tokens, rounds, timeout_s, gpus, "ring", **peer
                ),
                "nccl_error": first["error"],
                "nccl_where": first.get("where", ""),
            }
        backend = "ring"
    return _measure(model_path, nodes, ids, max_tokens, rounds, timeout_s, gpus, backend, **peer)


def _measure(
    model_path: str,
    nodes: int,
    ids: list[int],
    max_tokens: int,
    rounds: int,
    timeout_s: float,
    gpus: bool,
    backend: str,
    mode: str = "tensor",
    streams: tuple = (),
    cores: list[tuple[int, ...]] | None = None,
) -> dict:
    entry = {"name": MODES[mode], "nodes": nodes, "backend": backend}
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        hostfile = os.path.join(tmp, "hosts.json")
        with open(hostfile, "w") as f:
            json.dump([[f"127.0.0.1:{p}"] for p in free_ports(nodes)], f)
        ports = free_ports(1)  # NCCL's rendezvous on rank 0 (the ring uses the hostfile)
        env = {
            "MLX_WORLD_SIZE": str(nodes),
            "NCCL_HOST_IP": "127.0.0.1",
            "NCCL_PORT": str(ports[0]),
        }
        procs = [
            ctx.Process(
                target=_worker,
                args=(
                    model_path,
                    r,
                    hostfile,
                    ids,
                    max_tokens,
                    rounds,
                    out,
                    env,
                    r if gpus else None,
                    backend,
                    mode,
                    streams,
                    cores[r] if cores else None,
                ),
            )
            for r in range(nodes)
        ]
        for p in procs:
            p.start()
        reports = {}
        wait = timeout_s
        try:
            while len(reports) < nodes:
                rep = out.get(timeout=wait)
                reports[rep["rank"]] = rep
                if "error" in rep:
                    wait = 10.0  # the others may report the cause; do not wait out the timeout for them
        except queue.Empty:
            if not any("error" in r for r in reports.values()):
                return {
                    **entry,
                    "error": f"no answer from {nodes - len(reports)} of {nodes} processes in {timeout_s:g} s",
                }
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    failed = sorted((r for r in reports.values() if "error" in r), key=lambda r: r["rank"])
    if failed:
        return {
            **entry,
            "error": "; ".join(f"rank {r['rank']}: {r['error']}" for r in failed),
            "where": "; ".join(f"rank {r['rank']}: {r.get('where', '')}" for r in failed),
        }
    r0 = reports[0]
    return {
        **entry,
        **{k: r0[k] for k in ("tps", "tokens", "t0", "times", "streams")},
        "cores": [reports[r]["cores"] for r in range(nodes)],
    }

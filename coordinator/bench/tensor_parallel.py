"""mlx-lm's own distributed decode on the same checkpoint: the peer `bench decode` measures beside ours.

`mlx_lm.utils.sharded_load` with a tensor-parallel group under `mx.distributed` (NCCL where MLX's
CUDA build offers it, one GPU per process; else the ring over TCP), as exo uses it: every expert (and every attention head) is split across the N processes, which
all-sum twice per layer. Each process runs `stream_generate` on the same prompt; rank 0 reports its
median generation speed over the rounds.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import statistics
import tempfile
from pathlib import Path

from ...node.collective.specs import free_ports


def supports(model_path: str) -> str | None:
    """None if mlx-lm can split this family across a tensor group, else why not."""
    from ...node.checkpoint import Checkpoint, model_classes

    ckpt = Checkpoint.open(model_path)
    model_cls, _ = model_classes(ckpt.config, ckpt.path / "config.json")
    if not hasattr(model_cls, "shard"):
        return f"mlx-lm has no tensor-parallel path for model_type {ckpt.config.get('model_type')!r}"
    return None


def _worker(path: str, rank: int, hostfile: str, ids: list[int], max_tokens: int, rounds: int, out,
            env: dict, gpu: int | None, backend: str) -> None:
    os.environ.update(env, MLX_HOSTFILE=hostfile, MLX_RANK=str(rank))
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    try:
        import mlx.core as mx
        from mlx_lm.generate import stream_generate
        from mlx_lm.utils import sharded_load

        group = mx.distributed.init(backend=backend, strict=True)
        model, tokenizer = sharded_load(path, tensor_group=group)
        speeds, tokens = [], []
        for i in range(rounds + 1):  # the first round warms up
            last, toks = None, []
            for last in stream_generate(model, tokenizer, ids, max_tokens=max_tokens):
                toks.append(last.token)
            if i:
                speeds.append(last.generation_tps)
                tokens = toks
        out.put({"rank": rank, "tps": statistics.median(speeds), "tokens": tokens})
    except BaseException as exc:  # noqa: BLE001 - reported to the parent as a value
        import traceback

        # where it failed, inside mlx-lm or MLX (run 5 on CUDA: "There is no Stream(gpu, 1) in current thread")
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}"
                            for f in reversed(traceback.extract_tb(exc.__traceback__)[-3:]))
        out.put({"rank": rank, "error": f"{type(exc).__name__}: {exc}", "where": where})


def measure(model_path: str, nodes: int, ids: list[int], max_tokens: int, rounds: int,
            timeout_s: float = 300.0, gpus: bool = False, backend: str | None = None) -> dict:
    """{"name", "nodes", "backend", "tps", "tokens"} of rank 0, or {"name", "nodes", "error", "where"}.
    `gpus`: process r on GPU r; `backend`: mx.distributed's, by default NCCL where MLX's CUDA build
    has it, else the ring over TCP. NCCL that fails falls back to the ring, its error kept as
    "nccl_error": mlx-lm's `sharded_load` ends with an all_sum on the CPU stream, which MLX 0.32.4's
    NCCL backend refuses ("There is no Stream(gpu, 1) in current thread", GPU run 8)."""
    why = supports(model_path)
    if why:
        return {"name": "mlx_lm_tensor_parallel", "nodes": nodes, "error": why}
    if backend is None:
        from ...node.collective.mlx import mlx_backend

        if mlx_backend(gpus=True) == "nccl":
            first = _measure(model_path, nodes, ids, max_tokens, rounds, timeout_s, gpus, "nccl")
            if "error" not in first:
                return first
            return {**_measure(model_path, nodes, ids, max_tokens, rounds, timeout_s, gpus, "ring"),
                    "nccl_error": first["error"], "nccl_where": first.get("where", "")}
        backend = "ring"
    return _measure(model_path, nodes, ids, max_tokens, rounds, timeout_s, gpus, backend)


def _measure(model_path: str, nodes: int, ids: list[int], max_tokens: int, rounds: int, timeout_s: float,
             gpus: bool, backend: str) -> dict:
    entry = {"name": "mlx_lm_tensor_parallel", "nodes": nodes, "backend": backend}
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        hostfile = os.path.join(tmp, "hosts.json")
        import json

        with open(hostfile, "w") as f:
            json.dump([[f"127.0.0.1:{p}"] for p in free_ports(nodes)], f)
        ports = free_ports(1)  # NCCL's rendezvous on rank 0 (the ring uses the hostfile)
        env = {"MLX_WORLD_SIZE": str(nodes), "NCCL_HOST_IP": "127.0.0.1", "NCCL_PORT": str(ports[0])}
        procs = [ctx.Process(target=_worker, args=(model_path, r, hostfile, ids, max_tokens, rounds, out, env,
                                                   r if gpus else None, backend))
                 for r in range(nodes)]
        for p in procs:
            p.start()
        reports = {}
        try:
            while len(reports) < nodes:
                rep = out.get(timeout=timeout_s)
                reports[rep["rank"]] = rep
        except queue.Empty:
            return {**entry, "error": f"no answer from {nodes - len(reports)} of {nodes} processes in {timeout_s:g} s"}
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
    failed = [r for r in reports.values() if "error" in r]
    if failed:
        return {**entry, "error": f"rank {failed[0]['rank']}: {failed[0]['error']}", "where": failed[0].get("where", "")}
    return {**entry, "tps": reports[0]["tps"], "tokens": reports[0]["tokens"]}

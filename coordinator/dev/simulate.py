"""`moe-cluster simulate`: run N node processes of a sharded model on this machine.

The nodes exchange data only through the collective interface (shared memory here), each in its
own process so each node's memory is measured on its own. `--check` adds stock mlx-lm's tokens and
logits on the same checkpoint.
"""

from __future__ import annotations

import json
import math
import queue
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...node.checkpoint import Checkpoint, check_runnable, resolve_model_path
from ...node.collective.base import CollectiveError
from ...proto.errors import ErrorKind, MoeClusterError, UserError, error_for
from ...proto.expert_cache import ExpertCacheSpec
from ...proto.records import COLD_STEP_S, Sampling
from ...proto.placement import Placement
from ...node import prefork
from ...node.sim import TICK, SimJob, SimTask

SIM_RUN = f"{SimJob.__module__}:run"  # a node process's entry point (node/prefork.py)

# Bytes one all-reduce may carry: a prefill chunk of this many tokens of float32 hidden states.
_MAX_TOKENS_PER_CALL = 2048


@dataclass(frozen=True)
class SimRequest:
    model: str
    nodes: int
    prompt: str
    sampling: Sampling
    keepalive: str = "lru"
    placement: Path | None = None
    check: bool = False
    repeats: int = 1
    timeout_s: float = 60.0
    transport: str = "shm"  # shm | envoy | mlx
    expert_cache: str = "off"  # experts each node keeps resident (proto.expert_cache)
    profile: Path | None = None  # routing profile: the hottest experts start resident
    speculative: str = "off"  # node/speculate.py MODES
    draft_tokens: int = 4
    prediction: str = ""  # the output expected: drafts for speculation
    draft_model: str = ""  # speculative "draft": its checkpoint
    mtp_experts: str = "auto"  # speculative "mtp": its routed experts at N > 1


def _transport_spec(
    transport: str,
    nodes: int,
    slot: int,
    ctx,
    timeout_s: float,
    gpus: bool = False,
    mlx_backend_choice: str = "auto",
):
    """-> (spec every node gets, cleanup to run once the nodes are gone); loopback only."""
    from ...node.collective.specs import EnvoySpec, MlxSpec
    from ...common.ports import free_ports
    from ...node.collective.shm import ShmCollective, unlink_segment

    if transport == "shm":
        spec, shm = ShmCollective.create(nodes, slot, ctx, timeout_s=timeout_s)
        return spec, lambda: (shm.close(), unlink_segment(shm))
    if transport == "envoy":
        import secrets

        addresses = tuple(f"127.0.0.1:{p}" for p in free_ports(nodes))
        return EnvoySpec(addresses, secret=secrets.token_hex(16), timeout_s=timeout_s), lambda: None
    if transport == "mlx":
        from ...node.collective.mlx import mlx_backend

        return MlxSpec(
            tuple((f"127.0.0.1:{p}",) for p in free_ports(nodes)),
            backend=mlx_backend(gpus, mlx_backend_choice),
            timeout_s=timeout_s,
        ), lambda: None
    raise UserError(f"--transport must be shm, envoy or mlx (got {transport!r})")


def run_nodes(
    tasks: list[SimTask],
    nodes: int,
    *,
    timeout_s: float = 60.0,
    transport: str = "shm",
    gpus: bool = False,
    mlx_backend: str = "auto",
    cores: list[tuple[int, ...]] | None = None,
) -> list[list[dict]]:
    """Spawn the node processes, run every task on all of them, return reports[task][rank].

    Each node process loads each task's model in turn, so one spawn serves many checks.
    `transport` is how the nodes all-reduce: shm, envoy (an envoy child per node) or mlx.
    `gpus`: bind node r to GPU r (CUDA_VISIBLE_DEVICES, inherited by the spawned process).
    `mlx_backend`: with transport mlx, `ring` forces the ring where NCCL would be picked.
    `cores`: node r's threads on cores[r] (node/cores.py shares); None: wherever the OS puts them.
    """
    if nodes < 1:
        raise UserError(f"--nodes must be at least 1 (got {nodes})")
    from ...node.describe import describe

    ctx = prefork.context()
    # attention by stream gathers every node's rows into one call: up to `nodes` chunks
    hidden = max(describe(Checkpoint.open(t.model)).hidden for t in tasks)
    slot = _MAX_TOKENS_PER_CALL * hidden * 4 * nodes
    spec, cleanup = _transport_spec(transport, nodes, slot, ctx, timeout_s, gpus, mlx_backend)
    results = ctx.Queue()
    procs = []
    try:
        for rank in range(nodes):
            job = SimJob(rank, nodes, spec, tuple(tasks), cores[rank] if cores else None)
            procs.append(start_node(ctx, rank, (job, results), rank if gpus else None))
        reports = collect(results, procs, nodes * len(tasks), _phase_s(timeout_s))
        return [[reports[(t, r)] for r in range(nodes)] for t in range(len(tasks))]
    finally:
        stop_processes(procs)
        cleanup()


def start_node(ctx, rank: int, args: tuple, gpu: int | None, target: str = SIM_RUN):
    """Start node `rank`'s process, `target(*args)`, seeing only GPU `gpu` where not None."""
    with _visible_gpu(gpu):  # the environment the process takes (node/prefork.py)
        p = prefork.process(ctx, target, args, name=f"moe-node-{rank}", daemon=True)
        p.start()
    return p


def collect(results, procs, expected: int, phase_s: float) -> dict[tuple[int, int], dict]:
    """The nodes' reports by (task, rank), `expected` of them: a node's error is raised at once, a
    node process that died is named, and nodes that go `phase_s` without a beat (node.sim.Beats)
    or a report are taken for stuck."""
    reports: dict[tuple[int, int], dict] = {}
    deadline = time.monotonic() + phase_s
    last = "none yet"
    while len(reports) < expected:
        try:
            rep = results.get(timeout=min(1.0, phase_s))
        except queue.Empty:
            dead = [p for p in procs if not p.is_alive() and p.exitcode not in (0, None)]
            if dead:
                raise CollectiveError(
                    f"node process {dead[0].name} died (exit code {dead[0].exitcode})"
                ) from None
            if time.monotonic() > deadline:
                raise CollectiveError(
                    f"simulated nodes made no progress in {phase_s:g} s (the last: {last})"
                ) from None
            continue
        deadline = time.monotonic() + phase_s  # a beat or a report: the next phase gets its bound
        if "beat" in rep:
            if rep["beat"] != TICK:  # a step inside a phase: the last phase named stays
                last = f"rank {rep['rank']} task {rep['task']} {rep['beat']}"
            continue
        if "error" in rep:
            raise _node_error(rep)
        reports[(rep["task"], rep["rank"])] = rep
        last = f"rank {rep['rank']} task {rep['task']} reported"
    return reports


def _phase_s(timeout_s: float) -> float:
    """How long the nodes may go without a beat: a collective's timeout and two minutes (a load, a
    pass), and the cold bound the nodes give steps that build kernels (a first run on a CUDA host
    builds them for minutes, at load and in the first steps of each shape: proto/records.py)."""
    return timeout_s + 120 + COLD_STEP_S


def stop_processes(procs, grace_s: float = 5.0) -> None:
    """Wait for spawned processes to exit; terminate, then kill, those that do not."""
    for p in procs:
        p.join(timeout=grace_s)
        if p.is_alive():
            p.terminate()
            p.join(timeout=grace_s)
        if p.is_alive():
            p.kill()
            p.join(timeout=grace_s)


@contextmanager
def _visible_gpu(gpu: int | None):
    """While a node process is spawned, let it see only GPU `gpu` (no-op for None)."""
    import os

    if gpu is None:
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def _node_error(rep: dict) -> MoeClusterError:
    """A node's failure, re-raised here as the typed error of its kind; its traceback is a note (shown with -v)."""
    exc = error_for(ErrorKind(rep["kind"]), f"node {rep['rank']}: {rep['error']}")
    if rep.get("traceback"):
        exc.add_note(f"node {rep['rank']}'s traceback:\n{rep['traceback'].rstrip()}")
    return exc


def reference(
    model: str, prompt_ids: list[int], sampling: Sampling, eos: tuple[int, ...]
) -> tuple[list[int], list]:
    """Stock mlx-lm on the same checkpoint: its tokens and per-step logits."""
    from mlx_lm.utils import load_model

    from ...node.engine import generate_tokens

    ref_model, _ = load_model(Checkpoint.open(model).path)
    logits: list = []
    with _half_gather_mm():
        tokens = list(
            generate_tokens(ref_model, prompt_ids, sampling, eos_token_ids=eos, logits_sink=logits)
        )
    return tokens, logits


@contextmanager
def _half_gather_mm():
    """MLX's CPU backend has no bfloat16/float16 `gather_mm`, so stock mlx-lm cannot run such
    experts here. While the reference runs, supply it the way the GPU kernels compute it:
    accumulate in float32, round the result to the input dtype. Everything else is stock."""
    import mlx.core as mx

    original = mx.gather_mm
    if mx.default_device().type != mx.DeviceType.cpu:
        yield
        return

    def gather_mm(a, b, *args, **kwargs):
        if a.dtype in (mx.bfloat16, mx.float16):
            return original(a.astype(mx.float32), b.astype(mx.float32), *args, **kwargs).astype(
                a.dtype
            )
        return original(a, b, *args, **kwargs)

    mx.gather_mm = gather_mm
    try:
        yield
    finally:
        mx.gather_mm = original


def compare(tokens: list[int], logits: list, ref_tokens: list[int], ref_logits: list) -> dict:
    """Max |Δlogit| over the steps both runs share, and the first token that differs.

    Every generated token must come with the logits it was sampled from (a run may record one row
    more: the step whose token was EOS). A side without them, or a run with no step to compare,
    gives an infinite difference, so no bound passes on nothing compared."""
    n = 0
    while n < min(len(tokens), len(ref_tokens)) and tokens[n] == ref_tokens[n]:
        n += 1
    steps = min(n + 1, len(logits), len(ref_logits))
    recorded = len(logits) >= len(tokens) and len(ref_logits) >= len(ref_tokens)
    diff = max(
        (float(np.max(np.abs(logits[i] - ref_logits[i]))) for i in range(steps)), default=math.inf
    )
    if not recorded:
        diff = math.inf
    out = {
        "reference_tokens": ref_tokens,
        "max_abs_logit_diff": diff,
        "tokens_match": tokens == ref_tokens,
        "compared_steps": steps if recorded else 0,
    }
    if tokens != ref_tokens and n < min(len(logits), len(ref_logits)):
        ref = ref_logits[n]
        top2 = np.sort(ref)[-2:]
        out["first_difference"] = {
            "step": n,
            "token": tokens[n] if n < len(tokens) else None,
            "reference_token": ref_tokens[n] if n < len(ref_tokens) else None,
            # how close the reference's top two were: a near-tie if small
            "reference_top2_gap": float(top2[1] - top2[0]),
            "our_gap_between_the_two": float(logits[n][tokens[n]] - logits[n][ref_tokens[n]])
            if n < len(tokens) and n < len(ref_tokens)
            else None,
        }
    return out


def checked_placement(path: str | Path, nodes: int, desc) -> Placement:
    """A placement file for `nodes` node processes, checked against the model (`desc`:
    node.describe's), so that a bad one is refused before any process starts."""
    placement = Placement.from_json(Path(path), nodes)
    placement.check(desc.moe_layers())
    return placement


def simulate(req: SimRequest) -> dict:
    from ...node.describe import describe
    from .run_local import encode_prompt

    ckpt = Checkpoint.open(req.model)
    if req.nodes < 1:
        raise UserError(f"--nodes must be at least 1 (got {req.nodes})")
    check_runnable(ckpt.config, ckpt.path / "config.json")  # before any process starts
    placement_json = None
    desc = describe(ckpt)
    desc.require_moe()  # a checkpoint with no MoE layers is refused before any process starts
    if req.placement is not None:
        placement_json = checked_placement(req.placement, req.nodes, desc).to_json()
    tokenizer = _tokenizer(ckpt.path)
    ids = encode_prompt(tokenizer, req.prompt)
    eos = tuple(tokenizer.eos_token_ids)
    ExpertCacheSpec.parse(req.expert_cache)  # bad input is refused before any process starts
    prediction = (
        tuple(tokenizer.encode(req.prediction, add_special_tokens=False)) if req.prediction else ()
    )
    task = SimTask(
        str(ckpt.path),
        tuple(ids),
        req.sampling,
        placement_json,
        req.keepalive,
        eos,
        record_logits=req.check,
        repeats=req.repeats,
        expert_cache=req.expert_cache,
        profile=profile_heat(req.profile) if req.profile else None,
        speculative=req.speculative,
        draft_tokens=req.draft_tokens,
        prediction=prediction,
        draft_model=_draft_path(req),
        mtp_experts=_mtp_experts(req),
    )
    reports = run_nodes([task], req.nodes, timeout_s=req.timeout_s, transport=req.transport)[0]
    r0 = reports[0]
    out = {
        "tokens": r0["tokens"],
        "text": tokenizer.decode(r0["tokens"]),
        "nodes": [
            {
                k: rep[k]
                for k in (
                    "rank",
                    "experts_per_layer",
                    "resident_weight_bytes",
                    "peak_memory_bytes",
                    "replicated_bytes",
                    "expert_bytes",
                    "active_memory_bytes",
                )
            }
            # per MoE layer this node shards (the MTP layer's too, where it is sharded): its
            # calls, each one all-reduce, over the decode steps
            | {"moe_calls": {k: c["calls"] for k, c in rep["layer_counters"].items()}}
            for rep in reports
        ],
        "counters": {
            k: float(np.mean([rep["counters"][k] for rep in reports]))
            for k in ("selected", "computed", "filler")
        },
        "generation_tps": r0["generation_tps"],
        "prompt_tps": r0["prompt_tps"],
        "keepalive": req.keepalive,
        "speculative": {"mode": r0["speculative"], **r0["figures"]},
    }
    if reports[0].get("expert_cache") is not None:
        out["expert_cache"] = cache_summary([rep["expert_cache"] for rep in reports])
    if any(rep["tokens"] != r0["tokens"] for rep in reports):
        raise CollectiveError("nodes disagree on the generated tokens")
    if req.check:
        ref_tokens, ref_logits = reference(str(ckpt.path), ids, req.sampling, eos)
        out.update(compare(r0["tokens"], r0["logits"], ref_tokens, ref_logits))
    return out


def _draft_path(req: SimRequest) -> str:
    """The draft checkpoint's folder where the mode needs one (refused before any process starts)."""
    if req.speculative != "draft":
        if req.draft_model:
            raise UserError("--draft-model needs --speculative draft")
        return ""
    if not req.draft_model:
        raise UserError(
            "--speculative draft needs --draft-model (a checkpoint with the model's tokenizer)"
        )
    return str(Checkpoint.open(req.draft_model).path)


def _mtp_experts(req: SimRequest) -> str:
    if "," in req.mtp_experts:
        raise UserError(f"simulate takes one --mtp-experts (got {req.mtp_experts})")
    if req.mtp_experts != "auto" and req.speculative != "mtp":
        raise UserError(f"--mtp-experts {req.mtp_experts} needs --speculative mtp")
    return req.mtp_experts


def cache_summary(per_node: list[dict]) -> dict:
    """The nodes' expert caches summed: resident slots, hits, misses, bytes read (decode steps)."""
    return {k: sum(n[k] for n in per_node) for k in ("capacity", "hits", "misses", "bytes_read")}


def profile_heat(source: Path | dict) -> dict[int, tuple[list[float], int]]:
    """{MoE layer: (selections per expert, tokens)} of a `moe-cluster profile` file (or its JSON)."""
    try:
        doc = source if isinstance(source, dict) else json.loads(Path(source).read_text())
        return {
            int(l): (list(map(float, v["counts"])), int(v["tokens"]))
            for l, v in doc["layers"].items()
        }
    except (OSError, json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise UserError(
            f"{source if not isinstance(source, dict) else 'the profile'}: not a routing profile "
            f"from `moe-cluster profile` ({exc})"
        ) from None


def _tokenizer(path: Path):
    from ...node.checkpoint import load_tokenizer

    return load_tokenizer(path)


def main(args) -> int:
    sampling = Sampling(args.max_tokens, args.temperature, args.top_p, args.seed)
    sampling.check()
    req = SimRequest(
        str(resolve_model_path(args.model)),  # a repo is fetched here, once
        args.nodes,
        args.prompt,
        sampling,
        args.keepalive,
        Path(args.placement) if args.placement else None,
        args.check,
        transport=args.transport,
        expert_cache=args.expert_cache,
        profile=Path(args.routing_profile) if args.routing_profile else None,
        speculative=args.speculative,
        draft_tokens=args.draft_tokens,
        prediction=args.prediction or "",
        draft_model=args.draft_model or "",
        mtp_experts=args.mtp_experts,
    )
    out = simulate(req)
    if args.json:
        print(json.dumps(out))
        return 0
    print(out["text"], flush=True)
    print("=" * 10, file=sys.stderr)
    for n in out["nodes"]:
        print(
            f"node {n['rank']}: {sum(n['experts_per_layer'].values())} experts, "
            f"{n['resident_weight_bytes'] / 1e6:.1f} MB resident, load peak {n['peak_memory_bytes'] / 1e6:.1f} MB",
            file=sys.stderr,
        )
    c = out["counters"]
    print(
        f"per node per MoE layer: selected {c['selected']:.2f}, computed {c['computed']:.2f}, "
        f"filler {c['filler']:.2f} (keepalive {out['keepalive']})",
        file=sys.stderr,
    )
    if "expert_cache" in out:
        e = out["expert_cache"]
        print(
            f"expert cache: {e['capacity']} slots, {e['hits']} hits, {e['misses']} misses, "
            f"{e['bytes_read'] / 1e6:.1f} MB read",
            file=sys.stderr,
        )
    print(f"generation: {out['generation_tps']:.1f} tokens/s", file=sys.stderr)
    spec = out["speculative"]
    if spec["mode"] != "off":
        print(
            f"speculative ({spec['mode']}): {spec['accepted']} of {spec['drafted']} drafts accepted, "
            f"{spec['steps']} decode steps",
            file=sys.stderr,
        )
    if args.check:
        print(
            f"check: tokens {'match' if out['tokens_match'] else 'DIFFER'} stock mlx-lm; "
            f"max |Δlogit| {out['max_abs_logit_diff']:.2e}",
            file=sys.stderr,
        )
    return 0

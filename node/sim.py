"""One node process of `moe-cluster simulate`: load shards, generate in lock-step, report."""

from __future__ import annotations

import os
import sys
import time
import traceback
from dataclasses import dataclass

from ..proto.errors import ErrorKind, kind_of
from ..proto.records import Sampling
from .device import release_memory
from . import cores


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
    prefetch: int | None = (
        None  # expert cache read-ahead per layer (node.moe.load.load_shard); None: auto
    )
    # None: `prompt` alone, as above. Else these prompts run at once in the running batch (`prompt`
    # unused), each token's arrival time kept; timers and counters then cover the steps after
    # every stream has its first token (bench race)
    streams: tuple[tuple[int, ...], ...] | None = None
    speculative: str = "off"  # node/speculate.py MODES
    draft_tokens: int = 4
    prediction: tuple[int, ...] = ()  # the output expected (drafts), for the request(s)
    draft_model: str = ""  # speculative "draft": its checkpoint
    mtp_experts: str = "auto"  # speculative "mtp": its routed experts at N > 1 (MTP_EXPERTS)
    # tests: the last rank feeds MTP guesses of its own at every other step, as a node that rounds
    # differently would (the guesses ride the vote: only what every rank fed is verified)
    disagree: bool = False
    overlap: bool = False  # two micro-batches per decode step (node/overlap.py)
    # decode routes (node/moe/route.py) to alternate: each repeat runs the request once per route,
    # in this order, forced on every MoE layer first, so that routes are compared within one load
    # and a drifting machine slows them alike (bench decode --routes), after one pass over them
    # that warms each up; empty: the route of the load
    routes: tuple[str, ...] = ()
    route: str | None = None  # the load's decode route (cluster.yaml's `route:`); None: measure
    # who attends for each stream (node/batch.py BatchLimits.attention): by-stream gives stream j
    # to rank j mod N (what the coordinator's "most KV room" gives equal streams), whose own
    # report then has its tokens' logits
    attention: str = "replicated"
    # streams only: each node's KV budget (BatchLimits.kv_budget_bytes; 0: none), so that how many
    # streams run at once depends on where their KV lives
    kv_budget: int = 0
    # streams only: after the timed repeats, one more with a host sync at each MoE layer's
    # boundaries where the step is one graph (moe/combine.py SyncedCombine), its timers reported apart
    # ("synced"): where an in-graph step's time goes, which its own timers cannot see
    synced_pass: bool = False
    # the previous task's loaded model serves this one where it loaded the same (model, placement,
    # keepalive, expert cache, profile, read-ahead) and forced no route (`routes`: every layer's
    # route stays forced), its route as the load chose it: a big model's shard is loaded once for
    # all the streams of a bench race row. Off where the previous task's resident experts would
    # change what this one measures (keepalive lru, an expert cache).
    reuse_load: bool = False

    def load_key(self) -> tuple:
        return (
            self.model,
            self.placement_json,
            self.keepalive,
            self.expert_cache,
            self.profile,
            self.prefetch,
            self.route,
        )


@dataclass(frozen=True)
class SimJob:
    """Everything one simulated node needs: its rank, how to reach the others, its tasks."""

    rank: int
    world_size: int
    collective: object  # a transport spec (node.transports: ShmSpec, EnvoySpec or MlxSpec)
    tasks: tuple[SimTask, ...]
    cores: tuple[int, ...] | None = None  # the cores this node runs on (node/cores.py); None: any


TICK = "a step"  # Beats.tick's beat: a step done inside a phase
REUSED = "the previous task's model taken"  # the beat of a task that loaded nothing (reuse_load)


class Beats:
    """A node's progress through a task, told to the parent (one "beat" dict on `results` per phase
    done: loaded, each pass) and on stderr with its time: the parent bounds each phase, not the
    whole task, so a big model's load or a first run's kernel builds are not taken for a hang, and
    a row that fails says where its time went."""

    def __init__(self, results, rank: int, task: int):
        self.results, self.rank, self.task = results, rank, task
        self.t0 = self.last = self.ticked = time.perf_counter()

    def __call__(self, what: str) -> None:
        now = time.perf_counter()
        print(
            f"moe-cluster node: rank {self.rank} task {self.task}: {what} in "
            f"{now - self.last:.1f} s ({now - self.t0:.1f} s since the task began)",
            file=sys.stderr,
            flush=True,
        )
        self.last = self.ticked = now
        self.results.put({"beat": what, "rank": self.rank, "task": self.task})

    def tick(self) -> None:
        """A step done inside a phase: told to the parent (at most once a second), not printed. A
        pass holds several steps that may each build kernels for minutes (the first of each
        shape): the parent's bound is one such step, not a whole pass of them."""
        now = time.perf_counter()
        if now - self.ticked >= 1.0:
            self.ticked = now
            self.results.put({"beat": TICK, "rank": self.rank, "task": self.task})


def run(job: SimJob, results) -> None:
    """Process entry point: puts one dict per task on `results` ("error" and its "kind" set if one
    failed), and Beats while it works."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    cores.pin(job.cores)  # before the collective starts its threads
    try:
        collective = _collective(job)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent as a value
        results.put(_error(job.rank, 0, exc))
        return
    loaded = sharded = None  # (the load's SimTask.load_key, the loaded model, the load's route)
    try:
        for i, task in enumerate(job.tasks):
            beat = Beats(results, job.rank, i)
            try:
                if task.reuse_load and loaded and loaded[0] == task.load_key():
                    _, sharded, route = loaded
                    sharded.state.route, sharded.state.forced_handoff = route, None
                    beat(REUSED)
                else:
                    loaded = sharded = None
                    release_memory()  # the previous task's model, before this one loads and is measured
                    sharded = _load(job, task, collective)
                    loaded = (task.load_key(), sharded, sharded.state.route)
                    beat("loaded")
                results.put(_run(job, i, task, sharded, beat))
                if task.routes:  # every layer's route stays forced: no later task takes it
                    loaded = None
            except BaseException as exc:  # noqa: BLE001
                results.put(_error(job.rank, i, exc))
                return
    finally:
        collective.close()


def _error(rank: int, task: int, exc: BaseException) -> dict:
    """The failure as a value: its kind (an ErrorKind's value) decides how the parent re-raises it.
    An internal failure after load says which decode route the node had chosen."""
    kind = kind_of(exc)
    route = getattr(exc, "moe_route", None)
    message = str(exc)
    if kind is ErrorKind.INTERNAL:
        message = f"{type(exc).__name__}: {exc}" + (f" (decode route: {route})" if route else "")
    return {
        "rank": rank,
        "task": task,
        "kind": kind.value,
        "error": message,
        "route": route,
        "traceback": traceback.format_exc(),
    }


def _collective(job: SimJob):
    from .collective.specs import make_collective

    return make_collective(job.collective, job.rank)


def _load(job: SimJob, task: SimTask, collective):
    from ..proto.placement import Placement
    from .moe.load import load_shard

    placement = (
        Placement.from_json(task.placement_json, job.world_size) if task.placement_json else None
    )
    return load_shard(
        task.model,
        placement,
        job.rank,
        keepalive=task.keepalive,
        collective=collective,
        expert_cache=task.expert_cache,
        profile=task.profile,
        prefetch=task.prefetch,
        route=task.route,
    )


def _run(job: SimJob, index: int, task: SimTask, sharded, beat) -> dict:
    try:
        return _serve(job, index, task, sharded, beat)
    except BaseException as exc:
        # a failure after load names the decode route the node chose (a kernel fault on one route
        # is otherwise a bare device error)
        if sharded.state.route is not None:
            exc.moe_route = sharded.state.route.describe()
        raise


def _serve(job: SimJob, index: int, task: SimTask, sharded, beat) -> dict:
    """A loaded node runs its task: the streams at once, or the request `repeats` times."""
    from ..proto.records import GenerateRequest
    from .batch import BatchLimits
    from .runtime import GenerateResult, NodeRuntime

    if task.streams is not None:
        streams = _run_streams(index, task, sharded, beat)
        return {**_report(job, index, sharded), **streams}
    runtime = NodeRuntime(
        sharded,
        limits=BatchLimits(
            speculative=task.speculative,
            draft_tokens=task.draft_tokens,
            draft_model=task.draft_model,
            mtp_experts=task.mtp_experts,
            overlap=task.overlap,
            attention=task.attention,
        ),
    )
    if task.disagree:
        _disagree(runtime)
    result, wall = None, 0.0
    by_route: dict[str, dict] = {}
    # alternated routes: a first pass over them all warms each one up (its kernels compiled, its
    # experts read once) and is not kept
    for i in range(task.repeats + (1 if task.routes else 0)):
        for route in task.routes or (None,):
            if route is not None:
                force_route(sharded, route)
            sharded.state.reset_counters()
            sharded.state.totals.reset()
            result = GenerateResult()
            req = GenerateRequest(
                f"sim-{index}-{i}{'-' + route if route else ''}",
                task.prompt,
                task.sampling,
                task.eos_token_ids,
                record_logits=task.record_logits and job.rank == 0,
                prediction=task.prediction,
                # by stream, rank 0 owns the lone stream (its report has the logits)
                owner=0 if task.attention == "by-stream" and job.world_size > 1 else -1,
            )
            t0 = time.perf_counter()
            for n, _ in enumerate(runtime.generate(req, result=result)):
                beat.tick()
                if n == 0:  # like generation_seconds, the figures cover decode steps only
                    _decode_begins(sharded)
            wall = time.perf_counter() - t0
            beat(f"run {i}{' on route ' + route if route else ''}")
            if route is not None and i > 0:
                _route_run(by_route.setdefault(route, {}), sharded, result)
    return {
        **_report(job, index, sharded),
        "tokens": result.tokens,
        "logits": result.logits if job.rank == 0 else None,
        "prompt_tps": result.stats.prompt_tps,
        "generation_tps": result.stats.generation_tps,
        "generated": result.stats.generated,
        "generation_seconds": result.stats.generation_seconds,
        "wall_seconds": wall,
        "figures": vars(result.figures),  # its decode steps, drafts and accepted drafts
        "speculative": runtime.batch.speculation(),
        "routes": by_route,
    }


def _disagree(runtime) -> None:
    """SimTask.disagree: the last rank's MTP guesses differ from the others' (their last one
    moved) at every other verifying step."""
    c = runtime.sharded.collective
    if c.rank != c.world_size - 1:
        return
    speculator = runtime.batch._speculator
    riding, steps = speculator.riding, [0]

    def own(decoding: list):
        steps[0] += 1
        for s in decoding if steps[0] % 2 else ():
            row = speculator.next.get(s.seq, [])
            if row:
                speculator.next[s.seq] = [*row[:-1], (row[-1] + 1) % runtime.vocab]
        return riding(decoding)

    speculator.riding = own


def _owner(attention: str, j: int, world: int) -> int:
    """Stream j's owner where the streams arrive together, as the coordinator's policy gives them
    (coordinator/serve/streams.py): round the nodes by stream (the most KV room for equal
    streams); auto keeps the first replicated (it found nothing running)."""
    if world < 2 or attention == "replicated" or (attention == "auto" and j == 0):
        return -1
    return (j - (attention == "auto")) % world


def force_route(sharded, route: str) -> None:
    """Every MoE layer of a loaded node computes decode steps by `route` from now on (a route no
    layer here can take is a UserError naming the ones it can)."""
    from .moe import route as decode_route

    state = sharded.state

    def keep_handoff() -> None:
        # every route compared hands wide calls to the host read where the first choice that had
        # a hand-off put it: the load's, or, where that was the host read itself, the first forced
        # route's measured one
        if state.forced_handoff is None and state.route is not None and state.route.host_from:
            state.forced_handoff = (state.route.host_from, state.route.handoff_us)

    keep_handoff()
    state.route = decode_route.choose(
        [m.shard for m in sharded.layers],
        [m.description.top_k or 1 for m in sharded.layers],
        route,
        source="bench decode --routes",
        handoff=state.forced_handoff,
    )
    keep_handoff()


def _route_run(into: dict, sharded, result) -> None:
    """Keep one run of a route (SimTask.routes): its speed in every round, and the tokens, counters
    and per-layer routes of the latest, which `bench decode` counts its expert reads from."""
    into.setdefault("generation_tps", []).append(result.stats.generation_tps)
    into.setdefault("generation_seconds", []).append(result.stats.generation_seconds)
    into.update(generated=result.stats.generated, tokens=result.tokens, **_routing(sharded))


def _routing(sharded) -> dict:
    """The node's counters since they were last reset and, per MoE layer, the decode route taken
    and one local expert's bytes: what `bench decode` counts each node's expert reads from."""
    return {
        "counters": sharded.state.means(),  # folds the device-side counts first
        "layer_counters": {
            str(layer): dict(vars(c)) for layer, c in sharded.state.counters.items()
        },
        "layer_routes": {str(m.shard.layer): m.shard.route for m in sharded.layers},
        "expert_matrix_bytes": {str(m.shard.layer): m.shard.matrix_bytes() for m in sharded.layers},
        "route": sharded.state.route.describe() if sharded.state.route is not None else None,
    }


def _report(job: SimJob, index: int, sharded) -> dict:
    """What a node reports of any task: its shard, counters, timers and memory."""
    import mlx.core as mx

    info = sharded.info
    return {
        "rank": job.rank,
        "task": index,
        "cores": cores.usable(),  # where this node's threads ran
        "experts_per_layer": {str(k): v for k, v in info.experts_per_layer.items()},
        "resident_weight_bytes": info.resident_weight_bytes,
        "replicated_bytes": info.replicated_bytes,
        "expert_bytes": info.expert_bytes,
        "peak_memory_bytes": info.peak_memory_bytes,
        "active_memory_bytes": info.active_memory_bytes,
        "load_seconds": info.load_seconds,
        **_routing(sharded),
        "timers": sharded.state.totals.figures(),
        # MLX's peak over the last run's decode steps: weights, KV cache and activations (an expert
        # read waiting for its slot is host memory outside MLX: expert_cache.staged_peak_bytes)
        "peak_memory_decode_bytes": int(mx.get_peak_memory()),
        "expert_cache": sharded.state.cache_totals(),  # decode steps only, like the counters
        # what one MoE layer puts in a batch-1 decode step's graph (node/moe/opcount.py)
        "primitives_per_moe_layer": _layer_ops(sharded),
    }


def _layer_ops(sharded) -> dict | None:
    from .moe.opcount import layer_summary, node_layer

    counts = node_layer(sharded)
    return layer_summary(counts) if counts is not None else None


class _Timed:
    """A Sink that keeps when each of a sequence's tokens arrived (perf_counter seconds)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.ended = False
        self.error: BaseException | None = None

    def tokens(self, ids: list[int]) -> None:
        now = time.perf_counter()
        self.times.extend([now] * len(ids))

    def done(self, result) -> None:
        self.ended = True

    def failed(self, exc: BaseException) -> None:
        self.ended, self.error = True, exc


def _run_streams(index: int, task: SimTask, sharded, beat) -> dict:
    """Every prompt of `task.streams` at once through the running batch, `repeats` times (the last
    kept): each stream's tokens and token times from t0, and the decode steps the timers cover."""
    import mlx.core as mx

    from .batch import BatchLimits
    from .runtime import NodeRuntime

    runtime = NodeRuntime(
        sharded,
        limits=BatchLimits(
            max_batch=len(task.streams),
            kv_budget_bytes=task.kv_budget,
            speculative=task.speculative,
            draft_tokens=task.draft_tokens,
            draft_model=task.draft_model,
            mtp_experts=task.mtp_experts,
            overlap=task.overlap,
            attention=task.attention,
        ),
    )
    if task.disagree:
        _disagree(runtime)
    out: dict = {}
    for i in range(task.repeats):
        out = _streams_pass(index, i, task, sharded, runtime, beat)
        beat(f"pass {i} of {len(task.streams)} streams")
    if task.synced_pass:
        # the timed pass's timers and counters are what the report gives; the synced pass's go
        # apart, with its own step time (slower than the graph's: every layer waits three times)
        out.update(
            timers=sharded.state.totals.figures(),
            expert_cache=sharded.state.cache_totals(),
            peak_memory_decode_bytes=int(mx.get_peak_memory()),
            **_routing(sharded),
        )
        from .moe.combine import SyncedCombine
        from .moe.load import set_combine

        from .moe.combine import StreamCombine

        combine = sharded.layers[0].combine if sharded.layers else None
        if isinstance(combine, StreamCombine):  # by stream: its own passes, synced
            combine.sync(True)
        else:
            set_combine(sharded, SyncedCombine(sharded.collective, sharded.state.timers))
        try:
            synced = _streams_pass(index, task.repeats, task, sharded, runtime, beat)
        finally:
            if isinstance(combine, StreamCombine):
                combine.sync(False)
            else:
                set_combine(sharded, combine)
        beat("synced pass")
        out["synced"] = {
            "timers": sharded.state.totals.figures(),
            "decode_steps": synced["decode_steps"],
            "decode_seconds": synced["decode_seconds"],
            "tokens": synced["tokens"],
        }
    return out


def _decode_begins(sharded) -> None:
    """From here on the node's timers, counters and peak memory cover decode steps only."""
    import mlx.core as mx

    sharded.state.totals.reset()
    sharded.state.reset_counters()
    mx.reset_peak_memory()


def _streams_pass(index: int, i: int, task: SimTask, sharded, runtime, beat) -> dict:
    """One run of every prompt of `task.streams` at once (see _run_streams)."""
    from ..proto.records import GenerateRequest
    from .runtime import GenerateResult

    sharded.state.reset_counters()
    sharded.state.totals.reset()
    flight0 = runtime.batch.overlap_seconds()
    sinks = [_Timed() for _ in task.streams]
    results = [GenerateResult() for _ in task.streams]
    t0 = time.perf_counter()
    world = sharded.state.world_size
    for j, (prompt, sink, result) in enumerate(zip(task.streams, sinks, results)):
        owner = _owner(task.attention, j, world)
        req = GenerateRequest(
            f"sim-{index}-{i}-{j}",
            prompt,
            task.sampling,
            task.eos_token_ids,
            prediction=task.prediction,
            record_logits=task.record_logits and sharded.state.rank == max(owner, 0),
            owner=owner,
        )
        runtime.batch.submit(req, runtime.next_seq(), sink, result)
    steps, t_decode = 0, None
    peak_streams = peak_kv = peak_running = 0
    while not all(s.ended for s in sinks):
        runtime.batch.step()
        beat.tick()
        steps += 1
        mine, kv = runtime.batch.streams()  # those this node attends for, and their KV
        peak_streams, peak_kv = max(peak_streams, mine), max(peak_kv, kv)
        peak_running = max(peak_running, runtime.batch.running()[0])
        if t_decode is None and all(s.times or s.ended for s in sinks):
            _decode_begins(sharded)  # the figures cover decode steps of the whole batch only
            t_decode, steps = time.perf_counter(), 0
    failed = next((s.error for s in sinks if s.error is not None), None)
    if failed is not None:
        raise failed
    flight = runtime.batch.overlap_seconds()
    return {
        "t0": t0,
        "tokens": [r.tokens for r in results],
        "logits": [r.logits for r in results] if task.record_logits else None,
        "times": [s.times for s in sinks],
        "figures": [vars(r.figures) for r in results],
        "decode_steps": steps,
        "decode_seconds": time.perf_counter() - (t_decode or t0),
        # the most streams running at once (every node's), and of them this node's own and
        # their KV reserved, at their peaks
        "peak_running": peak_running,
        "peak_streams": peak_streams,
        "peak_kv_bytes": peak_kv,
        "micro_batches": runtime.batch.micro_batches(),
        "speculative": runtime.batch.speculation(),
        "drafted": sum(r.figures.drafted for r in results),
        "accepted": sum(r.figures.accepted for r in results),
        # all-reduces that travelled while the other micro-batch computed (node/overlap.py)
        "overlapped": runtime.batch.overlapped(),
        # this pass's seconds of them in flight, and of those waited for
        "overlap_in_flight_s": flight[0] - flight0[0],
        "overlap_waited_s": flight[1] - flight0[1],
    }

"""A token step across real node processes (issue 15, items 2 and 4): with `transport: mlx` the
step is one lazy graph (the all_gather inside it, no host sync), the token agreement rides on the
next step's first MoE all-reduce (no round trip of its own), a token that differs on one node is a
TokenMismatch on every node, a cancel on one node stops all of them at the same step, and a stalled
peer still ends the node within the collective timeout.

Over the envoy transport one spawn of the node processes runs the generate, mismatch and cancel
scenarios in turn (a fresh mesh and shard each); an MLX group cannot be rebuilt in a process, so
each MLX scenario has processes of its own."""

from __future__ import annotations

import os
import queue
import signal
import time

import pytest

from moe_cluster.coordinator.dev.simulate import _transport_spec, stop_processes
from moe_cluster.node import prefork

PROMPT = (345, 12, 88, 501, 7, 260, 19, 944, 3, 71)
TOKENS = 8
AT = 3  # the step at which a scenario injects its fault
STALL_S = 3.0  # timeout_s of the stall scenario


def _node(scenarios: tuple[str, ...], specs: tuple, rank: int, model: str, results) -> None:
    """Process entry point: run each scenario in turn as node `rank` (each on its own collective
    spec), put (scenario, rank, report) on `results` after each."""
    for scenario, spec in zip(scenarios, specs):
        try:
            results.put((scenario, rank, _scenario(scenario, spec, rank, model)))
        except BaseException as exc:  # noqa: BLE001 - reported to the test as a value
            results.put((scenario, rank, {"error": type(exc).__name__, "message": str(exc)}))


def _scenario(scenario: str, spec, rank: int, model: str) -> dict:
    import mlx.core as mx

    from moe_cluster.node import sampling
    from moe_cluster.node.collective.base import TOKEN_LAYER
    from moe_cluster.node.collective.specs import make_collective
    from moe_cluster.node.moe.load import load_shard
    from moe_cluster.node.runtime import GenerateResult, NodeRuntime
    from moe_cluster.proto.records import GenerateRequest, Sampling

    collective = make_collective(spec, rank)
    if scenario.endswith("-summed"):  # the ring's two ranks summed by all_sum, as NCCL's are
        collective.SUMMED_AT = 2
        scenario = scenario.removesuffix("-summed")
    placement = _replicas_on_both(model) if scenario == "graph-replicas" else None
    sharded = load_shard(
        model, placement, rank, keepalive="none", collective=collective, route="device"
    )  # device-routed experts: no host read of the routing
    if scenario.startswith("graph"):
        return _one_step(sharded)
    explicit = []  # layers of the all-reduces outside the MoE layers (explicit agreements)
    reduce = collective.all_reduce
    collective.all_reduce = lambda x, layer: (
        (explicit.append(layer) if layer == TOKEN_LAYER else None) or reduce(x, layer)
    )
    sample, calls = (
        sampling.sample_tokens,
        [0],
    )  # restored after the scenario: the next one samples as stock
    if rank == 1 and scenario in ("mismatch", "stall"):

        def faulty(decoding, logprobs):
            y = sample(decoding, logprobs)
            calls[0] += 1
            if calls[0] == AT + 1:
                if scenario == "stall":
                    # stopped whole, as a frozen process or a sleeping machine is: its own stall
                    # guard (a thread) cannot fire first and end the group from this side
                    os.kill(os.getpid(), signal.SIGSTOP)
                y = y + 1  # this node samples another token than the others
            return y

        sampling.sample_tokens = faulty
    result = GenerateResult()
    cancel = (
        (lambda: len(result.tokens) >= AT)
        if scenario == "cancel" and rank == 1
        else (lambda: False)
    )
    req = GenerateRequest(f"{scenario}-1", PROMPT, Sampling(max_tokens=TOKENS))
    try:
        tokens = list(NodeRuntime(sharded).generate(req, should_cancel=cancel, result=result))
    finally:
        sampling.sample_tokens = sample
        collective.close()
    return {"tokens": tokens, "cancelled": result.cancelled, "explicit": len(explicit)}


def _replicas_on_both(model: str):
    """Two nodes, half of every layer's experts held by both: the replica rule decides per call."""
    from moe_cluster.node.checkpoint import Checkpoint
    from moe_cluster.node.describe import describe
    from moe_cluster.proto.placement import Placement

    layers = describe(Checkpoint.open(model)).moe_layers()
    return Placement(
        2, {l: {0: tuple(range(3 * n // 4)), 1: tuple(range(n // 4, n))} for l, n in layers.items()}
    )


def _one_step(sharded) -> dict:
    """Build one decode step with every host sync counted, then evaluate it."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    from moe_cluster.node.collective import base

    model = sharded.model
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([PROMPT]), cache=cache))
    syncs: list[str] = []
    gathers = {"all_gather": 0, "all_sum": 0}
    saved = {
        (mx, "eval"): mx.eval,
        (mx, "async_eval"): mx.async_eval,
        (np, "array"): np.array,
        (np, "asarray"): np.asarray,
        (base, "to_wire"): base.to_wire,
        (mx.distributed, "all_gather"): mx.distributed.all_gather,
        (mx.distributed, "all_sum"): mx.distributed.all_sum,
    }
    collectives = ("all_gather", "all_sum")  # all_sum at two ranks (MlxCollective._summed)

    def counted(name, fn):
        return lambda *a, **k: (syncs.append(name), fn(*a, **k))[1]

    def gather(name, fn):
        return lambda *a, **k: (gathers.__setitem__(name, gathers[name] + 1), fn(*a, **k))[1]

    for (mod, name), fn in saved.items():
        setattr(mod, name, gather(name, fn) if name in collectives else counted(name, fn))
    try:
        logits = model(mx.array([[PROMPT[-1]]]), cache=cache)  # the step's graph, built lazily
    finally:
        for (mod, name), fn in saved.items():
            setattr(mod, name, fn)
    mx.eval(logits)
    return {
        "syncs": syncs,
        "gathers": gathers,
        "moe_layers": len(sharded.layers),
        "logits": np.array(logits.astype(mx.float32)).tobytes(),
    }


def _run(
    scenarios: tuple[str, ...],
    transport: str,
    model,
    nodes: int = 2,
    timeout_s: float = 30.0,
    wait_s: float = 120.0,
):
    """Run `scenarios` in turn on `nodes` processes;
    -> ({scenario: {rank: report}}, {rank: exit code}, seconds)."""
    ctx = prefork.context()  # as simulate's nodes: forked with mlx-lm's imports done
    specs, cleanups = zip(
        *(_transport_spec(transport, nodes, 1 << 20, ctx, timeout_s) for _ in scenarios)
    )
    results = ctx.Queue()
    procs = [
        prefork.process(
            ctx, f"{__name__}:_node", (scenarios, specs, r, str(model), results), daemon=True
        )
        for r in range(nodes)
    ]
    t0 = time.monotonic()
    try:
        for p in procs:
            p.start()
        reports: dict[str, dict[int, dict]] = {s: {} for s in scenarios}
        while (
            sum(map(len, reports.values())) < nodes * len(scenarios)
            and time.monotonic() - t0 < wait_s
        ):
            try:
                scenario, rank, rep = results.get(timeout=0.2)
                reports[scenario][rank] = rep
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break
        seconds = time.monotonic() - t0
        return reports, {r: p.exitcode for r, p in enumerate(procs)}, seconds
    finally:
        for p in procs:
            if p.is_alive() and "stall" in scenarios:
                p.kill()  # the sleeping node: its peer's exit is what the test waits for
        stop_processes(procs)
        for cleanup in cleanups:
            cleanup()


@pytest.fixture(scope="module")
def model(make_ckpt):
    return make_ckpt("mixtral")


ENVOY_SCENARIOS = {
    "test_the_token_rides_on_the_next_all_reduce": "generate",
    "test_a_token_that_differs_on_one_node_fails_every_node_naming_both": "mismatch",
    "test_a_cancel_on_one_node_stops_every_node_at_the_same_step": "cancel",
}


@pytest.fixture(scope="module")
def reports_of(request, model):
    """reports_of(scenario, transport) -> {rank: report}. Over the envoy transport the scenarios
    selected in this module run in one spawn of the node processes (two spawns fewer, ~5 s); over
    MLX each scenario runs in processes of its own."""
    selected = [
        ENVOY_SCENARIOS[item.originalname]
        for item in request.session.items
        if item.module is request.module
        and item.originalname in ENVOY_SCENARIOS
        and item.callspec.params.get("transport") == "envoy"
    ]
    envoy: dict[str, dict[int, dict]] = {}

    def get(scenario: str, transport: str) -> dict[int, dict]:
        if transport == "mlx-summed":  # two ranks summed by all_sum (NCCL's way) over the ring
            scenario += "-summed"
            return _run((scenario,), "mlx", model)[0][scenario]
        if transport != "envoy":
            return _run((scenario,), transport, model)[0][scenario]
        if scenario not in envoy:
            envoy.update(
                _run(
                    tuple(dict.fromkeys(selected)) if scenario in selected else (scenario,),
                    "envoy",
                    model,
                )[0]
            )
        return envoy.pop(scenario)

    return get


@pytest.mark.parametrize("nodes", [2, 3])
def test_an_mlx_step_is_one_graph_with_the_all_gather_inside(model, nodes):
    """With the even split, and with replicated experts (their holder chosen by the replica rule
    on the device): no host sync while the step is built, the same logits on every node, and the
    replicas change them by no more than float32 rounding."""
    import numpy as np

    # replicas, and the all_gather path beside the all_sum: 2 nodes
    scenarios = ("graph", "graph-replicas", "graph-summed") if nodes == 2 else ("graph",)
    both = _run(scenarios, "mlx", model, nodes=nodes)[0]
    for scenario, reports in both.items():
        assert all("error" not in r for r in reports.values()), (scenario, reports)
        for rank, r in reports.items():
            assert r["syncs"] == [], (
                f"{scenario}, rank {rank}: synced with the host while building the step: {r['syncs']}"
            )
            # the ring all_gathers; two ranks over NCCL sum with all_sum (forced here: "summed")
            one = "all_sum" if scenario == "graph-summed" else "all_gather"
            want = {"all_gather": 0, "all_sum": 0, one: r["moe_layers"]}
            assert r["gathers"] == want, (scenario, rank, r["gathers"], want)
        # rank-order float32 sum: the same bytes everywhere
        assert len({r["logits"] for r in reports.values()}) == 1, scenario
    if nodes == 2:
        even, replicas = (
            np.frombuffer(both[s][0]["logits"], dtype=np.float32)
            for s in ("graph", "graph-replicas")
        )
        assert np.abs(even - replicas).max() <= 1e-5
        # the all_sum of the float32 partials is the all_gather's rank-order sum, to the byte
        assert both["graph"][0]["logits"] == both["graph-summed"][0]["logits"]


@pytest.mark.parametrize("transport", ["mlx", "mlx-summed", "envoy"])
def test_the_token_rides_on_the_next_all_reduce(transport, model, reports_of, reference):
    reports = reports_of("generate", transport)
    ref_tokens, _ = reference(model, PROMPT, TOKENS)
    for rank in (0, 1):
        r = reports[rank]
        assert r["tokens"] == list(ref_tokens[:TOKENS]), (rank, r)
        # the admission from idle only (no MoE layer runs before it): the prefill chunk and every
        # token ride on a step's first MoE all-reduce
        assert r["explicit"] == 1, (
            f"rank {rank}: {r['explicit']} explicit agreements for {TOKENS} tokens"
        )


@pytest.mark.parametrize("transport", ["mlx", "mlx-summed", "envoy"])
def test_a_token_that_differs_on_one_node_fails_every_node_naming_both(
    transport, model, reports_of, reference
):
    reports = reports_of("mismatch", transport)
    ref_tokens, _ = reference(model, PROMPT, TOKENS)
    want = f"step {AT}: rank 1 sampled token {ref_tokens[AT] + 1}, rank 0 sampled {ref_tokens[AT]}"
    for rank in (0, 1):
        assert reports[rank].get("error") == "TokenMismatch", (rank, reports[rank])
        assert want in reports[rank]["message"], (rank, reports[rank]["message"])


@pytest.mark.parametrize("transport", ["mlx", "envoy"])
def test_a_cancel_on_one_node_stops_every_node_at_the_same_step(
    transport, model, reports_of, reference
):
    reports = reports_of("cancel", transport)
    ref_tokens, _ = reference(model, PROMPT, TOKENS)
    for rank in (0, 1):
        r = reports[rank]
        assert r["cancelled"], (rank, r)
        assert r["tokens"] == list(ref_tokens[: len(reports[1]["tokens"])]), (rank, r)
    assert reports[0]["tokens"] == reports[1]["tokens"] and AT <= len(reports[0]["tokens"]) < TOKENS


def test_a_stalled_peer_ends_the_mlx_node_as_stalled_before_the_peer_wakes(model):
    from moe_cluster.node.collective.mlx import EXIT_STALLED

    reports, codes, seconds = _run(("stall",), "mlx", model, timeout_s=STALL_S, wait_s=60)
    reports = reports["stall"]
    assert codes[0] == EXIT_STALLED, (codes, reports)
    assert seconds < 40, (
        seconds
    )  # spawn and load (~10 s on 2 busy cores), then the timeout: rank 1 stays stopped till killed

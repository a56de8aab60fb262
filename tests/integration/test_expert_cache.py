"""The expert cache (issue 18): fewer experts resident than a node holds, misses read from disk,
the tokens and logits still stock mlx-lm's; read errors fail the request naming the file."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from moe_cluster.node.checkpoint import Checkpoint
from moe_cluster.node.engine import generate_tokens
from moe_cluster.node.moe import expert_cache
from moe_cluster.node.moe.expert_cache import ExpertReadError
from moe_cluster.node.describe import describe
from moe_cluster.node.moe.load import load_in_process
from moe_cluster.proto.records import Sampling

from conftest import cli

PROMPT = (1, 17, 42, 99, 7, 200, 3, 55)
STEPS = 12


def _decode(model, steps=STEPS):
    logits: list = []
    tokens = list(generate_tokens(model, PROMPT, Sampling(max_tokens=steps), logits_sink=logits))
    return tokens, logits


@pytest.mark.parametrize("layout,quantize", [("mlx", None), ("hf", 4)])
def test_cache_sizes_give_stock_tokens(make_ckpt, reference, layout, quantize):
    path = make_ckpt("mixtral", layout=layout, quantize=quantize, experts=16)
    ref_tokens, ref_logits = reference(path, PROMPT, STEPS)
    for nodes in (1, 2):
        for cache in ("100%", "50%", "25%"):
            sm = load_in_process(str(path), nodes, expert_cache=cache)
            tokens, logits = _decode(sm.model)
            diff = max(float(np.max(np.abs(a - b))) for a, b in zip(logits, ref_logits))
            assert tokens == ref_tokens and diff <= 1e-4, (nodes, cache, diff)
            totals = sm.state.cache_totals()
            per_layer = 16 // nodes
            want = {"100%": per_layer, "50%": per_layer // 2, "25%": per_layer // 4}[cache]
            assert totals["capacity"] == want * 2  # 2 MoE layers
            if cache == "100%":
                assert totals["misses"] == 0 and totals["bytes_read"] == 0
            else:
                assert totals["misses"] > 0 and totals["bytes_read"] > 0


def test_resident_experts_stay_within_a_byte_budget(make_ckpt, reference):
    path = make_ckpt("qwen3_moe", experts=16)
    per = describe(Checkpoint.open(path)).sizes().per_expert
    budget = 5 * sum(per.values())  # 5 of the 16 experts per layer
    sm = load_in_process(str(path), 1, expert_cache=str(budget))
    shards = [moe.ranks[0].shard for moe in _moes(sm.model)]
    assert sum(s.resident_bytes() for s in shards) <= budget
    assert [s.cache.capacity for s in shards] == [5, 5]
    assert _decode(sm.model)[0] == reference(path, PROMPT, STEPS)[0]


def _moes(model):
    from moe_cluster.node.moe.layer import InProcessCluster

    return [m for _, m in model.named_modules() if isinstance(m, InProcessCluster)]


def _bank_file(path):
    """The file holding layer 0's stacked experts, and their byte range in it."""
    ckpt = Checkpoint.open(path)
    info = next(
        i
        for k, i in sorted(ckpt.tensors.items())
        if "switch_mlp" in k and k.endswith("up_proj.weight")
    )
    return info.file, info.start, info.end


@pytest.mark.parametrize("damage", ["flipped", "truncated", "gone"])
def test_read_error_fails_the_request_naming_the_file(make_ckpt, tmp_path, damage):
    import shutil

    src = make_ckpt("mixtral", experts=16)
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    sm = load_in_process(str(path), 1, expert_cache="25%")
    file, start, end = _bank_file(path)
    if damage == "flipped":  # the non-resident experts' bytes change after the load
        with open(file, "r+b") as f:
            f.seek(start)
            data = bytearray(f.read(end - start))
            f.seek(start)
            f.write(bytes(b ^ 0xFF for b in data))
    elif damage == "truncated":
        os.truncate(file, start + 8)
    else:
        os.unlink(file)
    with pytest.raises(ExpertReadError) as err:
        _decode(sm.model)
    assert str(file) in str(err.value)
    assert {"flipped": "checksum", "truncated": "short read", "gone": "No such file"}[
        damage
    ] in str(err.value)


def test_simulate_json_sums_the_nodes_caches(make_ckpt):
    path = make_ckpt("mixtral", experts=16)
    r = cli(
        "simulate",
        "--model",
        str(path),
        "--nodes",
        "2",
        "--expert-cache",
        "50%",
        "--prompt",
        "hi",
        "--max-tokens",
        "8",
        "--check",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["tokens_match"] and out["max_abs_logit_diff"] <= 1e-4
    assert len(out["tokens"]) == 8 and out["compared_steps"] == 8, out
    cache = out["expert_cache"]
    assert set(cache) == {"capacity", "hits", "misses", "bytes_read"}
    assert cache["capacity"] == 2 * 2 * 4  # nodes x layers x half of 8 local experts
    assert cache["hits"] + cache["misses"] > 0
    bad = cli(
        "simulate", "--model", str(path), "--nodes", "2", "--expert-cache", "150%", "--prompt", "hi"
    )
    assert bad.returncode == 2 and "expert_cache percent" in bad.stderr


def test_more_experts_than_slots_run_in_rounds(make_ckpt, reference):
    path = make_ckpt("mixtral", experts=16)
    sm = load_in_process(
        str(path), 2, expert_cache="1%"
    )  # one slot per layer: every prefill call takes rounds
    tokens, logits = _decode(sm.model)
    ref_tokens, ref_logits = reference(path, PROMPT, STEPS)
    assert tokens == ref_tokens
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(logits, ref_logits)) <= 1e-4
    assert sum(c.rounds for c in sm.state.cache.values()) > 0


def _decode_counted(sm, steps=STEPS):
    """Tokens and logits, with the cache's counters over the decode steps only (as `simulate`)."""
    logits: list = []
    tokens = []
    for n, t in enumerate(
        generate_tokens(sm.model, PROMPT, Sampling(max_tokens=steps), logits_sink=logits)
    ):
        if n == 0:
            sm.state.reset_counters()
        tokens.append(t)
    return tokens, logits


def _heat(path, order, selections=None):
    """A routing profile over 100 tokens whose selections rank every layer's experts in `order`,
    hottest first: `selections(rank)` each (default: 16 for the first, down to 1)."""
    layers = describe(Checkpoint.open(path)).moe_layers()
    count = selections or (lambda rank: len(order) - rank)
    return {l: ([float(count(order.index(e))) for e in range(n)], 100) for l, n in layers.items()}


@pytest.mark.parametrize("nodes", [1, 2])
def test_prefetch_serves_the_next_layers_misses_and_keeps_stock_tokens(make_ckpt, reference, nodes):
    path = make_ckpt("mixtral", experts=16)
    ref_tokens, ref_logits = reference(path, PROMPT, STEPS)
    local = 16 // nodes
    # a profile that ranks the experts backwards from their ids: right or wrong, it only says what
    # to read early, never what to compute
    heat = _heat(path, list(range(15, -1, -1)))
    # auto reads only experts most tokens select; a profile that puts every other expert in 90% of
    # its tokens (the rest in 10%) has such experts on every node, more than its slots hold
    skewed = _heat(path, list(range(15, -1, -1)), lambda rank: 90 if rank % 2 == 0 else 10)
    runs = {}
    # off; one expert; every non-resident expert of the next layer; auto (none selected by half)
    for depth, prof in ((0, heat), (1, heat), (local, heat), (None, heat), ("auto", skewed)):
        sm = load_in_process(
            str(path),
            nodes,
            expert_cache="25%",
            profile=prof,
            prefetch=None if depth == "auto" else depth,
        )
        tokens, logits = _decode_counted(sm)
        diff = max(float(np.max(np.abs(a - b))) for a, b in zip(logits, ref_logits))
        assert tokens == ref_tokens and diff <= 1e-4, (depth, diff)
        runs[depth] = sm.state.cache_totals()
    assert runs[0]["prefetched"] == runs[0]["prefetch_hits"] == 0
    assert runs[None]["prefetched"] == 0 < runs["auto"]["prefetched"]
    assert 0 < runs[1]["prefetched"] and runs[1]["prefetch_hits"] <= runs[1]["misses"]
    assert runs[local]["prefetched"] > runs[local]["misses"] > 0  # the rest were read and dropped
    assert runs[local]["staged_peak_bytes"] > 0
    # Everything the next layer lacks was staged when it began: with reads that finish when started
    # (a pool that reads on the caller's thread, so no timing enters), every decode miss is served
    # by a prefetch (one round per call: top-2 of at most `local` experts, C = local / 4 >= 2).
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(expert_cache, "_POOL", _InlinePool())
        sm = load_in_process(str(path), nodes, expert_cache="25%", profile=heat, prefetch=local)
        tokens, _ = _decode_counted(sm)
    full = sm.state.cache_totals()
    assert (
        tokens == ref_tokens and full["misses"] > 0 and full["prefetch_hits"] == full["misses"]
    ), full


class _InlinePool:
    """A read pool that reads as soon as asked, on the caller's thread."""

    def submit(self, fn, *args):
        from concurrent.futures import Future

        fut = Future()
        try:
            fut.set_result(fn(*args))
        except Exception as exc:  # noqa: BLE001 - handed to whoever waits on it, as a pool would
            fut.set_exception(exc)
        return fut

    def map(self, fn, items):
        return map(fn, items)


def test_a_prefetched_expert_whose_bytes_changed_fails_when_selected(make_ckpt, tmp_path):
    import shutil

    src = make_ckpt("mixtral", experts=16)
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    sm = load_in_process(
        str(path), 1, expert_cache="25%", profile=_heat(path, list(range(16))), prefetch=16
    )
    file, start, end = _bank_file(path)
    with open(file, "r+b") as f:  # every layer-0 expert's bytes change after the load
        f.seek(start)
        data = f.read(end - start)
        f.seek(start)
        f.write(bytes(b ^ 0xFF for b in data))
    with pytest.raises(ExpertReadError, match="checksum") as err:
        _decode(sm.model)
    assert str(file) in str(err.value)


def test_auto_sizes_the_cache_from_the_metal_working_set(make_ckpt, reference, monkeypatch):
    """`auto` on a node: on Metal (device info injected here) the recommended working set less the
    replicated weights and the KV/prompt reserve; on this machine (no Metal, no budget) everything."""
    import moe_cluster.node.moe.load as load
    from moe_cluster.proto.records import DEFAULT_KV_RESERVE, DEFAULT_PROMPT_CACHE

    path = make_ckpt("qwen3_moe", experts=16)
    fp = describe(Checkpoint.open(path)).sizes()
    assert load.metal_info() == {}  # feature-detected: nothing Metal-only runs here
    sm = load_in_process(str(path), 1, expert_cache="auto")
    assert sm.state.cache == {}  # no Metal and no budget given: every expert resident
    ws = fp.replicated + DEFAULT_KV_RESERVE + DEFAULT_PROMPT_CACHE + 5 * sum(fp.per_expert.values())
    monkeypatch.setattr(
        load,
        "metal_info",
        lambda: {
            "device_name": "Apple M2 Ultra",
            "memory_size": 2 * ws,
            "max_recommended_working_set_size": ws,
        },
    )
    sm = load_in_process(str(path), 1, expert_cache="auto")
    assert [c.capacity for c in sm.state.cache.values()] == [
        5,
        5,
    ]  # 5 of the 16 experts per layer fit
    assert _decode(sm.model)[0] == reference(path, PROMPT, STEPS)[0]
    sm = load.load_shard(
        str(path), None, 0, warm_up=False, expert_cache="auto", cache_reserve_bytes=0
    )
    assert (
        sm.state.cache == {}
    )  # the same working set without the caches' reserve holds every expert


def test_bench_decode_measures_the_cache_within_its_budget():
    """`bench decode --expert-cache` rows carry the decode's peak memory (MLX's, per node): the slots
    are the budget, and what the decode holds above the resident weights does not grow with misses."""
    r = cli(
        "bench",
        "decode",
        "--model",
        "demo",
        "--nodes",
        "2",
        "--keepalive",
        "none",
        "--expert-cache",
        "100%,25%",
        "--max-tokens",
        "12",
        "--rounds",
        "1",
        "--json",
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    rows = {(c["expert_cache"], c["profile"]): c for c in json.loads(r.stdout)["expert_cache"]}
    assert set(rows) == {("100%", False), ("100%", True), ("25%", False), ("25%", True)}
    assert all(c["same_tokens"] and c["peak_memory_decode_bytes"] > 0 for c in rows.values()), rows
    full = rows[("100%", False)]
    one_expert = (
        full["resident_expert_bytes"] // full["local"] * 2
    )  # one expert of one layer (per node: local / 2)
    for profile in (False, True):
        quarter = rows[("25%", profile)]
        assert quarter["misses_per_token"] > 0
        assert (
            quarter["resident_expert_bytes"] == full["resident_expert_bytes"] // 4
        )  # the slots: the budget

        def above(c):
            return (
                c["peak_memory_decode_bytes"] - c["resident_weight_bytes"]
            )  # KV cache and activations

        assert above(quarter) <= above(full) + one_expert, (quarter, full)
        assert (
            quarter["peak_memory_decode_bytes"]
            < full["peak_memory_decode_bytes"] - full["resident_expert_bytes"] // 2
        )
    assert (
        rows[("25%", True)]["prefetched_per_token"] > 0
        and rows[("25%", False)]["prefetched_per_token"] == 0
    )
    assert full["staged_peak_bytes"] == 0 and rows[("25%", False)]["staged_peak_bytes"] > 0

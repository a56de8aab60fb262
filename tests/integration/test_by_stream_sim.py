"""Attention by stream in real node processes (the demo model): eight streams at once, each its
owner's, give every stream stock mlx-lm's tokens and logits for that stream alone (float32,
|Δlogit| <= 1e-4), by stream over the envoy at N = 2, and `auto` (the first stream replicated,
the others owned: steps that mix both) over shared memory at N = 3. A lone stream, by stream, is
its owner's alone. Through `up`: tests/cluster/test_by_stream.py."""

from __future__ import annotations

import numpy as np
import pytest

from moe_cluster.coordinator.dev.simulate import run_nodes
from moe_cluster.node.demo import MODEL_DIR
from moe_cluster.node.sim import SimTask, _owner
from moe_cluster.proto.records import Sampling
from test_overlap import TEXTS

TOKENS = 12


@pytest.fixture(scope="module")
def prompts():
    from mlx_lm.tokenizer_utils import load

    tok = load(MODEL_DIR)
    return tuple(tuple(tok.encode(t, add_special_tokens=False)) for t in TEXTS)


@pytest.fixture(scope="module")
def stock(prompts):
    from mlx_lm import load

    from moe_cluster.node.engine import generate_tokens

    model, _ = load(str(MODEL_DIR))
    out = []
    for p in prompts:
        logits: list = []
        tokens = list(generate_tokens(model, p, Sampling(max_tokens=TOKENS), logits_sink=logits))
        out.append((tokens, logits))
    return out


@pytest.mark.parametrize(
    "nodes, transport, attention", [(2, "envoy", "by-stream"), (3, "shm", "auto")]
)
def test_eight_streams_each_get_stock_tokens_and_logits(
    nodes, transport, attention, prompts, stock
):
    tasks = [
        SimTask(
            "demo",
            prompts[0],
            Sampling(max_tokens=TOKENS),
            keepalive="none",
            streams=prompts,
            record_logits=True,
            attention=attention,
        ),
        # one stream alone: its owner's (rank 0), the others lend their experts
        SimTask(
            "demo", prompts[1], Sampling(max_tokens=TOKENS), record_logits=True, attention=attention
        ),
    ]
    (batch, alone) = run_nodes(tasks, nodes, transport=transport)
    for j, (want_tokens, want_logits) in enumerate(stock):
        owner = max(_owner(attention, j, nodes), 0)
        got = batch[owner]
        assert batch[0]["tokens"][j] == want_tokens, (j, batch[0]["tokens"][j], want_tokens)
        logits = got["logits"][j]
        assert len(logits) == TOKENS, (j, owner, len(logits))
        worst = max(float(np.max(np.abs(a - b))) for a, b in zip(logits, want_logits))
        assert worst <= 1e-4, (j, owner, worst)
    assert alone[0]["tokens"] == stock[1][0]
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(alone[0]["logits"], stock[1][1]))
    assert worst <= 1e-4, worst


def test_prompt_lookup_by_stream_speculates_past_a_rotating_window(make_ckpt):
    """`speculative: prompt-lookup` by stream on a family with sliding windows (gpt_oss: 128
    positions): a window rolls back past its first turn, so its room is the step's alone
    (speculate.room) and the owners agree on each step's width. A stream whose prompt crosses
    the window, drafting from its repeats, keeps the tokens and logits it gets without drafts."""
    path = str(make_ckpt("gpt_oss"))
    long = tuple(list(range(5, 25)) * 7)[:124]
    prompts = (long, (7, 8, 9, 10), long[:40])
    tasks = [
        SimTask(
            path,
            prompts[0],
            Sampling(max_tokens=TOKENS),
            keepalive="none",
            streams=prompts,
            record_logits=True,
            attention="by-stream",
            speculative=mode,
            draft_tokens=3,
        )
        for mode in ("off", "prompt-lookup")
    ]
    off, on = run_nodes(tasks, 2, transport="envoy")
    assert on[0]["speculative"] == "prompt-lookup, 3 drafts", on[0]["speculative"]
    assert sum(r["drafted"] for r in on) > 0
    assert on[0]["tokens"] == off[0]["tokens"]
    for j in range(len(prompts)):
        owner = _owner("by-stream", j, 2)
        pairs = zip(on[owner]["logits"][j], off[owner]["logits"][j])
        assert max(float(np.max(np.abs(a - b))) for a, b in pairs) <= 1e-4, j

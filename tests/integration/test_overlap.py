"""Two micro-batches per step in real node processes (2 nodes, the demo model): eight streams
decoded in two interleaved lanes give, token for token and bit for bit in their logits, what the
unsplit step gives. Over the envoy the lanes interleave at each MoE all-reduce (node/overlap.py);
over `transport: mlx` both lanes are one lazy graph."""

from __future__ import annotations

import numpy as np
import pytest

from moe_cluster.coordinator.dev.simulate import run_nodes
from moe_cluster.node.demo import MODEL_DIR
from moe_cluster.node.sim import SimTask
from moe_cluster.proto.records import Sampling

TEXTS = (
    "To be, or not to be, that is the question:",
    "Now is the winter of our discontent",
    "All the world's a stage,",
    "Friends, Romans, countrymen, lend me your ears;",
    "Shall I compare thee to a summer's day?",
    "The quality of mercy is not strained;",
    "If music be the food of love, play on;",
    "O Romeo, Romeo, wherefore art thou Romeo?",
)


@pytest.mark.parametrize("transport", ["envoy", "mlx"])
def test_two_micro_batches_give_the_unsplit_steps_tokens_and_logits(transport):
    from mlx_lm.tokenizer_utils import load

    tok = load(MODEL_DIR)
    prompts = tuple(tuple(tok.encode(t, add_special_tokens=False)) for t in TEXTS)
    tasks = [
        SimTask(
            "demo",
            prompts[0],
            Sampling(max_tokens=20),
            keepalive="none",
            streams=prompts,
            overlap=overlap,
            record_logits=True,
            # one load for both: a node's load-time timing may store the down projection in slices
            # (route.py choose_slices), and two loads could choose differently, bits apart
            reuse_load=overlap,
        )
        for overlap in (False, True)
    ]
    (off, _), (on, _) = run_nodes(tasks, 2, transport=transport)
    assert off["micro_batches"] == "off" and on["micro_batches"] == "2 per step"
    # both lanes ran (over mlx nothing else shows it): every MoE layer once per lane and step
    for report, lanes in ((off, 1), (on, 2)):
        calls = {c["calls"] for c in report["layer_counters"].values()}
        assert calls == {lanes * report["decode_steps"]}, (lanes, calls, report["decode_steps"])
    if transport == "envoy":  # most of 20 steps x 4 MoE layers travelled beside the other lane
        assert on["overlapped"] >= 40 and off["overlapped"] == 0, (on["overlapped"], off)
    assert on["tokens"] == off["tokens"] and all(len(t) == 20 for t in on["tokens"])
    for a, b in zip(on["logits"], off["logits"]):
        assert len(a) == len(b) == 20
        assert all(np.array_equal(x, y) for x, y in zip(a, b))

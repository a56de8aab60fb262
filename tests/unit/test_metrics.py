"""Serving metrics computed from what the nodes report."""

from __future__ import annotations

import pytest

from moe_cluster.coordinator.serve.metrics import prompt_tps
from moe_cluster.proto.records import GenerateDone, Timings


def test_prompt_throughput_counts_only_the_tokens_that_were_prefilled():
    miss = GenerateDone("length", prompt_tokens=120, cached_tokens=0, generated_tokens=8, timings=Timings(prompt_s=2.0))
    hit = GenerateDone("length", prompt_tokens=120, cached_tokens=100, generated_tokens=8, timings=Timings(prompt_s=0.5))
    assert prompt_tps(miss) == pytest.approx(60.0)
    assert prompt_tps(hit) == pytest.approx(40.0)  # 20 tokens in 0.5 s, not 120
    assert prompt_tps(GenerateDone("stop", 5, 0, 0)) == 0.0 and prompt_tps(None) == 0.0

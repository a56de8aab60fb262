"""What a resumed request sends the nodes (coordinator/serve/resume.py), without a cluster."""

from __future__ import annotations

import pytest

from moe_cluster.coordinator.serve.resume import continuation
from moe_cluster.proto.records import GenerateRequest, Sampling


def test_the_first_run_is_the_request_itself():
    req = GenerateRequest(
        "cmpl-1", (5, 6, 7), Sampling(max_tokens=8, temperature=0.7, seed=3), (2,)
    )
    assert continuation(req, [], 0) is req


def test_a_resume_sends_prompt_and_tokens_with_the_rest_due_and_the_sampler_past_its_draws():
    req = GenerateRequest(
        "cmpl-1",
        (5, 6, 7),
        Sampling(max_tokens=8, temperature=0.7, top_p=0.9, seed=3),
        (2,),
        prefill_step=64,
    )
    first = continuation(req, [11, 12, 13], 1)
    assert first.prompt == (5, 6, 7, 11, 12, 13)
    assert first.sampling == Sampling(max_tokens=5, temperature=0.7, top_p=0.9, seed=3, step=3)
    assert (
        first.request_id == "cmpl-1.r1" and first.eos_token_ids == (2,) and first.prefill_step == 64
    )
    # a second resume counts from the original request: every token so far, its own id
    second = continuation(req, [11, 12, 13, 14], 2)
    assert second.prompt == (5, 6, 7, 11, 12, 13, 14) and second.sampling.step == 4
    assert second.sampling.max_tokens == 4 and second.request_id == "cmpl-1.r2"
    second.sampling.check()


def test_a_request_with_every_token_has_nothing_to_resume():
    req = GenerateRequest("cmpl-2", (1,), Sampling(max_tokens=2))
    with pytest.raises(ValueError, match="cmpl-2 has all its 2 tokens"):
        continuation(req, [4, 5], 1)


def test_a_negative_sampler_step_is_refused():
    with pytest.raises(ValueError, match="sampler's step must be an integer >= 0"):
        Sampling(step=-1).check()

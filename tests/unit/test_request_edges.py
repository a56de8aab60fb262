"""Requests at their edges without a server: sampling values normalised once at the coordinator, the
node's sampler at those edges and with one sequence failing, /v1/completions' unsupported options,
the fields Anthropic errors name, and a node's refusal as the client sees it."""

from __future__ import annotations

import math
from types import SimpleNamespace

import mlx.core as mx
import pytest

from moe_cluster.coordinator.serve import anthropic
from moe_cluster.coordinator.serve import openai as openai_api
from moe_cluster.coordinator.serve.api_error import ApiError
from moe_cluster.coordinator.serve.generation import Generation
from moe_cluster.coordinator.serve.api import ServingOptions
from moe_cluster.coordinator.serve.requests import Outcome
from moe_cluster.coordinator.serve.tools import FieldError
from moe_cluster.node.sampling import sample_tokens
from moe_cluster.proto.errors import error_for, ErrorKind
from moe_cluster.proto.records import GenerateRequest, Sampling

OPTIONS = ServingOptions(model_id="m", context_length=4096)


def parse_sampling(body: dict, max_tokens: int) -> Sampling:
    return openai_api.parse_completion({**body, "max_tokens": max_tokens}, OPTIONS).sampling


TINY = [1e-300, 1e-50, 5e-324, 1e-39, 1e-7]  # each under float32's range or under the greedy floor


def _anthropic(**extra) -> dict:
    return {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **extra}


@pytest.mark.parametrize("tiny", TINY)
def test_tiny_top_p_and_temperature_are_greedy_on_every_endpoint(tiny):
    for fields in (
        {"temperature": 0.7, "top_p": tiny},
        {"temperature": tiny},
        {"temperature": tiny, "top_p": 0.5},
    ):
        openai = parse_sampling({"prompt": "x", **fields}, 16)
        claude = anthropic.parse_request(_anthropic(**fields)).sampling
        for s in (openai, claude):
            assert s.temperature == 0.0 and s.top_p == 1.0 and s.greedy, (fields, s)
    sampled = parse_sampling({"prompt": "x", "temperature": 0.7, "top_p": 0.5}, 16)
    assert (sampled.temperature, sampled.top_p) == (0.7, 0.5)  # values inside the range are kept


@pytest.mark.parametrize("name", ["temperature", "top_p"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 1e300, -1e-300, 10**400])
def test_nan_inf_and_out_of_range_are_refused_on_every_endpoint(name, value):
    with pytest.raises((FieldError, ApiError)) as openai:
        parse_sampling({"prompt": "x", name: value}, 16)
    with pytest.raises(FieldError) as claude:
        anthropic.parse_request(_anthropic(**{name: value}))
    for info in (openai, claude):
        assert info.value.param == name and name in str(info.value), str(info.value)


def _seq(sampling: Sampling, key: int = 0):
    return SimpleNamespace(
        req=GenerateRequest("r", (1,), sampling), key=mx.random.key(key), error=None
    )


@pytest.mark.parametrize(
    "sampling",
    [
        Sampling(8, 0.7, 1e-50),
        Sampling(8, 0.7, 1e-300),
        Sampling(8, 1e-39),
        Sampling(8, 1e-300, 0.9),
    ],
)
def test_the_node_samples_edge_values_greedily(sampling):
    """Handed to the node directly (the coordinator maps them first): never past the vocabulary."""
    logprobs = mx.log(mx.softmax(mx.random.normal((4, 1024), key=mx.random.key(3)), axis=-1))
    want = mx.argmax(logprobs, axis=-1).tolist()
    beside = Sampling(8, 1.0, 0.9, 5)  # a sampled neighbour makes every row take the per-row path
    for k in range(10):
        seqs = [
            _seq(sampling, k),
            _seq(beside, k),
            _seq(sampling, k + 100),
            _seq(sampling, k + 200),
        ]
        got = sample_tokens(seqs, logprobs).tolist()
        assert [got[0], got[2], got[3]] == [want[0], want[2], want[3]], (k, got, want)
        assert all(s.error is None for s in seqs)


def test_a_sampler_that_raises_fails_its_own_sequence_only(monkeypatch):
    from moe_cluster.node import sampling

    real = sampling.sample_one

    def poisoned(s, logprobs):
        if s.req.sampling.seed == 666:
            raise RuntimeError("poisoned")
        return real(s, logprobs)

    monkeypatch.setattr(sampling, "sample_one", poisoned)
    logprobs = mx.log(mx.softmax(mx.random.normal((3, 64), key=mx.random.key(1)), axis=-1))
    seqs = [_seq(Sampling(8)), _seq(Sampling(8, 0.5, 1.0, 666)), _seq(Sampling(8))]
    got = sample_tokens(seqs, logprobs).tolist()
    assert got[0] == mx.argmax(logprobs[0]).item() and got[2] == mx.argmax(logprobs[2]).item()
    assert seqs[0].error is None and seqs[2].error is None
    assert isinstance(seqs[1].error, RuntimeError)


def test_a_draw_that_raises_in_a_verified_step_fails_its_own_sequence_only(monkeypatch):
    """The speculative step's sampler (`sample_positions`, one `draw` per verified position): the
    sampled neighbours keep the tokens and keys of a step without the fault."""
    from moe_cluster.node import sampling

    logprobs = mx.log(mx.softmax(mx.random.normal((3, 4, 64), key=mx.random.key(2)), axis=-1))
    batch = [Sampling(8, 0.9, 1.0, 1), Sampling(8, 0.5, 1.0, 666), Sampling(8, 0.9, 0.8, 2)]
    want, want_keys = sampling.sample_positions([_seq(s) for s in batch], logprobs)
    real = sampling.draw

    def poisoned(s, row, key):
        if s.req.sampling.seed == 666:
            raise RuntimeError("poisoned")
        return real(s, row, key)

    monkeypatch.setattr(sampling, "draw", poisoned)
    seqs = [_seq(s) for s in batch]
    got, keys = sampling.sample_positions(seqs, logprobs)
    assert got[0].tolist() == want[0].tolist() and got[2].tolist() == want[2].tolist()
    assert got[1].tolist() == mx.argmax(logprobs[1], axis=-1).tolist()  # greedy in its row
    assert [s.error is None for s in seqs] == [True, False, True]
    assert isinstance(seqs[1].error, RuntimeError) and keys[1] is None
    for i in (0, 2):
        assert [k.tolist() for k in keys[i]] == [k.tolist() for k in want_keys[i]]


@pytest.mark.parametrize(
    "field,value",
    [
        ("echo", 1),
        ("best_of", 2),
        ("best_of", True),
        ("suffix", "end"),
        ("logprobs", 0),
        ("logprobs", 5),
        ("response_format", {"type": "json_object"}),
    ],
)
def test_completions_refuse_what_they_cannot_honour(field, value):
    with pytest.raises(FieldError) as info:
        openai_api.check_unsupported_completion({"prompt": "x", field: value})
    assert info.value.param == field, str(info.value)


def test_completions_take_the_options_they_honour():
    assert (
        openai_api.check_unsupported_completion(
            {
                "prompt": "x",
                "echo": True,
                "best_of": 1,
                "suffix": "",
                "logprobs": None,
                "response_format": {"type": "text"},
            }
        )
        is True
    )
    assert openai_api.check_unsupported_completion({"prompt": "x"}) is False


def test_anthropic_errors_name_the_request_s_own_fields():
    def param(**body) -> str:
        with pytest.raises(FieldError) as info:
            anthropic.parse_request(_anthropic(**body))
        return info.value.param, str(info.value)

    assert param(system=[{"type": "image"}])[0] == "system[0]"
    assert param(system=7)[0] == "system"
    p, text = param(messages=[{"role": "user", "content": "a"}, None])
    assert p == "messages[1].role" and "null" in text and "NoneType" not in text, text
    p, text = param(tools=[{"name": "f", "input_schema": [1]}])
    assert p == "tools[0].input_schema" and "input_schema" in text and "parameters" not in text, (
        text
    )
    turn = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": 5}]}
    assert param(messages=[turn])[0] == "messages[0].content[0].tool_use_id"
    # the chat each field became, named by the request's own fields (the system prompt shifts nothing)
    req = anthropic.parse_request(
        _anthropic(
            system="be brief",
            messages=[
                {"role": "user", "content": "a"},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "r"}],
                },
            ],
        )
    )
    assert [f.get("content") for f in req.fields] == [
        "system",
        "messages[0].content",
        "messages[1].content",
        "messages[2].content[0].content",
    ]
    assert req.fields[3]["tool_call_id"] == "messages[2].content[0].tool_use_id"


def test_anthropic_error_types_by_status():
    assert anthropic.error_body(405, "Method Not Allowed")["error"]["type"] == "not_found_error"
    assert anthropic.error_body(415, "x")["error"]["type"] == "invalid_request_error"
    assert anthropic.error_body(500, "x")["error"]["type"] == "api_error"


def test_too_many_content_blocks_are_refused_before_any_is_checked():
    blocks = [{"type": "text", "text": "a"}] * (anthropic.MAX_BLOCKS + 1)
    with pytest.raises(FieldError) as info:
        anthropic.parse_request(_anthropic(messages=[{"role": "user", "content": blocks}]))
    assert info.value.param == "messages" and str(anthropic.MAX_BLOCKS) in str(info.value)


def test_a_node_s_refusal_reaches_the_client_without_internal_text():
    gen = Generation.__new__(Generation)
    gen.req = GenerateRequest("msg_0123", (1,), Sampling())
    gen.outcome = Outcome(
        error=error_for(
            ErrorKind.INVALID_INPUT,
            "node node-b: INVALID_ARGUMENT: GenerateRequest "
            "msg_0123: top_p must be in (0, 1] (got nan)",
        )
    )
    e = gen.failure()
    assert e.status == 400 and e.type == "invalid_request_error"
    for internal in ("node-b", "INVALID_ARGUMENT", "GenerateRequest", "msg_0123"):
        assert internal not in e.message, e.message


def test_the_metrics_help_no_longer_says_one_request_at_a_time():
    from moe_cluster.coordinator.serve.metrics import Metrics

    cluster = SimpleNamespace(
        status=lambda: {"state": "ready", "queue_depth": 0, "running": 0, "nodes": []},
        allreduce_histograms={},
    )
    text = Metrics().render(cluster)
    assert "moe_cluster_requests_running" in text and "one runs at a time" not in text

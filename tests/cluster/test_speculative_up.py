"""Speculative decoding through `moe-cluster up` (three real node processes over the envoy, real
HTTP): greedy requests give stock mlx-lm's tokens with drafts that hold (a prediction of the
output), with drafts that fail (the prompt's own n-grams) and inside a batch of 8; a seeded
sampled request draws what it draws without drafts; each reply and /metrics count the drafts and
the all-reduces per token; bad speculation fields get a 400 naming them."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from cluster_fixture import cluster, http, stock_tokens, yaml_for
from moe_cluster.node.demo import MODEL_DIR

pytestmark = pytest.mark.slow  # about 25 s

PROMPTS = [
    "To be, or not to be, that is the question:",
    "Now is the winter of our discontent",
    "All the world's a stage,",
    "Friends, Romans, countrymen, lend me your ears;",
]
TOKENS = 32
MOE_LAYERS = json.loads((MODEL_DIR / "config.json").read_text())["num_hidden_layers"]  # all MoE


def _complete(url: str, prompt: str, **body) -> dict:
    status, out = http(url, "/v1/completions", {"prompt": prompt, "max_tokens": TOKENS, **body})
    assert status == 200, out
    return out


def test_speculation_through_up_gives_stock_tokens_and_counts_its_drafts(tmp_path):
    from mlx_lm.tokenizer_utils import load

    tok = load(MODEL_DIR)
    stock = {p: stock_tokens(MODEL_DIR, p, TOKENS) for p in PROMPTS}
    extra = "serving:\n  speculative: prompt-lookup\n  draft_tokens: 4\n  max_batch: 8\n"
    with cluster(tmp_path, yaml_for(3, extra=extra)) as (url, proc, lines):
        nodes = http(url, "/v1/cluster/status")[1]["nodes"]
        assert [n["speculative"] for n in nodes] == ["prompt-lookup, 4 drafts"] * 3, nodes

        # drafts from the prompt alone: few hold, the tokens are stock's all the same
        plain = _complete(url, PROMPTS[0])["moe_cluster"]
        assert plain["tokens"] == stock[PROMPTS[0]]
        assert plain["speculative"]["drafted"] > 0, plain["speculative"]
        # the output as OpenAI's `prediction`: most drafts hold, a step carries several tokens
        predicted = {"type": "content", "content": tok.decode(stock[PROMPTS[0]])}
        fast = _complete(url, PROMPTS[0], prediction=predicted)["moe_cluster"]
        assert fast["tokens"] == stock[PROMPTS[0]]
        spec = fast["speculative"]
        assert (
            spec["accepted"] >= TOKENS // 2 and spec["allreduces_per_token"] <= 0.5 * MOE_LAYERS
        ), spec
        status, chat = http(
            url,
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 8,
                "prediction": predicted,
            },
        )
        assert status == 200 and chat["moe_cluster"]["speculative"]["decode_steps"] > 0, chat

        # eight at once, half with a prediction of their own output, one with drafts off
        def one(i: int) -> tuple[int, dict]:
            p = PROMPTS[i % 4]
            body = (
                {"prediction": {"type": "content", "content": tok.decode(stock[p])}}
                if i >= 4
                else {}
            )
            if i == 7:
                body["draft_tokens"] = 0
            return i, _complete(url, p, **body)["moe_cluster"]

        with ThreadPoolExecutor(8) as pool:
            for i, got in pool.map(one, range(8)):
                assert got["tokens"] == stock[PROMPTS[i % 4]], i
                if i == 7:
                    assert got["speculative"]["drafted"] == 0, got["speculative"]

        # a seeded draw: the same tokens with drafts as without (the same key per emitted token)
        sampled = {"temperature": 0.9, "top_p": 0.95, "seed": 11}
        with_drafts = _complete(url, PROMPTS[1], prediction=predicted, **sampled)["moe_cluster"][
            "tokens"
        ]
        without = _complete(url, PROMPTS[1], draft_tokens=0, **sampled)["moe_cluster"]["tokens"]
        assert with_drafts == without and with_drafts != stock[PROMPTS[1]]

        metrics = http(url, "/metrics")[1]
        counts = {
            line.split()[0]: float(line.split()[1])
            for line in metrics.splitlines()
            if line.startswith("moe_cluster_") and " " in line and "{" not in line
        }
        assert counts["moe_cluster_speculative_accepted_total"] >= spec["accepted"]
        assert (
            counts["moe_cluster_speculative_drafted_total"]
            >= counts["moe_cluster_speculative_accepted_total"]
        )
        assert counts["moe_cluster_decode_allreduces_total"] > 0

        for body, param in (
            ({"draft_tokens": 5}, "draft_tokens"),
            ({"draft_tokens": -1}, "draft_tokens"),
            ({"prediction": "text"}, "prediction"),
            ({"prediction": {"type": "content", "content": 3}}, "prediction.content"),
        ):
            status, err = http(url, "/v1/completions", {"prompt": "x", "max_tokens": 2, **body})
            assert status == 400 and err["error"]["param"] == param, (body, err)


def test_a_draft_model_through_up_guesses_on_the_first_node_only(tmp_path):
    """`speculative: draft` reaches the first node alone (the others read its guesses): with the
    model as its own draft every guess holds and the tokens are stock's."""
    extra = "serving:\n  speculative: draft\n  draft_model: demo\n  draft_tokens: 3\n"
    with cluster(tmp_path, yaml_for(2, extra=extra)) as (url, proc, lines):
        nodes = http(url, "/v1/cluster/status")[1]["nodes"]
        assert [n["speculative"] for n in nodes] == ["draft, 3 drafts"] * 2, nodes
        got = _complete(url, PROMPTS[2])["moe_cluster"]
        assert got["tokens"] == stock_tokens(MODEL_DIR, PROMPTS[2], TOKENS)
        spec = got["speculative"]
        assert (
            spec["accepted"] == spec["drafted"] > 0 and spec["decode_steps"] <= TOKENS // 4 + 2
        ), spec


def test_auto_is_the_default_and_status_shows_acceptance_and_all_reduces_per_token(tmp_path):
    """No `speculative` in cluster.yaml: every node runs `auto`; a request whose `prediction` holds
    its output is decoded at under half the MoE layers' all-reduces per token, stock's tokens;
    requests of different lengths at once all finish with stock's tokens; status, /metrics and the
    dashboard's data give the acceptance and the all-reduces per token."""
    from mlx_lm.tokenizer_utils import load

    tok = load(MODEL_DIR)
    stock = {p: stock_tokens(MODEL_DIR, p, TOKENS) for p in PROMPTS}
    with cluster(tmp_path, yaml_for(2)) as (url, proc, lines):
        status = http(url, "/v1/cluster/status")[1]
        assert [n["speculative"] for n in status["nodes"]] == [
            "auto, 4 drafts, MTP experts whole"
        ] * 2, status
        assert status["speculative"]["drafted"] == 0, status["speculative"]
        predicted = {"type": "content", "content": tok.decode(stock[PROMPTS[0]])}
        fast = _complete(url, PROMPTS[0], prediction=predicted)["moe_cluster"]
        assert fast["tokens"] == stock[PROMPTS[0]]
        assert fast["speculative"]["allreduces_per_token"] <= 0.5 * MOE_LAYERS, fast

        def one(i: int) -> tuple[int, list[int], list[int]]:  # 1 to 32 tokens, at once
            n = [1, 5, 32, 12, 2, 32, 7, 20][i]
            out = _complete(url, PROMPTS[i % 4], max_tokens=n)["moe_cluster"]["tokens"]
            return i, out, stock[PROMPTS[i % 4]][:n]

        with ThreadPoolExecutor(8) as pool:
            for i, got, want in pool.map(one, range(8)):
                assert got == want, i

        spec = http(url, "/v1/cluster/status")[1]["speculative"]
        assert spec["drafted"] >= spec["accepted"] >= TOKENS // 2, spec
        assert 0 < spec["acceptance"] <= 1 and 0 < spec["allreduces_per_token"] < MOE_LAYERS, spec
        metrics = http(url, "/metrics")[1]
        gauges = dict(
            line.split()
            for line in metrics.splitlines()
            if line.startswith("moe_cluster_") and "{" not in line
        )
        assert float(gauges["moe_cluster_speculative_acceptance"]) == pytest.approx(
            spec["acceptance"], abs=1e-3
        )
        assert float(gauges["moe_cluster_decode_allreduces_per_token"]) == pytest.approx(
            spec["allreduces_per_token"], abs=1e-3
        )


def test_the_demos_mtp_layer_drafts_through_up_with_stock_tokens(tmp_path):
    """`speculative: mtp` on the demo (its trained MTP head): every node says so, a lone request
    and a batch give stock's tokens, and the drafts hold."""
    stock = {p: stock_tokens(MODEL_DIR, p, TOKENS) for p in PROMPTS}
    extra = "serving:\n  speculative: mtp\n  draft_tokens: 2\n  max_batch: 8\n"
    with cluster(tmp_path, yaml_for(2, extra=extra)) as (url, proc, lines):
        nodes = http(url, "/v1/cluster/status")[1]["nodes"]
        assert [n["speculative"] for n in nodes] == ["mtp, 2 drafts, MTP experts whole"] * 2, nodes
        alone = _complete(url, PROMPTS[0])["moe_cluster"]
        assert alone["tokens"] == stock[PROMPTS[0]]
        spec = alone["speculative"]
        assert spec["accepted"] >= 0.4 * spec["drafted"] > 0, spec
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            outs = list(pool.map(lambda p: _complete(url, p)["moe_cluster"], PROMPTS))
        assert [o["tokens"] for o in outs] == [stock[p] for p in PROMPTS]

"""`up` with an expert cache (issue 18): a node whose memory cannot hold its share of the experts is
served, not refused; it keeps what fits resident, reads the rest from disk, and the tokens stay
stock mlx-lm's. Its cache counters reach `status` and /metrics."""

from __future__ import annotations

import re

import sys
import time
from pathlib import Path

from cluster_fixture import cluster, http, stock_tokens, yaml_for

sys.path.insert(0, str(Path(__file__).parents[1] / "families"))
import tiny  # noqa: E402

PROMPT = "To be, or not to be"
TOKENS = 10


def _settled(url: str) -> dict:
    """The nodes' status once the request's counters have reached it (the coordinator refreshes a
    node's status in the background after each request): two reads 0.3 s apart that agree."""

    def read():
        return {n["name"]: n for n in http(url, "/v1/cluster/status")[1]["nodes"]}

    last = read()
    for _ in range(30):
        time.sleep(0.3)
        now = read()
        if now["node-1"]["expert_cache"] == last["node-1"]["expert_cache"] and any(
            c["hits"] + c["misses"] for c in now["node-1"]["expert_cache"]
        ):
            return now
        last = now
    raise AssertionError("node-1's expert cache counters did not settle")


def test_a_node_short_of_memory_is_served_with_stock_tokens(tmp_path):
    from moe_cluster.node.checkpoint import Checkpoint
    from moe_cluster.node.describe import describe

    path = tiny.make_checkpoint("qwen3_moe", tmp_path / "model", tokenizer=True)
    fp = describe(Checkpoint.open(path)).sizes()
    share = sum(
        n // 2 * fp.per_expert[l] for l, n in fp.num_experts.items()
    )  # an even split's half
    small = fp.replicated + share // 4  # room for a quarter of its share
    config = (
        yaml_for(
            2,
            str(path),
            extra="""placement:
  strategy: even
  memory_fraction: 1.0
  kv_reserve: 0
  expert_cache: auto
serving:
  prompt_cache: 0
""",
        )
        .replace("  - name: node-0", "  - name: node-0\n    memory: 1GB")
        .replace("  - name: node-1", f"  - name: node-1\n    memory: {small}")
    )
    with cluster(tmp_path, config) as (url, proc, lines):
        status, body = http(
            url, "/v1/completions", {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}
        )
        assert status == 200, body
        nodes = _settled(url)
        metrics = http(url, "/metrics")[1]
    assert body["moe_cluster"]["tokens"] == stock_tokens(path, PROMPT, TOKENS)
    (warning,) = [line for line in lines if line.startswith("placement: node-1 holds")]
    # it says what the node reads from disk per token and the speed that bounds it to
    assert "read from disk" in warning and "uniform routing" in warning, warning
    assert re.search(r"at most [\d.]+–[\d.]+ tok/s from a 4–6 GB/s SSD alone", warning), warning
    assert nodes["node-0"]["expert_cache"] == []  # everything fits: no cache
    cache = nodes["node-1"]["expert_cache"]
    assert cache and all(c["capacity"] < c["local"] for c in cache)
    assert sum(c["misses"] for c in cache) > 0 and sum(c["bytes_read"] for c in cache) > 0
    assert 'moe_cluster_expert_cache_misses_total{node="node-1"' in metrics

    # with a routing profile of this very prompt the node starts with its hottest experts pinned
    # (the profile travels in the Load): the same tokens, fewer misses
    from conftest import cli

    (tmp_path / "prompts.txt").write_text(PROMPT + "\n")
    r = cli(
        "profile",
        "--model",
        str(path),
        "--prompts",
        str(tmp_path / "prompts.txt"),
        "--out",
        str(tmp_path / "profile.json"),
        "--max-tokens",
        str(TOKENS),
    )
    assert r.returncode == 0, r.stderr
    profiled = config.replace(
        "  expert_cache: auto", "  expert_cache: auto\n  profile: profile.json"
    )
    with cluster(tmp_path, profiled) as (url, proc, lines):
        status, again = http(
            url, "/v1/completions", {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}
        )
        pinned = _settled(url)["node-1"]["expert_cache"]
        metrics = http(url, "/metrics")[1]
    assert status == 200 and again["moe_cluster"]["tokens"] == body["moe_cluster"]["tokens"]
    assert any(
        line.startswith("placement: node-1 holds") and "the routing profile" in line
        for line in lines
    ), lines
    assert sum(c["misses"] for c in pinned) < sum(c["misses"] for c in cache), (pinned, cache)
    # the prefetch reports what it read: auto reads only experts most profiled tokens select, none
    # on this tiny model's flat routing (tests/integration/test_expert_cache.py drives the reads)
    assert all(c["prefetched"] == 0 and c["prefetch_hits"] == 0 for c in pinned), pinned
    assert 'moe_cluster_expert_cache_prefetched_total{node="node-1"' in metrics

"""Attention by stream (serving.attention: by-stream) through `up` with real node processes: each
stream's owner alone attends for it, every node computes its experts for every stream.

Over the envoy (one cluster for the module): eight streams at once with joins, a leaver and a
stop, each with stock mlx-lm's tokens, both nodes attending; a follow-up lands on the node whose
prompt cache holds its prefix; a node killed while nine streams decode, each completing with the
tokens it got without the fault. Over the mlx ring: streams at once equal stock.
(The arithmetic against stock for every family: tests/families/test_sweep.py; the pure decisions:
tests/unit/test_agreement.py.)"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import aiohttp
import pytest

from cluster_fixture import cluster, http, stock_tokens, yaml_for
from faults import FAST_YAML, Phases
from moe_cluster.node.demo import MODEL_DIR
from test_batching import PROMPTS, _run, _together

pytestmark = pytest.mark.slow

YAML = yaml_for(
    2,
    extra="""serving:
  attention: by-stream
  prefill_chunk: 32
  prefill_budget: 32
  max_batch: 8
  queue: 64
""",
)


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    with cluster(tmp_path_factory.mktemp("by-stream"), YAML) as (url, proc, lines):
        yield url


def _watch_streams(url: str, stop: threading.Event, seen: list) -> threading.Thread:
    """Note each node's running streams (status) until `stop`."""

    def run():
        while not stop.is_set():
            nodes = http(url, "/v1/cluster/status")[1]["nodes"]
            seen.append([n["streams"] for n in nodes])
            time.sleep(0.05)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_eight_streams_by_stream_get_stock_tokens_on_both_nodes(api):
    status = http(api, "/v1/cluster/status")[1]
    assert status["attention"] == "by-stream"
    bodies = [
        {"prompt": p, "max_tokens": 12 + 3 * i, "temperature": 0, "stream": i % 2 == 0}
        for i, p in enumerate(PROMPTS)
    ]
    want = [stock_tokens(MODEL_DIR, b["prompt"], b["max_tokens"]) for b in bodies]
    seen: list = []
    stop = threading.Event()
    watcher = _watch_streams(api, stop, seen)
    try:
        together = _together(api, bodies)
    finally:
        stop.set()
        watcher.join(5)
    for i, (got, w) in enumerate(zip(together, want)):
        assert got["status"] == 200 and got["tokens"] == w, (i, got, w)
    # each node attended for some of them at once (the coordinator spreads them by KV room)
    assert any(min(s) >= 2 for s in seen), seen
    assert max(max(s) for s in seen) <= 8  # max_batch per node


def test_joins_a_leaver_and_a_stop_by_stream(api):
    """A stream runs throughout; one client leaves mid-batch, one ends on its stop string, one
    joins later: each gets its own tokens, and the one running throughout is untouched."""
    runner = {"prompt": PROMPTS[0], "max_tokens": 48, "temperature": 0, "stream": True}
    joiner = {"prompt": PROMPTS[5], "max_tokens": 16, "temperature": 0}
    status, full = http(
        api, "/v1/completions", {"prompt": PROMPTS[6], "max_tokens": 40, "temperature": 0}
    )
    assert status == 200, full
    text = full["choices"][0]["text"]
    cut_at = text[len(text) // 2 : len(text) // 2 + 3]
    assert cut_at.strip(), text
    stopper = {"prompt": PROMPTS[6], "max_tokens": 40, "temperature": 0, "stop": [cut_at]}

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            first = asyncio.create_task(_run(session, api, runner))
            stopped = asyncio.create_task(session.post(api + "/v1/completions", json=stopper))
            leaver = await session.post(
                api + "/v1/completions", json={**runner, "prompt": PROMPTS[1], "max_tokens": 2000}
            )
            await leaver.content.readline()
            await asyncio.sleep(0.3)
            leaver.close()
            joined = await _run(session, api, joiner)
            async with await stopped as r:
                cut = (await r.json())["choices"][0]
            return await first, joined, cut

    first, joined, cut = asyncio.run(main())
    assert cut["finish_reason"] == "stop" and cut["text"] == text[: text.index(cut_at)], cut
    assert first["tokens"] == stock_tokens(MODEL_DIR, runner["prompt"], 48)
    assert joined["tokens"] == stock_tokens(MODEL_DIR, joiner["prompt"], 16)
    deadline = time.monotonic() + 10
    while http(api, "/v1/cluster/status")[1]["queue_depth"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [n["streams"] for n in http(api, "/v1/cluster/status")[1]["nodes"]] == [0, 0]


def test_a_follow_up_goes_to_the_node_holding_its_prefix(api):
    """Node 0 busy with one long stream, a first turn goes to node 1 (the most KV room); then node
    1 gets a longer stream than node 0's, so KV room alone would send the next turn to node 0: the
    follow-up still goes to node 1, whose prompt cache holds the first turn (its cached tokens)."""
    busy = {"prompt": PROMPTS[2], "max_tokens": 300, "temperature": 0, "stream": True}
    # a prompt no earlier test sent: no prompt cache holds any of it yet
    first = {"prompt": f"{time.time_ns()} " + PROMPTS[4], "max_tokens": 16, "temperature": 0}

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            log: list = []
            on0 = asyncio.create_task(_run(session, api, busy, log))
            while not log:
                await asyncio.sleep(0.02)
            async with session.post(api + "/v1/completions", json=first) as r:
                turn = await r.json()
            longer = {**busy, "prompt": PROMPTS[7], "max_tokens": 600}
            log1: list = []
            on1 = asyncio.create_task(_run(session, api, longer, log1))
            while not log1:
                await asyncio.sleep(0.02)
            nodes = (await (await session.get(api + "/v1/cluster/status")).json())["nodes"]
            follow = {
                "prompt": first["prompt"] + turn["choices"][0]["text"] + " And then",
                "max_tokens": 8,
                "temperature": 0,
            }
            async with session.post(api + "/v1/completions", json=follow) as r:
                again = await r.json()
            on0.cancel(), on1.cancel()
            return turn, nodes, again

    turn, nodes, again = asyncio.run(main())
    assert [n["streams"] for n in nodes] == [1, 1], nodes
    assert nodes[1]["kv_tokens"] > nodes[0]["kv_tokens"], nodes  # room alone: node 0
    assert turn["moe_cluster"]["cached_tokens"] == 0
    # node 1's prompt cache held the first turn's prompt and answer: only the rest was prefilled
    assert again["moe_cluster"]["cached_tokens"] >= len(turn["moe_cluster"]["tokens"]), again


def test_a_node_killed_while_streams_decode_by_stream(tmp_path):
    """The dead owner's streams resume on the rebuilt cluster with the tokens they would have had
    (faults.py's decode phase: nine streams, one with a late stop string, one seeded)."""
    yaml = yaml_for(2, extra=FAST_YAML + "  attention: by-stream\n")
    with cluster(tmp_path, yaml) as (url, proc, lines):
        victim = http(url, "/v1/cluster/status")[1]["nodes"][1]
        phases = Phases(
            url,
            "node killed, by stream",
            victim["name"],
            "node killed",
            lambda: os.kill(victim["pid"], signal.SIGKILL),
            log=lines,
        )
        phases.decode()


def test_ring_streams_by_stream_equal_stock(tmp_path):
    yaml = yaml_for(2, extra="transport: mlx\nserving:\n  attention: by-stream\n")
    bodies = [
        {"prompt": p, "max_tokens": 10, "temperature": 0, "stream": i % 2 == 0}
        for i, p in enumerate(PROMPTS[:4])
    ]
    with cluster(tmp_path, yaml) as (url, proc, lines):
        together = _together(url, bodies)
    for b, got in zip(bodies, together):
        assert got["status"] == 200, got
        assert got["tokens"] == stock_tokens(MODEL_DIR, b["prompt"], 10), (b, got)

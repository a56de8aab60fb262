"""Continuous batching through real HTTP on a 2-node cluster (`up`, envoys): many requests at once,
each with the tokens it gets alone; joins, leaves and cancels mid-batch; a long prompt prefilled
beside running streams within the step budget; a node killed mid-batch, with resuming turned off
(serving.max_resumes: 0), fails every request with 503 (tests/cluster/test_faults.py resumes them).

The cluster runs two micro-batches per step (serving.overlap, node/overlap.py): a request alone
decodes in one lane, eight at once in two whose all-reduces interleave, and each gets the tokens
it gets alone."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import aiohttp
import pytest

from cluster_fixture import cluster, http, yaml_for

CHUNK = 32  # prefill chunk and per-step prefill budget: the long prompt below takes ~40 steps
YAML = yaml_for(
    2,
    extra=f"""serving:
  prefill_chunk: {CHUNK}
  prefill_budget: {CHUNK}
  max_batch: 8
  queue: 64
  overlap: true
""",
)
PROMPTS = [
    "To be, or not to be, that is the question:",
    "Friends, Romans, countrymen, lend me your ears;",
    "Now is the winter of our discontent",
    "All the world's a stage,",
    "Shall I compare thee to a summer's day?",
    "If music be the food of love, play on;",
    "Once more unto the breach, dear friends, once more;",
    "The quality of mercy is not strained;",
]


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    with cluster(tmp_path_factory.mktemp("batching"), YAML) as (url, proc, lines):
        yield url


async def _run(
    session: aiohttp.ClientSession, url: str, body: dict, log: list | None = None
) -> dict:
    """One completion; streamed ones note when each piece came. -> {"tokens", "text", "times", "status"}."""
    stream = body.get("stream", False)
    async with session.post(url + "/v1/completions", json=body) as r:
        if not stream:
            out = await r.json()
            if r.status != 200:
                return {"status": r.status, "body": out}
            return {
                "status": 200,
                "tokens": out["moe_cluster"]["tokens"],
                "text": out["choices"][0]["text"],
                "done": time.monotonic(),
            }
        times, tokens, error = [], None, None
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]
                continue
            times.append(time.monotonic())
            if log is not None:
                log.append(times[-1])
            if "moe_cluster" in event:
                tokens = event["moe_cluster"]["tokens"]
        return {
            "status": r.status,
            "tokens": tokens,
            "times": times,
            "error": error,
            "done": time.monotonic(),
        }


def _together(url: str, bodies: list[dict]) -> list[dict]:
    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            return await asyncio.gather(*(_run(session, url, b) for b in bodies))

    return asyncio.run(main())


def _alone(url: str, body: dict) -> list[int]:
    status, out = http(url, "/v1/completions", {**body, "stream": False})
    assert status == 200, out
    return out["moe_cluster"]["tokens"]


def test_eight_concurrent_requests_get_the_tokens_they_get_alone(api):
    nodes = http(api, "/v1/cluster/status")[1]["nodes"]
    assert [n["micro_batches"] for n in nodes] == ["2 per step"] * 2, nodes
    bodies = [
        {"prompt": p, "max_tokens": 24 + 4 * i, "temperature": 0, "stream": i % 2 == 0}
        for i, p in enumerate(PROMPTS)
    ]
    greedy3 = bodies[3]
    bodies[3] = {**bodies[3], "temperature": 0.9, "top_p": 0.9, "seed": 11}  # seeded sampling too
    alone = [_alone(api, b) for b in bodies]
    assert alone[3] != _alone(api, greedy3), "the seeded request drew the greedy answer"
    assert [len(t) for t in alone] == [b["max_tokens"] for b in bodies], alone
    together = _together(api, bodies)
    for i, (got, want) in enumerate(zip(together, alone)):
        assert got["status"] == 200 and got["tokens"] == want, (i, got, want)
    # they ran together, not one after another: every stream had its first token before any finished
    streams = [r for r in together if r.get("times")]
    assert max(r["times"][0] for r in streams) < min(r["done"] for r in together)


def test_requests_join_and_leave_mid_batch(api):
    """A client that leaves frees its slot within a step; a request cancelled by its stop string ends
    mid-batch; one that joins later gets its own tokens; the one running throughout is untouched."""
    runner = {"prompt": PROMPTS[0], "max_tokens": 64, "temperature": 0, "stream": True}
    joiner = {"prompt": PROMPTS[5], "max_tokens": 16, "temperature": 0}
    want_runner, want_joiner = _alone(api, runner), _alone(api, joiner)
    status, full = http(
        api, "/v1/completions", {"prompt": PROMPTS[6], "max_tokens": 48, "temperature": 0}
    )
    assert status == 200, full
    text = full["choices"][0]["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # somewhere in the middle of its answer
    assert stop.strip(), text
    stopper = {"prompt": PROMPTS[6], "max_tokens": 48, "temperature": 0, "stop": [stop]}

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            first = asyncio.create_task(_run(session, api, runner))
            stopped = asyncio.create_task(session.post(api + "/v1/completions", json=stopper))
            leaver = await session.post(
                api + "/v1/completions", json={**runner, "prompt": PROMPTS[1], "max_tokens": 2000}
            )
            await leaver.content.readline()  # it streams...
            await asyncio.sleep(0.5)
            leaver.close()  # ...and its client goes away mid-batch
            left = time.monotonic()
            while time.monotonic() - left < 10:
                async with session.get(api + "/v1/cluster/status") as r:
                    if (await r.json())["queue_depth"] <= 1:
                        break
                await asyncio.sleep(0.05)
            freed = time.monotonic() - left
            joined = await _run(session, api, joiner)
            async with await stopped as r:
                cut = (await r.json())["choices"][0]
            return await first, joined, freed, cut

    first, joined, freed, cut = asyncio.run(main())
    assert cut["finish_reason"] == "stop" and cut["text"] == text[: text.index(stop)], (
        cut,
        stop,
        text,
    )
    assert first["tokens"] == want_runner
    assert joined["tokens"] == want_joiner
    # freed within a few dozen of the batch's steps (the runner's mean time per token, which a
    # loaded machine stretches alike; its events come in bursts, so not the gap between two),
    # where a slot never freed would run its 2,000 tokens
    step = (first["times"][-1] - first["times"][0]) / (len(first["times"]) - 1)
    assert freed < 40 * step, (
        f"the slot of a client that left was freed after {freed:.2f} s ({freed / step:.0f} steps)"
    )


def test_a_long_prompt_joins_while_others_stream_within_the_step_budget(api):
    long_prompt = " ".join(PROMPTS) * 6  # ~1,300 tokens: ~40 prefill chunks of CHUNK
    runner = {"prompt": PROMPTS[2], "max_tokens": 400, "temperature": 0, "stream": True}
    joiner = {"prompt": long_prompt, "max_tokens": 4, "temperature": 0, "stream": True}

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            logs = [[], []]
            runs = [asyncio.create_task(_run(session, api, runner, logs[i])) for i in range(2)]
            while len(logs[0]) < 8 or len(logs[1]) < 8:
                await asyncio.sleep(0.02)
            t0 = time.monotonic()
            long = await _run(session, api, joiner)
            t1 = long["times"][0]  # its first token: the prefill is over
            done = await asyncio.gather(*runs)
            return done, long, t0, t1, logs

    done, long, t0, t1, logs = asyncio.run(main())
    assert long["tokens"] == _alone(api, joiner)
    prefill_s = t1 - t0
    for log, r in zip(logs, done):
        assert r["tokens"] and len(r["tokens"]) == 400
        during = [b - a for a, b in zip(log, log[1:]) if t0 <= b <= t1]
        assert len(during) >= 5, "the streams stalled while the long prompt was prefilled"
        # one chunk per step beside decoding: no gap near the whole prefill's time
        assert max(during) < prefill_s / 4, (max(during), prefill_s)


def test_a_node_killed_mid_batch_without_resumes_fails_every_request_with_503(tmp_path):
    with cluster(tmp_path, YAML + "  max_resumes: 0\n") as (api, proc, lines):
        _kill_mid_batch(api)


def _kill_mid_batch(api: str) -> None:
    victim = http(api, "/v1/cluster/status")[1]["nodes"][1]
    bodies = [
        {"prompt": p, "max_tokens": 3000, "temperature": 0, "stream": i % 2 == 1}
        for i, p in enumerate(PROMPTS[:4])
    ]

    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
            log: list = []
            runs = [asyncio.create_task(_run(session, api, b, log)) for b in bodies]
            while len(log) < 10:
                await asyncio.sleep(0.02)
            os.kill(victim["pid"], signal.SIGKILL)
            return await asyncio.gather(*runs)

    t0 = time.monotonic()
    results = asyncio.run(main())
    assert time.monotonic() - t0 < 60
    for b, r in zip(bodies, results):
        if b["stream"]:  # the stream had started (200): its last event is the error
            assert r["error"] and r["error"]["type"] == "service_unavailable", (
                r
            )  # the 503 of a lost node
        else:
            assert r["status"] == 503, r

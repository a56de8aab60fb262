"""The node's prompt cache and chunked prefill, on the demo model in one process (LocalCollective)."""

from __future__ import annotations

import numpy as np
import pytest

from moe_cluster.node.collective.base import TOKEN_LAYER, LocalCollective
from moe_cluster.node.demo import MODEL_DIR
from moe_cluster.proto.records import Sampling
from moe_cluster.node.runtime import GenerateResult, NodeRuntime
from moe_cluster.proto.records import GenerateRequest
from moe_cluster.node.moe.load import load_shard, set_collective

N = 12  # tokens generated per request (no EOS: every request runs to N)


@pytest.fixture(scope="module")
def sharded():
    return load_shard("demo", None, 0, collective=LocalCollective())


@pytest.fixture(scope="module")
def encode():
    from mlx_lm.tokenizer_utils import load

    tok = load(MODEL_DIR)
    return lambda text: tok.encode(text, add_special_tokens=False)


def run(
    rt: NodeRuntime,
    prompt: list[int],
    n: int = N,
    cancel_after: int | None = None,
    prefill_step: int = 512,
) -> GenerateResult:
    asked = [0]

    def should_cancel() -> (
        bool
    ):  # asked before the prefill, after each of its chunks, and per token
        asked[0] += 1
        return cancel_after is not None and asked[0] > cancel_after

    result = GenerateResult()
    req = GenerateRequest(
        f"r{id(result)}",
        tuple(prompt),
        Sampling(max_tokens=n),
        prefill_step=prefill_step,
        record_logits=True,
    )
    for _ in rt.generate(req, should_cancel, result):
        pass
    return result


def assert_stock(result: GenerateResult, prompt: list[int], reference) -> None:
    """The same tokens as stock mlx-lm without any cache, and the same logits (float32: to rounding)."""
    tokens, logits = reference(MODEL_DIR, tuple(prompt), len(result.tokens))
    assert result.tokens == tokens
    assert max(float(np.abs(a - b).max()) for a, b in zip(result.logits, logits)) < 1e-4


def entries(rt: NodeRuntime) -> list[int]:
    """Token counts of the cached sequences, least recently used first."""
    return [len(tokens) for lru in rt.prompt_cache.entries._lru._lrus.values() for _, tokens in lru]


def test_a_follow_up_prefills_only_its_suffix_and_gives_stock_tokens(sharded, encode, reference):
    rt = NodeRuntime(sharded, prompt_cache_bytes=1 << 30)
    first = encode("To be, or not to be, that is the question:")
    r1 = run(rt, first)
    assert r1.cached_tokens == 0 and len(r1.tokens) == N
    # the next turn repeats the whole first turn, generated tokens included, and adds to it
    follow = first + r1.tokens + encode("\nWhether 'tis nobler in the mind to suffer")
    r2 = run(rt, follow)
    assert r2.cached_tokens == len(first) + N
    assert_stock(r2, follow, reference)
    # a prompt that leaves the cached sequence part-way reuses the common prefix only
    branch = first[:-3] + encode(" and then")
    r3 = run(rt, branch)
    assert r3.cached_tokens == len(first) - 3
    assert_stock(r3, branch, reference)


def test_a_continued_conversation_keeps_one_entry(sharded, encode):
    rt = NodeRuntime(sharded, prompt_cache_bytes=1 << 30)
    prompt = encode("Now is the winter of our discontent")
    for turn in range(3):
        r = run(rt, prompt)
        assert r.cached_tokens == (len(prompt) - len(encode(" Speak.")) if turn else 0)
        prompt = prompt + r.tokens
        assert entries(rt) == [
            len(prompt)
        ]  # the parent was dropped when its continuation was stored
        prompt = prompt + encode(" Speak.")
    run(rt, encode("Friends, Romans, countrymen"))
    assert len(entries(rt)) == 2  # an unrelated conversation is a second entry


def test_entries_are_evicted_least_recently_used_within_the_byte_budget(sharded, encode):
    probe = NodeRuntime(sharded, prompt_cache_bytes=1 << 30)
    run(probe, encode("A horse!"))
    entry = probe.prompt_cache.nbytes  # bytes of one short conversation (well under 256 tokens)
    budget = int(2.5 * entry)
    rt = NodeRuntime(sharded, prompt_cache_bytes=budget)
    a, b, c = (
        encode("A horse! a horse!"),
        encode("Out, damned spot!"),
        encode("Double, double toil"),
    )
    ra = run(rt, a)
    run(rt, b)
    a2 = a + ra.tokens + encode(" my kingdom")
    assert run(rt, a2).cached_tokens == len(a) + N  # A is used again: B is now the least recent
    run(rt, c)  # a third entry does not fit: B goes
    assert len(entries(rt)) == 2 and rt.prompt_cache.nbytes <= budget
    assert run(rt, b).cached_tokens == 0
    assert run(rt, c).cached_tokens == len(c) - 1


def test_a_cancelled_request_leaves_an_entry_that_continues_correctly(sharded, encode, reference):
    rt = NodeRuntime(sharded, prompt_cache_bytes=1 << 30)
    first = encode("Tomorrow, and tomorrow, and tomorrow,")
    r1 = run(rt, first, n=40, cancel_after=5)
    assert r1.cancelled and 0 < len(r1.tokens) < 40
    follow = first + r1.tokens + encode(" Creeps in this petty pace")
    r2 = run(rt, follow)
    assert r2.cached_tokens == len(first) + len(r1.tokens)
    # the cache held one fed token more than was handed out; continuing from it shifted positions
    assert_stock(r2, follow, reference)


def test_a_cancel_during_the_prefill_stops_it_within_a_chunk_and_keeps_what_it_did(
    sharded, encode, reference
):
    rt = NodeRuntime(sharded, prompt_cache_bytes=1 << 30)
    prompt = encode(
        "Is this a dagger which I see before me, the handle toward my hand? Come, let me clutch thee."
    )
    chunk = 4
    assert len(prompt) > 5 * chunk
    # asked before the first chunk and after each: the third ask comes after two chunks
    r1 = run(rt, prompt, cancel_after=2, prefill_step=chunk)
    assert r1.cancelled and r1.tokens == [] and r1.stats.finish_reason == "cancelled"
    assert entries(rt) == [2 * chunk]  # the prefill stopped there, and what it did is kept
    r2 = run(rt, prompt, prefill_step=chunk)
    assert r2.cached_tokens == 2 * chunk
    assert_stock(r2, prompt, reference)


class RecordingCollective(LocalCollective):
    """One node alone that remembers how many values each MoE all-reduce carried."""

    def __init__(self):
        self.sizes: list[int] = []

    def all_reduce(self, partial, layer):
        if layer != TOKEN_LAYER:
            self.sizes.append(partial.size)
        return partial


@pytest.mark.parametrize("chunk", [16, 24])
def test_chunked_prefill_bounds_every_all_reduce(chunk, sharded, encode, reference):
    hidden = sharded.config["hidden_size"]
    prompt = encode(
        "Friends, Romans, countrymen, lend me your ears; I come to bury Caesar, not to praise "
        "him. The evil that men do lives after them; the good is oft interred with their bones."
    )
    assert len(prompt) > 2 * chunk
    rec = RecordingCollective()
    set_collective(sharded, rec)
    try:
        r = run(NodeRuntime(sharded), prompt, prefill_step=chunk)
    finally:
        set_collective(sharded, LocalCollective())
    assert max(rec.sizes) == chunk * hidden  # full chunks, never more
    layers = len(sharded.blocks)
    prefill_calls = -(-(len(prompt) - 1) // chunk) + 1  # the chunks, then the last prompt token
    assert len(rec.sizes) == layers * (prefill_calls + N)
    assert_stock(r, prompt, reference)

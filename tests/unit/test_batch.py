"""The running batch in one process (demo model, LocalCollective): sequences stepped together give
stock mlx-lm's tokens and logits, join in arrival order, and wait while the KV budget is spent."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from conftest import bf16_logit_bound
from sampling_law import chi2_critical, sampling_probs

from moe_cluster.node.batch import BatchLimits
from moe_cluster.node.kv import kv_bytes_per_token
from moe_cluster.node.collective.base import Capabilities, LocalCollective
from moe_cluster.node.demo import MODEL_DIR
from moe_cluster.node.moe.load import load_shard
from moe_cluster.node.runtime import GenerateResult, NodeRuntime
from moe_cluster.proto.records import GenerateRequest, Sampling

PROMPTS = (
    "To be, or not to be, that is the question:",
    "Now is the winter of our discontent",
    "All the world's a stage,",
    "Friends, Romans, countrymen, lend me your ears;",
)


@pytest.fixture(scope="module", params=["cluster path", "single-node fallback"])
def sharded(request):
    """The cluster path at N = 1 (ExpertShards), and what a lone node serves: the stock model."""
    if request.param == "cluster path":
        return load_shard("demo", None, 0, collective=LocalCollective())
    from moe_cluster.node.moe.load import load_unsharded

    return load_unsharded("demo")


@pytest.fixture(scope="module")
def encode():
    from mlx_lm.tokenizer_utils import load

    tok = load(MODEL_DIR)
    return lambda text: tuple(tok.encode(text, add_special_tokens=False))


class Log:
    """A Sink noting, for each sequence, the batch step of each event."""

    def __init__(self, steps: list[int]):
        self.steps, self.first, self.ended, self.error = steps, None, None, None

    def tokens(self, ids):
        if self.first is None:
            self.first = self.steps[0]

    def done(self, result):
        self.ended = self.steps[0]

    def failed(self, exc):
        self.error = exc


def drive(rt: NodeRuntime, reqs: list[GenerateRequest]) -> tuple[list[GenerateResult], list[Log]]:
    steps = [0]
    results, logs = [], []
    for i, req in enumerate(reqs):
        results.append(GenerateResult())
        logs.append(Log(steps))
        rt.batch.submit(req, i + 1, logs[-1], results[-1])
    while rt.batch.busy():
        rt.batch.step()
        steps[0] += 1
        assert steps[0] < 1000
    assert all(log.error is None for log in logs), [log.error for log in logs]
    return results, logs


def test_sequences_stepped_together_give_stock_tokens_and_logits(sharded, encode, reference):
    rt = NodeRuntime(sharded, limits=BatchLimits(max_batch=4, prefill_budget=8))
    reqs = [
        GenerateRequest(
            f"r{i}", encode(p), Sampling(max_tokens=10 + 3 * i), prefill_step=8, record_logits=True
        )
        for i, p in enumerate(PROMPTS)
    ]
    results, logs = drive(rt, reqs)
    for req, r in zip(reqs, results):
        tokens, logits = reference(MODEL_DIR, req.prompt, len(r.tokens))
        assert r.tokens == tokens and len(r.tokens) == req.sampling.max_tokens
        # stock's sink holds the step after the last token too
        assert len(r.logits) == len(r.tokens) <= len(logits), (len(r.logits), len(logits))
        assert max(float(np.abs(a - b).max()) for a, b in zip(r.logits, logits)) < 1e-4
    # all four decoded at once: the last one's first token came before the first one ended
    assert max(log.first for log in logs) < min(log.ended for log in logs)


def test_a_spent_kv_budget_makes_requests_wait_in_order(sharded, encode):
    per_request = (
        kv_bytes_per_token(sharded.model) * 256
    )  # one KV step: each request below fits in it
    assert per_request > 0
    rt = NodeRuntime(sharded, limits=BatchLimits(max_batch=8, kv_budget_bytes=2 * per_request))
    reqs = [
        GenerateRequest(f"k{i}", encode(p), Sampling(max_tokens=6)) for i, p in enumerate(PROMPTS)
    ]
    _, logs = drive(rt, reqs)
    # two at a time, in arrival order: the third starts only once one of the first two has ended
    assert logs[2].first > min(logs[0].ended, logs[1].ended)
    assert logs[0].first <= logs[1].first <= logs[2].first <= logs[3].first
    assert logs[1].first < min(logs[0].ended, logs[1].ended)


def test_a_seeded_sampled_request_draws_the_same_tokens_beside_others(sharded, encode):
    sampled = GenerateRequest(
        "s", encode(PROMPTS[0]), Sampling(max_tokens=16, temperature=0.9, top_p=0.9, seed=5)
    )
    alone, _ = drive(NodeRuntime(sharded), [sampled])
    others = [
        GenerateRequest(f"o{i}", encode(p), Sampling(max_tokens=12, temperature=1.0, seed=i))
        for i, p in enumerate(PROMPTS[1:])
    ]
    together, _ = drive(NodeRuntime(sharded), [others[0], sampled, *others[1:]])
    assert together[1].tokens == alone[0].tokens and len(alone[0].tokens) == 16
    # what it drew is its seed's draw, not the greedy answer nor another seed's
    greedy, _ = drive(
        NodeRuntime(sharded), [GenerateRequest("g", sampled.prompt, Sampling(max_tokens=16))]
    )
    other, _ = drive(
        NodeRuntime(sharded),
        [GenerateRequest("s6", sampled.prompt, replace(sampled.sampling, seed=6))],
    )
    assert alone[0].tokens != greedy[0].tokens and alone[0].tokens != other[0].tokens


def test_every_step_of_sampled_requests_draws_from_mlx_lm_s_sampler_distribution(
    cluster_path, encode
):
    """64 seeded requests of 12 tokens (a new key each step), each token held to the distribution
    mlx-lm's sampler draws from on the logits it was drawn from (its top-p, then softmax(. / T)).
    A draw's randomised PIT (tokens by falling probability: F(t-) + V p(t)) is uniform where the
    draw follows it: 10 bins, chi-square at alpha 1e-3 (measured: 10.8 against 27.9; a temperature
    lost after the first token gives 122, a top-p lost, a token outside it). Given the logits the
    steps are independent: tokens repeat earlier ones of their sequence as often as their
    probabilities say, |z| within 3.29 (measured: -1.6; one key for every step gives 8.2)."""
    temperature, top_p, n, k = 0.8, 0.9, 64, 12
    reqs = [
        GenerateRequest(
            f"d{i}",
            encode(PROMPTS[i % 4]),
            Sampling(k, temperature, top_p, 1000 + i),
            record_logits=True,
        )
        for i in range(n)
    ]
    results, _ = drive(NodeRuntime(cluster_path, limits=BatchLimits(max_batch=n)), reqs)
    noise = np.random.default_rng(0)
    pit, repeats, expected, variance = [], 0, 0.0, 0.0
    for r in results:
        assert len(r.tokens) == len(r.logits) == k, (len(r.tokens), len(r.logits))
        for step, (token, logits) in enumerate(zip(r.tokens, r.logits)):
            p = sampling_probs(logits, temperature, top_p)
            assert p[token] > 0, (r.tokens, step, "drawn outside the nucleus")
            pit.append(p[p > p[token]].sum() + p[p == p[token]].sum() * noise.random())
            seen = sorted(set(r.tokens[:step]))
            q = float(p[seen].sum())
            repeats += token in seen
            expected += q
            variance += q * (1 - q)
    counts = np.histogram(pit, bins=10, range=(0, 1))[0]
    stat = float(((counts - len(pit) / 10) ** 2 / (len(pit) / 10)).sum())
    assert stat <= chi2_critical(1e-3, 9), (stat, counts.tolist())
    z = (repeats - expected) / variance**0.5
    assert abs(z) <= 3.29, (repeats, expected, z)


@pytest.mark.parametrize(
    "sampling",
    [Sampling(max_tokens=16), Sampling(max_tokens=16, temperature=0.9, seed=5)],
    ids=["greedy", "sampled"],
)
def test_a_request_resumed_at_step_k_goes_on_with_the_tokens_of_the_whole_run(
    sharded, encode, sampling
):
    """What the coordinator sends after a lost node (prompt + the k streamed tokens, the sampler
    advanced k draws) gives the tokens the uncut run gave from step k on."""
    from moe_cluster.coordinator.serve.resume import continuation

    req = GenerateRequest("w", encode(PROMPTS[1]), sampling)
    whole = drive(NodeRuntime(sharded), [req])[0][0].tokens
    assert len(whole) == 16
    for k in (1, 7):
        cont = continuation(req, whole[:k], 1)
        assert cont.sampling.step == k and cont.sampling.max_tokens == 16 - k
        rest = drive(NodeRuntime(sharded), [cont])[0][0].tokens
        assert whole[:k] + rest == whole, (k, whole, rest)


@pytest.mark.parametrize("dtype, quantize, tol", [("float32", 4, 1e-3), ("bfloat16", None, 0.25)])
def test_bf16_and_4bit_batches_give_each_sequence_its_alone_tokens_or_a_near_tie(
    make_ckpt, dtype, quantize, tol
):
    """The tolerance policy of docs/families.md: tokens equal, or the first difference is a
    near-tie (the lone run's top-2 logits within 1e-3 for 4-bit, 0.25 for bfloat16); every token
    counted, and the logits within the dtype's bound up to the first difference (float32's 1e-4 for
    4-bit, whose arithmetic is float32; conftest.BF16_ULPS for bfloat16)."""
    path = make_ckpt("qwen3_moe", dtype=dtype, quantize=quantize)
    # the cluster path (MLX's CPU backend has no bfloat16 gather_mm for the stock model)
    sharded = load_shard(str(path), None, 0, collective=LocalCollective())
    prompts = [tuple(range(3 + i, 40 + 7 * i, 3)) for i in range(4)]
    reqs = [
        GenerateRequest(f"q{i}", p, Sampling(max_tokens=12), record_logits=True)
        for i, p in enumerate(prompts)
    ]
    together, _ = drive(NodeRuntime(sharded, limits=BatchLimits(max_batch=4)), reqs)
    for req, got in zip(reqs, together):
        (alone,), _ = drive(NodeRuntime(sharded), [req])
        assert len(got.tokens) == len(alone.tokens) == 12, (
            req.request_id,
            got.tokens,
            alone.tokens,
        )
        assert len(got.logits) >= 12 and len(alone.logits) >= 12, (
            len(got.logits),
            len(alone.logits),
        )
        n = next((i for i, (a, b) in enumerate(zip(got.tokens, alone.tokens)) if a != b), None)
        shared = 12 if n is None else n + 1  # the prefix both ran, and the step that differs
        diff = max(
            float(np.max(np.abs(np.asarray(got.logits[i]) - np.asarray(alone.logits[i]))))
            for i in range(shared)
        )
        bound = bf16_logit_bound(alone.logits[:shared]) if dtype == "bfloat16" else 1e-4
        assert diff <= bound, (req.request_id, diff, bound)
        if n is None:
            continue
        top2 = np.sort(alone.logits[n])[-2:]
        assert top2[1] - top2[0] <= tol, (req.request_id, n, float(top2[1] - top2[0]))


# -- speculative decoding (node/speculate.py) -------------------------------------------------------

SPEC = BatchLimits(max_batch=8, speculative="prompt-lookup", draft_tokens=4)


@pytest.fixture(scope="module")
def cluster_path(tmp_path_factory):
    """Speculation is the batch's, the same over either model: the cluster path only, of the demo
    without its MTP layer (guesses from the prompt and the prediction alone; `mtp_path` has it)."""
    import json
    import shutil

    out = tmp_path_factory.mktemp("demo-without-mtp")
    for f in MODEL_DIR.iterdir():
        if f.name != "mtp.safetensors":
            shutil.copy(f, out / f.name)
    config = json.loads((out / "config.json").read_text())
    config.pop("num_nextn_predict_layers", None)
    (out / "config.json").write_text(json.dumps(config))
    return load_shard(str(out), None, 0, collective=LocalCollective())


@pytest.fixture(scope="module")
def mtp_path():
    """The demo with its trained MTP layer, which `auto` draws on where the prompt has no guess."""
    return load_shard("demo", None, 0, collective=LocalCollective())


def _spoil(tokens: list[int], every: int) -> tuple[int, ...]:
    """A prediction wrong at every `every`-th token: its drafts are rejected there."""
    return tuple((t + 1) % 300 if i % every == every - 1 else t for i, t in enumerate(tokens))


@pytest.fixture(scope="module")
def rotating(make_ckpt):
    """A family whose sliding-window layers keep a RotatingKVCache (128 positions)."""
    return load_shard(str(make_ckpt("gpt_oss")), None, 0, collective=LocalCollective())


# the demo's plain KV caches with either mode, with its MTP layer, and a rotating window
MODELS = [
    ("cluster_path", "prompt-lookup"),
    ("cluster_path", "auto"),
    ("mtp_path", "auto"),
    ("rotating", "auto"),
]


@pytest.mark.parametrize(
    "sampling",
    [Sampling(max_tokens=24), Sampling(max_tokens=24, temperature=0.9, top_p=0.95, seed=3)],
    ids=["greedy", "sampled"],
)
@pytest.mark.parametrize("together", [1, 8], ids=["alone", "batch of 8"])
@pytest.mark.parametrize("model,mode", MODELS, ids=[f"{m} {x}" for m, x in MODELS])
def test_speculation_gives_the_tokens_and_logits_of_one_token_steps(
    request, encode, sampling, together, model, mode
):
    """Drafts from a right prediction (most accepted), a spoiled one (rejections mid-draft), a
    wrong one (every draft rejected) and the prompt alone: each sequence's tokens are those of
    decoding one token per step, and so are its logits, so a rejected draft left no trace in the
    KV cache of the steps after it (a left-over position changes every logit after it). On the
    rotating family the spoiled prediction's prompt nearly fills the window: it speculates on past
    the window's first turn, where a rejected draft is cut from the window's tail."""
    sharded = request.getfixturevalue(model)
    prompts = [encode(p) for p in (PROMPTS * 2)[: max(together, 4)]]
    if model == "rotating":
        prompts[1] = (prompts[1] * 20)[:118]
    plain = [
        GenerateRequest(f"p{i}", p, sampling, record_logits=True) for i, p in enumerate(prompts)
    ]
    base, _ = drive(NodeRuntime(sharded, limits=BatchLimits(max_batch=8)), plain)
    kinds = [
        lambda t: t,
        lambda t: _spoil(t, 3),
        lambda t: tuple((x + 1) % 300 for x in t),
        lambda t: (),
    ]
    reqs = [
        replace(q, request_id=f"s{i}", prediction=kinds[i % 4](tuple(b.tokens)))
        for i, (q, b) in enumerate(zip(plain, base))
    ]
    # auto shares a step's guesses among the batch's rows: 16 give each of 8 rows 2
    limits = replace(SPEC, speculative=mode, draft_tokens=16 if mode == "auto" else 4)
    if together > 1:
        spec, _ = drive(NodeRuntime(sharded, limits=limits), reqs)
    else:
        spec = [drive(NodeRuntime(sharded, limits=limits), [q])[0][0] for q in reqs]
    for b, s in zip(base, spec):
        assert s.tokens == b.tokens and len(s.tokens) == 24
        assert len(s.logits) == len(b.logits) >= 24
        assert max(float(np.abs(x - y).max()) for x, y in zip(s.logits, b.logits)) <= 1e-4
    right, spoiled, wrong = (r.figures for r in spec[:3])
    if mode == "auto" and together > 1:
        assert right.accepted >= 16 and right.steps <= 9, right  # 2 drafts a step
    else:
        assert right.accepted >= 16 and right.steps <= 8, right  # most of 4 drafts a step held
    # the spoiled one's prompt crosses the rotating window: it guesses past the window's turn too
    assert 0 < spoiled.accepted < spoiled.drafted, spoiled
    # guesses from a wrong prediction (or, past it, from the prompt) all but fail, and the
    # sequence soon stops guessing (node.speculate.adapt): 24 steps would have verified 24 * first
    first = limits.draft_tokens // (together if mode == "auto" else 1)  # guesses a step at first
    assert wrong.drafted - wrong.accepted >= min(first, 4), wrong
    if model == "mtp_path":  # where the prediction matches nothing the MTP layer guesses, and holds
        assert wrong.accepted > 0, wrong
    else:
        assert wrong.drafted <= 6 * first, wrong


def test_a_sequence_asking_for_no_drafts_steps_one_token_at_a_time(cluster_path, encode):
    req = GenerateRequest("n", encode(PROMPTS[0]), Sampling(max_tokens=12), draft_tokens=0)
    (r,), _ = drive(NodeRuntime(cluster_path, limits=SPEC), [req])
    assert r.figures.drafted == 0 and r.figures.steps == 13  # the first step comes with the prompt
    (b,), _ = drive(NodeRuntime(cluster_path), [req])
    assert r.tokens == b.tokens


def test_a_speculated_sequence_leaves_a_prompt_cache_entry_of_its_own_tokens(cluster_path, encode):
    """What a speculating sequence stores (its prompt and output) continues as a fresh prefill
    would: the accepted drafts of its last step are not in the entry."""
    rt = NodeRuntime(cluster_path, prompt_cache_bytes=64 * 2**20, limits=SPEC)
    first = GenerateRequest("c1", encode(PROMPTS[2]), Sampling(max_tokens=10))
    (r1,), _ = drive(rt, [replace(first, prediction=tuple(range(40, 60)))])
    (plain1,), _ = drive(NodeRuntime(cluster_path), [first])
    assert r1.tokens == plain1.tokens
    follow = GenerateRequest(
        "c2", first.prompt + tuple(r1.tokens) + encode(" and"), Sampling(max_tokens=10)
    )
    (r2,), _ = drive(rt, [follow])
    assert r2.cached_tokens >= len(first.prompt) + len(r1.tokens) - 1
    (plain2,), _ = drive(NodeRuntime(cluster_path), [follow])
    assert r2.tokens == plain2.tokens


def test_a_family_whose_caches_cannot_roll_back_says_so_and_decodes_one_token_a_step(make_ckpt):
    path = make_ckpt("qwen3_next")
    sharded = load_shard(str(path), None, 0, collective=LocalCollective())
    rt = NodeRuntime(sharded, limits=SPEC)
    assert (
        rt.batch.speculation().startswith("off: its caches (ArraysCache")
        and rt.batch.draft_max == 0
    )
    req = GenerateRequest(
        "q", tuple(range(3, 30)), Sampling(max_tokens=6), prediction=tuple(range(5, 15))
    )
    (r,), _ = drive(rt, [req])
    assert len(r.tokens) == 6 and r.figures.drafted == 0


def _tiny_draft(folder, vocab: int = 1024) -> str:
    """A one-layer dense llama with the demo's tokenizer and random weights: a draft that guesses
    badly (most of its guesses are rejected)."""
    import json
    import shutil

    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    config = {
        "model_type": "llama",
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "tie_word_embeddings": True,
    }
    folder.mkdir(parents=True, exist_ok=True)
    mx.random.seed(3)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(MODEL_DIR / name, folder / name)
    return str(folder)


@pytest.mark.parametrize("draft", ["the model itself", "a random one-layer model"])
def test_a_draft_models_guesses_keep_the_tokens_and_logits_of_one_token_steps(
    cluster_path, encode, draft, tmp_path
):
    path = str(MODEL_DIR) if draft == "the model itself" else _tiny_draft(tmp_path / "draft")
    limits = BatchLimits(max_batch=4, speculative="draft", draft_tokens=3, draft_model=path)
    reqs = [
        GenerateRequest(f"d{i}", encode(p), Sampling(max_tokens=20), record_logits=True)
        for i, p in enumerate(PROMPTS)
    ]
    reqs[3] = replace(reqs[3], sampling=Sampling(max_tokens=20, temperature=0.8, seed=9))
    base, _ = drive(NodeRuntime(cluster_path, limits=BatchLimits(max_batch=4)), reqs)
    spec, _ = drive(NodeRuntime(cluster_path, limits=limits), reqs)
    for b, s in zip(base, spec):
        assert s.tokens == b.tokens and len(s.tokens) == 20
        assert len(s.logits) == len(b.logits) == 20, (len(s.logits), len(b.logits))
        assert max(float(np.abs(x - y).max()) for x, y in zip(s.logits, b.logits)) <= 1e-4
    greedy = [r.figures for r in spec[:3]]
    if draft == "the model itself":  # it guesses what the model says: every guess holds
        assert all(f.accepted == f.drafted > 0 and f.steps <= 7 for f in greedy), greedy
    else:
        assert (
            all(f.drafted > 0 for f in greedy)
            and sum(f.accepted for f in greedy) < sum(f.drafted for f in greedy) / 2
        )


def test_a_draft_model_with_another_vocabulary_is_refused(cluster_path, tmp_path):
    from moe_cluster.proto.errors import UserError

    path = _tiny_draft(tmp_path / "big", vocab=4096)
    with pytest.raises(UserError, match="has 4096 tokens, more than the model's 1024"):
        NodeRuntime(cluster_path, limits=BatchLimits(speculative="draft", draft_model=path))


def test_each_request_counts_the_all_reduce_waits_of_the_steps_it_ran_in():
    """A request's collective_s is the waiting of its own steps, not the node's running total: one
    of 3 tokens beside one of 18 is not charged the steps the other ran after it ended."""
    import time

    class Slow(LocalCollective):
        caps = Capabilities(in_graph=False)

        def all_reduce(self, partial, layer):
            time.sleep(0.002)
            return partial

    sharded = load_shard("demo", None, 0, collective=Slow())
    reqs = [
        GenerateRequest("short", (5, 6, 7), Sampling(max_tokens=3)),
        GenerateRequest("long", (8, 9, 10), Sampling(max_tokens=18)),
    ]
    (short, long), _ = drive(NodeRuntime(sharded, limits=BatchLimits(max_batch=2)), reqs)
    layers = len(sharded.moe_layers())
    # the long one waited alone in the 14 steps after the short one ended (a stall in a shared step
    # counts for both: only the difference is bounded below)
    assert long.figures.collective_s - short.figures.collective_s >= 14 * layers * 0.002, (
        short.figures,
        long.figures,
    )
    assert short.figures.collective_s >= 3 * layers * 0.002, short.figures


def test_each_step_reports_what_it_did(cluster_path, encode):
    """The step's report (StepReport): over a run, the prompt tokens prefilled, the tokens handed
    out, who joined and who ended, summed, are the run's; speculation's guesses are counted."""
    rt = NodeRuntime(cluster_path, limits=replace(SPEC, max_batch=2, prefill_budget=8))
    reqs = [
        GenerateRequest(f"r{i}", encode(p), Sampling(max_tokens=6 + i), prefill_step=8)
        for i, p in enumerate(PROMPTS[:3])
    ]
    results = [GenerateResult() for _ in reqs]
    for i, (req, r) in enumerate(zip(reqs, results)):
        rt.batch.submit(req, i + 1, Log([0]), r)
    reports = []
    while rt.batch.busy():
        reports.append(rt.batch.step())
        assert len(reports) < 200
    assert [r.step for r in reports] == list(range(1, len(reports) + 1))
    assert sum(r.prefilled for r in reports) == sum(len(q.prompt) - 1 for q in reqs)
    assert sum(r.handed_out for r in reports) == sum(len(r.tokens) for r in results) == 6 + 7 + 8
    assert sorted(rid for r in reports for rid in r.admitted) == ["r0", "r1", "r2"]
    assert sorted(f for r in reports for f in r.finished) == [
        ("r0", "length"),
        ("r1", "length"),
        ("r2", "length"),
    ]
    assert max(r.decoded for r in reports) == 2  # max_batch
    assert all(r.positions >= r.decoded and r.seconds > 0 for r in reports)
    assert sum(r.drafted for r in reports) == sum(q.figures.drafted for q in results)
    assert sum(r.accepted for r in reports) == sum(q.figures.accepted for q in results)


def test_the_first_two_steps_of_each_shape_get_the_cold_bound():
    """A step that may build kernels is watched as cold (Collective.watch): the first two of each
    shape (prefill chunk, rows decoded), the second because it waits for the first's graph. The
    first decode step comes after the admission and the prefill steps, and on a fresh GPU host
    it built its kernels past the warm bound."""

    class Watched(LocalCollective):
        def __init__(self):
            super().__init__()
            self.armed: list[bool] = []

        def watch(self, what, cold=False):
            if what is not None:
                self.armed.append(cold)

    c = Watched()
    rt = NodeRuntime(load_shard("demo", None, 0, collective=c), limits=BatchLimits(max_batch=2))
    first = GenerateRequest("first", (5, 6, 7), Sampling(max_tokens=8))
    later = GenerateRequest("later", (8, 9, 10), Sampling(max_tokens=8))
    rt.batch.submit(first, 1, Log([0]), GenerateResult())
    shapes = []
    while rt.batch.busy():
        if len(shapes) == 6:  # a second sequence joins: prefill beside a decode, then two rows
            rt.batch.submit(later, 2, Log([0]), GenerateResult())
        r = rt.batch.step()
        shapes.append((r.prefilled > 0, r.decoded))
        assert len(shapes) < 100
    assert len(c.armed) == len(shapes)
    for i, (shape, cold) in enumerate(zip(shapes, c.armed)):
        assert cold == (shapes[:i].count(shape) < 2), (i, shapes, c.armed)
    first_decode = shapes.index((False, 1))
    assert c.armed[first_decode] and not c.armed[first_decode + 2]
    assert (False, 2) in shapes and c.armed[shapes.index((False, 2))]


@pytest.mark.parametrize("window", [0, 16], ids=["KVCache", "RotatingKVCache"])
def test_a_row_leaving_a_lane_that_was_never_fed_gets_an_empty_cache(window):
    """Two sequences whose caches were never fed share a lane (one-token prompts: nothing to
    prefill) and one leaves before a step: its cache is an empty one of its kind, not a crash in
    mlx-lm's `extract` (which reads the keys)."""
    from types import SimpleNamespace

    from mlx_lm.models.cache import KVCache, RotatingKVCache

    from moe_cluster.node.lanes import Lane

    def fresh():
        return SimpleNamespace(cache=[RotatingKVCache(window) if window else KVCache()])

    lane, a, b = Lane(), fresh(), fresh()
    lane.join(a)
    lane.join(b)
    (got,) = lane.leave(a)
    assert type(got) is type(a.cache[0]) and got.keys is None and lane.rows == [b]


def test_concurrent_requests_of_different_lengths_all_finish_speculating(cluster_path):
    """One-token prompts (no prefill: they join the batch unfed), short and long ones, ending at
    different steps, with speculation on: every one gives the tokens it gives without it."""
    shapes = [(1, 1), (1, 3), (2, 1), (7, 5), (30, 2), (1, 8), (12, 12), (3, 6)]
    reqs = [
        GenerateRequest(f"r{i}", tuple(range(5, 5 + n)), Sampling(max_tokens=m))
        for i, (n, m) in enumerate(shapes)
    ]
    base, _ = drive(NodeRuntime(cluster_path, limits=BatchLimits(max_batch=8)), reqs)
    spec, _ = drive(NodeRuntime(cluster_path, limits=replace(SPEC, speculative="auto")), reqs)
    assert [r.tokens for r in spec] == [r.tokens for r in base]
    assert [len(r.tokens) for r in spec] == [m for _, m in shapes]

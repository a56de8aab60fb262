"""One family through the cluster's arithmetic against stock mlx-lm: the core of the family sweep.

`check(family, tmp, nodes, quantize)` builds the family's tiny checkpoint (tiny.py), decodes it
greedily with stock mlx-lm, then with every rank's shard in this process (node.moe.load's
`load_in_process`: each MoE block is every rank's `ClusterMoE` share summed in rank order), and
returns tokens and the largest |Δlogit|. Used by test_sweep.py and by table.py
(the table of docs/families.md).
"""

from __future__ import annotations

from pathlib import Path

import mlx.nn as nn
import numpy as np

import tiny

PROMPT = [1, 17, 42, 99, 7, 200, 3, 55]
STEPS = 6
TOLERANCE = 1e-4  # float32 |Δlogit|, the project's bar for "exact"
QUANT_TOLERANCE = 1e-3  # identical quantized weights: only float32 addition order differs
# One quantization mode per family, in turn, so every mode and every bank kind is covered.
QUANT_ROTATION = ("4bit", "8bit", "mxfp4", "mxfp8", "4bit+8bit-layer")


def quant_mode(family: str) -> str:
    return QUANT_ROTATION[tiny.families().index(family) % len(QUANT_ROTATION)]


def checkpoint(family: str, tmp: Path, quantize: str | None = None) -> Path:
    return tiny.make_checkpoint(
        family, Path(tmp) / f"{family}-{quantize or 'f32'}", quantize=quantize
    )


def check(
    path: Path, nodes: int, reference=None, keepalive: str = "lru", route: str = "preferred"
) -> dict:
    """{"tokens", "reference_tokens", "max_abs_logit_diff", "tokens_match"} for one node count.
    keepalive "none" and "lru" route decode steps on the device ("busy" reads the indices on the host);
    `route`: load_shard's (node/moe/route.py), each layer's preferred one unless told."""
    from moe_cluster.node.moe.load import load_in_process

    ref_tokens, ref_logits = reference or tiny.stock_tokens(path, PROMPT, STEPS)
    sm = load_in_process(str(path), nodes, keepalive=keepalive, route=route)
    tokens, logits = tiny.decode(sm.model, PROMPT, STEPS)
    assert len(tokens) == len(ref_tokens) == STEPS and logits.shape == ref_logits.shape, (
        len(tokens),
        len(ref_tokens),
        logits.shape,
        ref_logits.shape,
    )
    diff = float(np.max(np.abs(logits - ref_logits)))
    return {
        "tokens": tokens,
        "reference_tokens": ref_tokens,
        "max_abs_logit_diff": diff,
        "tokens_match": tokens == ref_tokens,
    }


PROMPT_B = [5, 23, 64, 11, 130]  # a second stream, shorter: the two differ in rows every pass


def check_by_stream(path: Path, nodes: int, keepalive: str = "lru") -> dict:
    """Attention by stream's arithmetic at `nodes` ranks in this process: two streams (PROMPT and
    PROMPT_B), each decoded through its own forward pass and KV cache (its owner's), meet at every
    MoE layer, where their rows are gathered, every rank's share computed on all of them and summed
    in rank order, and each stream gets its rows back (the step of node/moe/combine.py
    StreamCombine, without the transport). -> per stream: tokens, the reference's, largest |Δlogit|.
    """
    from moe_cluster.node.moe.layer import install
    from moe_cluster.node.moe.load import load_in_process

    sm = load_in_process(str(path), nodes, keepalive=keepalive)
    meet = _Meeting()
    for b in sm.blocks:
        merged = _parent_of(sm.model, b.path)
        install(sm.model, b.path, _Gathered(merged, meet))
    out = {}
    prompts = {"a": PROMPT, "b": PROMPT_B}
    got = meet.decode(sm.model, prompts, STEPS)
    for name, prompt in prompts.items():
        ref_tokens, ref_logits = tiny.stock_tokens(path, prompt, STEPS)
        tokens, logits = got[name]
        out[name] = {
            "tokens": tokens,
            "reference_tokens": ref_tokens,
            "max_abs_logit_diff": float(np.max(np.abs(logits - ref_logits))),
        }
    return out


def _parent_of(model, path: str):
    """The module at `path` (an InProcessCluster after load_in_process)."""
    node = model
    for part in path.split("."):
        node = node[int(part)] if isinstance(node, list) else getattr(node, part)
    return node


class _Meeting:
    """Runs each stream's forward pass as a greenlet; at each MoE layer every stream hands in its
    rows, and once all have, the layer runs on them all together."""

    def __init__(self):
        self._main = None

    def decode(self, model, prompts: dict, steps: int) -> dict:
        import mlx.core as mx
        from greenlet import greenlet
        from mlx_lm.models.cache import make_prompt_cache

        caches = {n: make_prompt_cache(model) for n in prompts}
        inputs = {n: mx.array([list(p)], dtype=mx.int32) for n, p in prompts.items()}
        tokens = {n: [] for n in prompts}
        logits = {n: [] for n in prompts}
        for _ in range(steps):
            lanes = {
                n: greenlet(lambda n=n: model(inputs[n], cache=caches[n])[:, -1, :])
                for n in prompts
            }
            done = self._run(lanes)
            for n, row in done.items():
                row = row.astype(mx.float32)
                tok = int(mx.argmax(row, axis=-1).item())
                tokens[n].append(tok)
                logits[n].append(np.array(row[0]))
                inputs[n] = mx.array([[tok]], dtype=mx.int32)
        return {n: (tokens[n], np.stack(logits[n])) for n in prompts}

    def _run(self, lanes: dict) -> dict:
        """Each lane's result: every lane runs to its next MoE layer, the layer runs on all of
        their rows, each goes on with its own, until every lane ended."""
        from greenlet import getcurrent

        self._main = getcurrent()
        out, waiting = {}, {}
        for n, g in lanes.items():
            r = g.switch()
            (out if g.dead else waiting)[n] = r
        while waiting:
            assert len({id(layer) for layer, _ in waiting.values()}) == 1, (
                "the streams reached different MoE layers"
            )
            layer = next(iter(waiting.values()))[0]
            names = list(waiting)
            sums = layer.together([waiting[n][1] for n in names])
            waiting = {}
            for n, y in zip(names, sums):
                r = lanes[n].switch(y)
                (out if lanes[n].dead else waiting)[n] = r
        return out

    def hand_in(self, layer, x):
        """From a stream's forward pass: wait for the others at `layer`; its rows' sums."""
        return self._main.switch((layer, x))


class _Gathered(nn.Module):
    """An InProcessCluster (every rank's share of one MoE layer) met by every stream's rows."""

    def __init__(self, ranks, meet: _Meeting):
        super().__init__()
        self.ranks, self.meet = ranks, meet

    def __call__(self, x, *args, **kwargs):
        assert not args and not kwargs, "the block takes more than its input"
        return self.meet.hand_in(self, x)

    def together(self, xs: list) -> list:
        import mlx.core as mx

        from moe_cluster.node.collective.base import rank_order_sum

        width = xs[0].shape[-1]
        rows = mx.concatenate([x.reshape(-1, width) for x in xs])  # every stream's, gathered
        y = rank_order_sum([r.partial(rows[None]) for r in self.ranks.ranks])[0]
        out, at = [], 0
        for x in xs:  # each stream's rows back to it
            n = x.size // width
            out.append(y[at : at + n].reshape(x.shape))
            at += n
        return out


def check_speculative(path: Path, steps: int = 12) -> dict:
    """The running batch with `speculative: auto` (the default) against one token per step, at one
    node (what rolls back is each node's own cache, the same at any N): two greedy sequences in one
    batch, a repeating prompt with a half-spoiled prediction of its output and PROMPT alone (its
    drafts from its own n-grams), so that drafts are accepted and rejected. -> the batch's mode
    ("off: why" where the family cannot roll back), drafts, whether the tokens match and the
    largest |Δlogit| of any step."""
    from moe_cluster.node.batch import BatchLimits
    from moe_cluster.node.collective.base import LocalCollective
    from moe_cluster.node.moe.load import load_shard
    from moe_cluster.node.runtime import GenerateResult, NodeRuntime
    from moe_cluster.proto.records import GenerateRequest, Sampling

    class Sink:
        def __init__(self):
            self.error = None

        def tokens(self, ids):
            pass

        def done(self, result):
            pass

        def failed(self, exc):
            self.error = exc

    sharded = load_shard(str(path), None, 0, collective=LocalCollective())

    def run(limits: BatchLimits, predictions: list[tuple]) -> tuple[list, str]:
        rt = NodeRuntime(sharded, limits=limits)
        prompts = [tuple(PROMPT[:4] * 3), tuple(PROMPT)]
        results, sinks = [], []
        for i, (prompt, pred) in enumerate(zip(prompts, predictions)):
            req = GenerateRequest(
                f"r{i}", prompt, Sampling(max_tokens=steps), record_logits=True, prediction=pred
            )
            results.append(GenerateResult())
            sinks.append(Sink())
            rt.batch.submit(req, i + 1, sinks[-1], results[-1])
        while rt.batch.busy():
            rt.batch.step()
        assert all(s.error is None for s in sinks), [s.error for s in sinks]
        return results, rt.batch.speculation()

    base, _ = run(BatchLimits(max_batch=2), [(), ()])
    half = tuple(t if i % 2 else (t + 1) % 64 for i, t in enumerate(base[0].tokens))
    spec, mode = run(BatchLimits(max_batch=2, speculative="auto"), [half, ()])
    return {
        "mode": mode,
        "drafted": sum(r.figures.drafted for r in spec),
        "tokens_match": [r.tokens for r in spec] == [r.tokens for r in base],
        "max_abs_logit_diff": max(
            float(np.max(np.abs(x - y)))
            for s, b in zip(spec, base)
            for x, y in zip(s.logits, b.logits)
        ),
    }

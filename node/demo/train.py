"""`moe-cluster train-demo`: train the embedded demo MoE on the bundled Shakespeare corpus."""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from ..checkpoint import model_classes, write_checkpoint
from . import CORPUS_DIR, tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 900
    batch: int = 16
    seq: int = 128
    lr: float = 3e-3
    warmup: int = 90
    weight_decay: float = 0.01
    # Switch-Transformer load-balancing loss weight: small, so routing stays skewed as in real
    # models but no expert dies.
    aux_loss: float = 0.002
    seed: int = 0
    vocab: int = 1024
    hidden: int = 128
    layers: int = 4
    experts: int = 16
    top_k: int = 4
    expert_ffn: int = 80
    # Share of each batch's sequences made of a passage written twice (see `repeat_window`), so the
    # model learns to copy what it read, as real LLMs do: prompt lookup drafts then hold.
    repeat: float = 0.25


def demo_config(tc: TrainConfig) -> dict:
    """A qwen3_moe config, as `demo-model --arch qwen3_moe` writes it, with the demo's sizes."""
    from .archs import ARCHS, Shape

    config = ARCHS["qwen3_moe"].make_config(
        Shape(tc.vocab, tc.layers, tc.experts, tc.top_k, tc.hidden, expert_ffn=tc.expert_ffn)
    )
    # tied embeddings keep the shipped model small; <|endoftext|> ends documents and <|end|> a chat
    # turn (see tokenizer.CHAT_TEMPLATE)
    config.update(tie_word_embeddings=True, eos_token_id=[0, 4])
    return config


class _RouterTap(nn.Module):
    """Wraps a router so its logits are kept for the load-balancing loss."""

    def __init__(self, gate: nn.Module, sink: list):
        super().__init__()
        self.gate = gate
        self._sink = sink

    def __call__(self, x):
        logits = self.gate(x)
        self._sink.append(logits)
        return logits


def encode_corpus(tok_dir: Path, corpus_dir: Path = CORPUS_DIR) -> np.ndarray:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    eos = tok.token_to_id(tokenizer.EOS)
    ids: list[int] = []
    for text in tokenizer.corpus_texts(corpus_dir):
        ids.extend(tok.encode(text).ids)
        ids.append(eos)
    return np.array(ids, dtype=np.int32)


def repeat_window(ids: np.ndarray, rng: np.random.Generator, n: int) -> tuple[np.ndarray, int]:
    """`n` tokens: natural text ending in a passage, another span of the corpus, and the passage
    again; and where the second copy starts. The passage (8 to n/2 tokens) and the span between
    (any length that fits) vary, so copies are learned at every distance the window holds and after
    a context unlike the first copy's, as in a prompt that quotes text it read earlier."""
    length = int(rng.integers(8, n // 2 + 1))
    gap = int(rng.integers(0, n - 2 * length + 1))
    head = n - 2 * length - gap + length  # the context before the passage, then the passage
    s = int(rng.integers(0, len(ids) - head))
    g = int(rng.integers(0, len(ids) - gap))
    first = ids[s : s + head]
    window = np.concatenate([first, ids[g : g + gap], first[head - length :]])
    return window, n - length


def batch_windows(
    ids: np.ndarray, rng: np.random.Generator, batch: int, seq: int, repeat: float
) -> tuple[np.ndarray, list[int]]:
    """`batch` windows of `seq + 1` tokens (inputs and shifted targets); the first
    round(repeat * batch) are `repeat_window`s, the rest plain corpus spans. Also, per window, the
    position its second copy starts at (`seq + 1` where it has none)."""
    n = seq + 1
    k = round(repeat * batch)
    rows, copies = [], []
    for i in range(batch):
        if i < k:
            w, c = repeat_window(ids, rng, n)
        else:
            s = int(rng.integers(0, len(ids) - n))
            w, c = ids[s : s + n], n
        rows.append(w)
        copies.append(c)
    return np.stack(rows), copies


def train_demo(out: Path, tc: TrainConfig = TrainConfig(), corpus_dir: Path = CORPUS_DIR) -> dict:
    """Train the demo model and write it, with its tokenizer, into `out`."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.train_tokenizer(out, tc.vocab, corpus_dir)
    data = encode_corpus(out, corpus_dir)
    logger.info("corpus: %d tokens", len(data))
    split = int(len(data) * 0.98)
    train_ids, val_ids = data[:split], data[split:]

    config = demo_config(tc)
    model_cls, args_cls = model_classes(config)
    mx.random.seed(tc.seed)
    model = model_cls(args_cls.from_dict(config))
    router_logits: list = []
    for layer in model.layers:
        layer.mlp.gate = _RouterTap(layer.mlp.gate, router_logits)

    def loss_fn(model, x, y):
        router_logits.clear()
        logits = model(x)
        ce = nn.losses.cross_entropy(logits, y, reduction="mean")
        aux = 0.0
        for g in router_logits:
            probs = mx.softmax(g.astype(mx.float32), axis=-1).reshape(-1, tc.experts)
            top = mx.stop_gradient(
                mx.argpartition(-probs, kth=tc.top_k - 1, axis=-1)[:, : tc.top_k]
            )
            frac = mx.stop_gradient(mx.zeros((tc.experts,)).at[top.reshape(-1)].add(1.0) / top.size)
            aux = aux + tc.experts * (frac * probs.mean(axis=0)).sum()
        return ce + tc.aux_loss * aux / len(model.layers), ce

    schedule = optim.join_schedules(
        [
            optim.linear_schedule(1e-5, tc.lr, tc.warmup),
            optim.cosine_decay(tc.lr, tc.steps - tc.warmup, tc.lr * 0.05),
        ],
        [tc.warmup],
    )
    opt = optim.AdamW(learning_rate=schedule, weight_decay=tc.weight_decay)
    value_and_grad = nn.value_and_grad(model, loss_fn)
    state = [model.state, opt.state]

    def train_step(x, y):
        (_, ce), grads = value_and_grad(model, x, y)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        return ce

    rng = np.random.default_rng(tc.seed)

    def batch(ids: np.ndarray, repeat: float = tc.repeat):
        rows, copies = batch_windows(ids, rng, tc.batch, tc.seq, repeat)
        return mx.array(rows[:, :-1]), mx.array(rows[:, 1:]), copies

    def copy_ce(vx, vy, copies):
        # cross-entropy over the second copies only (the targets from each copy's second token)
        logits = model(vx)
        ce = nn.losses.cross_entropy(logits, vy, reduction="none")
        mask = mx.array(np.arange(tc.seq)[None, :] >= np.array(copies)[:, None])
        return (ce * mask).sum() / mask.sum()

    t0 = time.time()
    history = []
    for step in range(1, tc.steps + 1):
        x, y, _ = batch(train_ids)
        ce = train_step(x, y)
        mx.eval(state, ce)
        if step % 100 == 0 or step == tc.steps:
            # natural text only, so val_ce stays comparable across shares of repeats
            vx, vy, _ = batch(val_ids, 0.0)
            _, vce = loss_fn(model, vx, vy)
            cx, cy, copies = batch(val_ids, 1.0)
            cce = copy_ce(cx, cy, copies)
            rec = {
                "step": step,
                "train_ce": round(ce.item(), 4),
                "val_ce": round(vce.item(), 4),
                "val_copy_ce": round(cce.item(), 4),
                "seconds": round(time.time() - t0, 1),
            }
            history.append(rec)
            logger.info(
                "step %d  train %.3f  val %.3f  copy %.3f  (%.0fs)",
                step,
                rec["train_ce"],
                rec["val_ce"],
                rec["val_copy_ce"],
                rec["seconds"],
            )

    for layer in model.layers:
        layer.mlp.gate = layer.mlp.gate.gate
    weights = dict(tree_flatten(model.parameters()))
    write_checkpoint(out, weights, config)
    report = {
        "trained_by": "moe-cluster train-demo",
        "config": asdict(tc),
        "corpus": "node/demo/corpus (Shakespeare, public domain; see SOURCE.md)",
        "corpus_tokens": int(len(data)),
        "parameters": int(sum(v.size for v in weights.values())),
        "bytes": int(sum(v.nbytes for v in weights.values())),
        "history": history,
        "val_perplexity": round(math.exp(history[-1]["val_ce"]), 2) if history else None,
    }
    (out / "training.json").write_text(json.dumps(report, indent=2) + "\n")
    return report

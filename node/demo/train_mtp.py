"""Train a multi-token-prediction (MTP) layer for the demo model (`train-demo --mtp`), the draft of
`serving.speculative: mtp` (node/mtp.py), on the bundled corpus.

The model stays frozen; the MTP layer learns, from the model's last hidden state at position i and
the token i + 1, the token i + 2 (DeepSeek-V3's objective at depth 1), on the windows the demo was
trained on (a share of them a passage written twice). Its block starts as a copy of the model's
last decoder layer. The layer is written to `mtp.safetensors` beside the model's weights, and the
config declares it (`num_nextn_predict_layers: 1`): stock mlx-lm reads `model*.safetensors` only,
so the demo loads as before everywhere else.
"""

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

from . import CORPUS_DIR
from .train import batch_windows, encode_corpus

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MTPTrainConfig:
    steps: int = 400
    batch: int = 16
    seq: int = 128
    lr: float = 2e-3
    warmup: int = 40
    repeat: float = 0.25  # as the model's training (train.TrainConfig.repeat)
    seed: int = 0


def train_mtp(model_dir: Path, tc: MTPTrainConfig = MTPTrainConfig()) -> dict:
    """Train the MTP layer of the model in `model_dir` and write it there; the report."""
    from mlx_lm.utils import load_model

    from ..mtp import MTP, SIDE_FILE, head

    model, config = load_model(model_dir)
    model.freeze()
    layer = int(config["num_hidden_layers"])
    mx.random.seed(tc.seed)
    block = type(model.model.layers[-1])(model.args, layer)
    block.load_weights(list(tree_flatten(model.model.layers[-1].parameters())))
    mtp = MTP(block, int(config["hidden_size"]), float(config.get("rms_norm_eps", 1e-6)))
    logits_of = head(model)

    data = encode_corpus(model_dir, CORPUS_DIR)
    split = int(len(data) * 0.98)
    train_ids, val_ids = data[:split], data[split:]
    rng = np.random.default_rng(tc.seed)

    def batch(ids: np.ndarray, repeat: float):
        rows, _ = batch_windows(ids, rng, tc.batch, tc.seq + 1, repeat)
        rows = mx.array(rows)  # (B, seq + 2): inputs, the tokens after them, the targets
        return rows[:, : tc.seq], rows[:, 1 : tc.seq + 1], rows[:, 2:]

    def loss_fn(mtp, x, nxt, y):
        hidden = mx.stop_gradient(model.model(x))
        h = mtp(model.model.embed_tokens(nxt), hidden, None)
        logits = logits_of(mtp.shared_head.norm(h))
        return nn.losses.cross_entropy(logits, y, reduction="mean")

    schedule = optim.join_schedules(
        [
            optim.linear_schedule(1e-5, tc.lr, tc.warmup),
            optim.cosine_decay(tc.lr, tc.steps - tc.warmup, tc.lr * 0.05),
        ],
        [tc.warmup],
    )
    opt = optim.AdamW(learning_rate=schedule, weight_decay=0.01)
    value_and_grad = nn.value_and_grad(mtp, loss_fn)

    def accuracy(x, nxt, y) -> float:
        h = mtp(model.model.embed_tokens(nxt), model.model(x), None)
        guess = mx.argmax(logits_of(mtp.shared_head.norm(h)), axis=-1)
        return float((guess == y).astype(mx.float32).mean().item())

    t0, history = time.time(), []
    for step in range(1, tc.steps + 1):
        loss, grads = value_and_grad(mtp, *batch(train_ids, tc.repeat))
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(mtp, grads)
        mx.eval(mtp.parameters(), opt.state, loss)
        if step % 50 == 0 or step == tc.steps:
            plain, copies = batch(val_ids, 0.0), batch(val_ids, 1.0)
            rec = {
                "step": step,
                "train_ce": round(loss.item(), 4),
                "val_ce": round(loss_fn(mtp, *plain).item(), 4),
                "val_top1": round(accuracy(*plain), 4),
                "val_copy_top1": round(accuracy(*copies), 4),
                "seconds": round(time.time() - t0, 1),
            }
            history.append(rec)
            logger.info("mtp step %d %s", step, rec)

    weights = {
        f"model.layers.{layer}.{k.removeprefix('block.')}": v
        for k, v in tree_flatten(mtp.parameters())
    }
    # the MTP weights go beside the model's, which stay as they were
    mx.save_safetensors(str(model_dir / SIDE_FILE), weights, metadata={"format": "mlx"})
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (model_dir / "config.json").write_text(json.dumps(dict(sorted(cfg.items())), indent=2) + "\n")
    report = {
        "trained_by": "moe-cluster train-demo --mtp",
        "config": asdict(tc),
        "parameters": int(sum(v.size for v in weights.values())),
        "bytes": int(sum(v.nbytes for v in weights.values())),
        "history": history,
        "val_perplexity": round(math.exp(history[-1]["val_ce"]), 2) if history else None,
    }
    training = model_dir / "training.json"
    record = json.loads(training.read_text()) if training.exists() else {}
    record["mtp"] = report
    training.write_text(json.dumps(record, indent=2) + "\n")
    return report

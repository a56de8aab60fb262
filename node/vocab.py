"""The token ids a model accepts: the rows of its token embedding, found by structure, not by name."""

from __future__ import annotations

from pathlib import Path

import mlx.nn as nn

from ..proto.errors import UserError


def embedding_rows(model: nn.Module) -> int:
    """Rows of the model's first token embedding (plain or quantized): ids must be below this.

    The first in module order, as the planner's description takes it (coordinator/plan/describe.py);
    an embedding indexed past its rows reads outside the table, which can end the process.
    """
    for _, m in model.named_modules():
        if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding)):
            return int(m.weight.shape[0])
    raise UserError(f"{type(model).__name__} has no token embedding to take the vocabulary from")


def checkpoint_vocab(path: str | Path) -> int:
    """The vocabulary of a checkpoint folder without reading its weights: the config's model is
    built (MLX allocates nothing until evaluated) and its embedding's rows counted."""
    from .checkpoint import Checkpoint, model_args, model_classes

    ckpt = Checkpoint.open(path)
    where = ckpt.path / "config.json"
    model_cls, _ = model_classes(ckpt.config, where)
    return embedding_rows(model_cls(model_args(ckpt.config, where)))

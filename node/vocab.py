"""The token ids a model accepts: the rows of its token embedding, found by structure, not by name."""

from __future__ import annotations

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

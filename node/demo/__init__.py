"""The embedded demo model, its corpus, and the writers of demo checkpoints."""

from pathlib import Path

HERE = Path(__file__).resolve().parent
# The ready-made demo model shipped in the package (`--model demo`).
MODEL_DIR = HERE / "model"
# The public-domain text it was trained on (see corpus/SOURCE.md).
CORPUS_DIR = HERE / "corpus"

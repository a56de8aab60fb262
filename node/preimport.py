"""What the fork server of node/prefork.py imports once, for every node process it forks: the
non-MLX part of mlx-lm's imports. mlx_lm.utils imports transformers for its tokenizer, and
transformers' import scans its model folders (~1.5 s of a node process's ~2 s start on 2 vCPUs).
MLX itself must not be imported here (see node/prefork.py); tests/integration/test_prefork.py
checks that it is not."""

import os

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # no "PyTorch was not found" per server
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # as mlx_lm's own import sets

from ..common import importcache  # noqa: E402

importcache.install()

import huggingface_hub  # noqa: E402, F401
import transformers  # noqa: E402, F401
from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: E402, F401 - mlx_lm's
from transformers.tokenization_utils_base import PreTrainedTokenizerBase  # noqa: E402, F401

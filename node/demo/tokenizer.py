"""A byte-level BPE tokenizer trained locally on the demo corpus, saved in Hugging Face format."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from . import CORPUS_DIR, MODEL_DIR

EOS = "<|endoftext|>"
SPECIAL_TOKENS = [EOS, "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# Each message is "<|role|>\n<content><|end|>\n"; generation starts after "<|assistant|>\n".
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def corpus_texts(corpus_dir: Path = CORPUS_DIR) -> list[str]:
    files = sorted(corpus_dir.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"no *.txt files in corpus folder {corpus_dir}")
    return [f.read_text(encoding="utf-8") for f in files]


def train_tokenizer(out: Path, vocab_size: int = 1024, corpus_dir: Path = CORPUS_DIR) -> None:
    """Train a byte-level BPE on the corpus and write the tokenizer files into `out`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_texts(corpus_dir), trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "additional_special_tokens": SPECIAL_TOKENS[1:],
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"eos_token": EOS, "pad_token": EOS, "additional_special_tokens": SPECIAL_TOKENS[1:]}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def copy_tokenizer(out: Path, src: Path = MODEL_DIR) -> int:
    """Copy the embedded demo tokenizer into a checkpoint folder; returns its vocabulary size."""
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(src / name, out / name)
    return vocab_size(src)


def vocab_size(folder: Path = MODEL_DIR) -> int:
    data = json.loads((folder / "tokenizer.json").read_text())
    return len(data["model"]["vocab"]) + sum(
        1 for t in data.get("added_tokens", []) if t["content"] not in data["model"]["vocab"]
    )

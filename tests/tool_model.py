"""A copy of the demo checkpoint whose chat template offers tools in the Hermes/Qwen format, which
mlx-lm reads with its `json_tools` parser: <tool_call>{"name": ..., "arguments": {...}}</tool_call>;
and a variant whose weights make greedy decoding write a tool call, whatever the chat.

The variant adds the call's pieces to the tokenizer (as Qwen's tokenizer has <tool_call> as an added
token) and builds the embedding and an untied head as a successor table: a few hidden dimensions
carry one feature per token of the call, the head reads only those, so the token after the
generation prompt's last newline is <tool_call>, then each piece of the call, then end of text. The
other dimensions keep the demo embedding (scaled up) so the layers, the router and the experts run
on the demo's own activations; their updates are too small to move the features.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

# The call the variant writes, one added token per piece (no spaces: the byte-level detokenizer
# reads an added token's characters as bytes, and every printable ASCII character but space is one).
CALL_PIECES = (
    "<tool_call>",
    '{"name":',
    '"get_weather",',
    '"arguments":',
    '{"city":',
    '"Paris"}}',
    "</tool_call>",
)
CALL_TEXT = "".join(CALL_PIECES)
CALL_NAME, CALL_ARGS = "get_weather", {"city": "Paris"}
_AFTER = "\u010a"  # the byte-level token of "\n", the generation prompt's last token
_EOS = 0  # <|endoftext|>
_SCALE = 1000.0  # the embedding's magnitude over the layers' updates

# Qwen2.5's tool template, cut down to the demo tokenizer's roles (<|system|>, <|user|>, <|assistant|>,
# <|end|>); a tool's result goes back as a user turn in <tool_response>, as Qwen's does.
TOOL_TEMPLATE = "".join(
    [
        "{% if tools %}<|system|>\n",
        "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}",
        "# Tools\nYou may call functions. Their signatures are within <tools></tools>:\n<tools>",
        "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n",
        "For each call, return a JSON object with the function name and arguments within "
        "<tool_call></tool_call> tags.<|end|>\n",
        "{% elif messages[0].role == 'system' %}<|system|>\n{{ messages[0].content }}<|end|>\n{% endif %}",
        "{% for message in messages %}",
        "{% if message.role == 'system' and loop.first %}",
        "{% elif message.role == 'assistant' %}<|assistant|>\n{{ message.content }}",
        "{% for tool_call in message.tool_calls or [] %}",
        "{% if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}",
        '\n<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}\n</tool_call>',
        "{% endfor %}<|end|>\n",
        "{% elif message.role == 'tool' %}<|user|>\n<tool_response>\n{{ message.content }}\n</tool_response><|end|>\n",
        "{% else %}<|{{ message.role }}|>\n{{ message.content }}<|end|>\n",
        "{% endif %}",
        "{% endfor %}",
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}",
    ]
)


def demo_dir() -> Path:
    from moe_cluster.node.demo import make

    return Path(make.__file__).resolve().parent / "model"


def tool_checkpoint(out: Path) -> Path:
    """The demo checkpoint in `out` with TOOL_TEMPLATE as its chat template."""
    out.mkdir(parents=True, exist_ok=True)
    for f in demo_dir().iterdir():
        shutil.copy(f, out / f.name)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TOOL_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return out


def calling_checkpoint(out: Path) -> Path:
    """tool_checkpoint, whose greedy output after the generation prompt is CALL_TEXT, then end of text."""
    from safetensors.numpy import load_file, save_file

    tool_checkpoint(out)
    tok_path = out / "tokenizer.json"
    tok = json.loads(tok_path.read_text())
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    ids = list(range(vocab, vocab + len(CALL_PIECES)))
    for i, piece in zip(ids, CALL_PIECES):
        tok["added_tokens"].append(
            {
                "id": i,
                "content": piece,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": False,
            }
        )
    tok_path.write_text(json.dumps(tok))
    cfg = json.loads((out / "config.json").read_text())
    cfg["vocab_size"], cfg["tie_word_embeddings"] = vocab + len(ids), False
    (out / "config.json").write_text(json.dumps(cfg, indent=2))

    w = load_file(str(out / "model.safetensors"))
    embed = w["model.embed_tokens.weight"]  # (vocab, hidden)
    hidden = embed.shape[1]
    after = tok["model"]["vocab"][_AFTER]
    chain = [after, *ids]  # token -> the next one; the last one -> end of text
    feats = len(chain) + 1  # one feature per chain token, one for every other token
    rng = np.random.default_rng(0)
    new = np.concatenate([embed, rng.standard_normal((len(ids), hidden)).astype(embed.dtype)])
    new[:, :feats] = 0
    new *= _SCALE / np.linalg.norm(new, axis=1, keepdims=True)
    new[:, 0] = _SCALE  # "any other token"
    head = np.zeros_like(new)
    head[_EOS, 0] = 1.0
    for f, t in enumerate(chain, start=1):
        new[t, 0], new[t, f] = 0.0, _SCALE
        head[chain[f] if f < len(chain) else _EOS, f] = 1.0
    w["model.embed_tokens.weight"] = new
    w["lm_head.weight"] = head * 100.0
    w["model.norm.weight"] = np.ones_like(w["model.norm.weight"])
    save_file(w, str(out / "model.safetensors"), metadata={"format": "mlx"})
    return out

"""A copy of the demo checkpoint whose chat template offers tools in the Hermes/Qwen format, which
mlx-lm reads with its `json_tools` parser: <tool_call>{"name": ..., "arguments": {...}}</tool_call>."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# Qwen2.5's tool template, cut down to the demo tokenizer's roles (<|system|>, <|user|>, <|assistant|>,
# <|end|>); a tool's result goes back as a user turn in <tool_response>, as Qwen's does.
TOOL_TEMPLATE = "".join([
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
])


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

"""Text as token ids, on the API's worker: a prompt, a chat through the model's template, and
texts too long for the context refused before they are tokenized in full."""

from __future__ import annotations

import json
import logging

from .api_error import INVALID, ApiError
from .openai import check_text

logger = logging.getLogger(__name__)

# A prefix cut inside a word may take a few more tokens than the same text whole: a prefix is only
# called too long past this many tokens over the context.
_CUT_MARGIN = 64
# Texts up to this many characters are tokenized in full (ids handed to Python in ~40 ms at most),
# so a too-long prompt's error gives its exact count; longer ones are counted short first.
_COUNT_FROM = 2**20


class Prompts:
    """The tokenizer's side of a request; every method runs on the API's worker (seconds for a long
    text)."""

    def __init__(self, tokenizer, context_length: int):
        self.tokenizer = tokenizer
        self.context_length = context_length
        self._count_tok = None  # the worker's own tokenizer for counting (see counter)

    def counter(self):
        """The fast tokenizer's Rust core, copied for the worker's counting (None: not a fast one)."""
        if self._count_tok is None:
            backend = getattr(
                getattr(self.tokenizer, "_tokenizer", None), "backend_tokenizer", None
            )
            if backend is None:
                self._count_tok = False  # every prompt is tokenized in full
            else:
                from tokenizers import Tokenizer

                self._count_tok = Tokenizer.from_str(backend.to_str())
                self._count_tok.no_padding()
                self._count_tok.no_truncation()
        return self._count_tok or None

    def refuse_too_long(self, texts: list[str], param: str) -> None:
        """Refuse texts that cannot fit before tokenizing them in full. Tokenizing releases the GIL,
        but handing millions of ids to Python, and freeing them, holds it: 0.13 s per 3 MB of text
        (measured), 0.4 s for 13 MB, all of it a stall of the event loop. So prefixes are counted,
        doubling from `context` characters, until one is over the context or the text is done: no
        step hands Python more than a few times the context in ids."""
        ctx = self.context_length
        if sum(len(t) for t in texts) <= max(ctx, _COUNT_FROM) or self.counter() is None:
            return  # tokenized in full (the error gives the exact count), or no way to count short
        n = 0
        for text in texts:
            size = ctx
            while True:  # encode_batch releases the GIL while it works; encode holds it
                got = len(
                    self.counter().encode_batch([text[:size]], add_special_tokens=False)[0].ids
                )
                if n + got > ctx + _CUT_MARGIN or size >= len(text):
                    break
                size *= 2
            n += got
            if n > ctx + _CUT_MARGIN:
                raise ApiError(
                    INVALID,
                    f"This model's maximum context length is {ctx} tokens. However, your "
                    f"{param} alone is more than {ctx} tokens.",
                    param=param,
                    code="context_length_exceeded",
                )

    def encode(self, prompt: str) -> list[int]:
        """Token ids of a text prompt (on the worker: a long prompt takes seconds)."""
        check_text(prompt, "prompt")
        self.refuse_too_long([prompt], "prompt")
        tok = self.tokenizer
        return list(
            tok.encode(
                prompt,
                add_special_tokens=tok.bos_token is None or not prompt.startswith(tok.bos_token),
            )
        )

    def render(
        self, messages: list[dict], tools: list[dict] | None = None, fields: tuple[dict, ...] = ()
    ) -> list[int]:
        """Token ids of a chat through the model's template, with the tools offered as mlx_lm.server
        hands them to it (on the worker). `fields`: per message, the request's own name of each key
        (errors name it); messages[i].<key> where it says nothing."""
        from jinja2 import TemplateError

        for i, m in enumerate(messages):
            names = fields[i] if fields else {}

            def at(key: str) -> str:
                return names.get(key, f"messages[{i}].{key}")

            check_text(m["content"], at("content"))
            if (
                "tool_calls" in m
            ):  # arguments are objects now: the template writes them as JSON text
                check_text(json.dumps(m["tool_calls"], ensure_ascii=False), at("tool_calls"))
            for key in ("tool_call_id", "name"):  # some templates write them too
                if key in m:
                    check_text(m[key], at(key))
        if tools:
            check_text(json.dumps(tools, ensure_ascii=False), "tools")
            if not self.tokenizer.has_tool_calling:
                logger.warning(
                    "tools offered, but mlx-lm knows no tool-call format for this model's tokenizer: "
                    "its calls come back as text"
                )
        self.refuse_too_long([m["content"] for m in messages], "messages")
        try:
            return list(
                self.tokenizer.apply_chat_template(
                    messages, tools=tools, add_generation_prompt=True, tokenize=True
                )
            )
        except (
            TemplateError
        ) as exc:  # the template refuses these messages; its text is meant for the user
            raise ApiError(
                INVALID, f"the chat template cannot render these messages: {exc}", param="messages"
            ) from None

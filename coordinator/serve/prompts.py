"""Text as token ids, on the API's worker: a prompt, a chat through the model's template, stop
strings and a prediction, and texts too long for the context refused before they are tokenized in
full.

A chat's text stays text: a message that spells one of the tokenizer's special tokens
(`<|im_start|>`, `<|end|>`, ...) gets the ordinary tokens of those characters, never the special
token, so no client can forge a turn of another role; the special tokens come from the template
alone. Such a chat is rendered around a mark per message, the template's text split at its own
special tokens, and each run of text between them (the messages' text inside) tokenized with the
tokenizer's special-token matching off: where the tokenizer splits its input at special tokens
anyway (byte-level BPE, as every checkpoint here), a chat without such text gets exactly the
tokens of the stock path, which every other chat still takes.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import uuid

from .api_error import INVALID, ApiError
from .sampling import check_text
from .tools import FieldError, show

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
        """The fast tokenizer's Rust core, copied for the worker's counting (None: not a fast
        one)."""
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

    def stop_ids(self, stops: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Each stop string's token ids (special tokens parsed: a stop may be one); the nodes end a
        sequence on them at once, as mlx-lm's server does. One the model spells with other tokens
        is still found in the text by the coordinator."""
        ids = (tuple(self.tokenizer.encode(s, add_special_tokens=False)) for s in stops)
        return tuple(t for t in ids if t)

    def prediction(self, text: str) -> tuple[int, ...]:
        """The token ids of OpenAI's `prediction` (guesses for speculative decoding)."""
        if not text:
            return ()
        self.refuse_too_long([text], "prediction.content")
        ids = tuple(self.tokenizer.encode(text, add_special_tokens=False))
        if len(ids) > self.context_length:
            raise FieldError(
                f"'prediction' has {len(ids)} tokens, past this model's context of "
                f"{self.context_length}",
                "prediction",
            )
        return ids

    @functools.cached_property
    def specials(self) -> dict[str, int]:
        """The tokenizer's special tokens, text -> id."""
        hf = getattr(self.tokenizer, "_tokenizer", self.tokenizer)
        added = getattr(hf, "added_tokens_decoder", None) or {}
        return {t.content: i for i, t in added.items() if getattr(t, "special", False)}

    @functools.cached_property
    def _special(self) -> re.Pattern | None:
        """The special tokens, the longest first (as the tokenizer matches them)."""
        texts = sorted(self.specials, key=len, reverse=True)
        return re.compile("|".join(map(re.escape, texts))) if texts else None

    def _find_special(self, text: str) -> str | None:
        m = self._special.search(text) if self._special is not None else None
        return m.group() if m else None

    def render(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        fields: tuple[dict, ...] = (),
        prefill: bool = False,
    ) -> list[int]:
        """Token ids of a chat through the model's template, with the tools offered as mlx_lm.server
        hands them to it (on the worker). `fields`: per message, the request's own name of each key
        (errors name it); messages[i].<key> where it says nothing. `prefill`: the last message (the
        assistant's) is continued: the prompt ends with its text, not with the end of its turn."""
        from jinja2 import TemplateError

        forged = prefill  # whether the chat goes the text-only way
        for i, m in enumerate(messages):
            names = fields[i] if fields else {}

            def at(key: str) -> str:
                return names.get(key, f"messages[{i}].{key}")

            check_text(m["content"], at("content"))
            forged = forged or self._find_special(m["content"]) is not None
            others = {k: m[k] for k in ("tool_call_id", "name") if k in m}  # some templates write
            if "tool_calls" in m:  # arguments are objects now: the template writes them as JSON
                others["tool_calls"] = json.dumps(m["tool_calls"], ensure_ascii=False)
            for key, text in others.items():
                check_text(text, at(key))
                self._refuse_special(text, at(key))
        if tools:
            text = json.dumps(tools, ensure_ascii=False)
            check_text(text, "tools")
            self._refuse_special(text, "tools")
            if not self.tokenizer.has_tool_calling:
                logger.warning(
                    "tools offered, but mlx-lm knows no tool-call format for this model's "
                    "tokenizer: its calls come back as text"
                )
        self.refuse_too_long([m["content"] for m in messages], "messages")
        try:
            if forged:
                return self._as_text(messages, tools, prefill, fields)
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

    def _refuse_special(self, text: str, param: str) -> None:
        """Text the template writes as JSON or as a name cannot be kept apart from its special
        tokens (its escaping is the template's): one that spells a special token is refused."""
        special = self._find_special(text)
        if special is not None:
            raise FieldError(
                f"{param} holds the text of the special token {show(special)}, which only the "
                "chat template may write",
                param,
            )

    def _as_text(
        self, messages: list[dict], tools: list[dict] | None, prefill: bool, fields: tuple
    ) -> list[int]:
        """A chat's ids with every message's text tokenized as text (the module's docstring)."""
        nonce = uuid.uuid4().hex
        marked = [{**m, "content": f"@{nonce}.{i}@"} for i, m in enumerate(messages)]
        kw = {"tools": tools, "add_generation_prompt": not prefill, "tokenize": False}
        parts = re.split(f"@{nonce}\\.(\\d+)@", self.tokenizer.apply_chat_template(marked, **kw))
        frags, where = parts[0::2], [int(i) for i in parts[1::2]]  # template text, message i
        real = self.tokenizer.apply_chat_template(messages, **kw)
        texts = [m["content"] for m in messages]
        if _joined(frags, where, texts) != real:  # a template that trims what it writes
            texts = [t.strip() for t in texts]
            if _joined(frags, where, texts) != real:
                i = next(
                    (i for i, t in enumerate(texts) if self._find_special(t) is not None), None
                )
                if i is None:
                    raise FieldError(
                        "this chat template changes the text it writes, so the last (assistant) "
                        "message cannot be continued",
                        "messages",
                    )
                param = (fields[i] if fields else {}).get("content", f"messages[{i}].content")
                raise FieldError(
                    f"{param} holds the text of the special token "
                    f"{show(self._find_special(texts[i]))}, and this chat template changes the "
                    "text it writes, so it cannot be kept apart from the template's own tokens",
                    param,
                )
        if prefill:
            last = len(messages) - 1
            if last not in where:
                raise FieldError(
                    "the chat template does not write the last (assistant) message's text, so "
                    "it cannot be continued",
                    "messages",
                )
            k = len(where) - 1 - where[::-1].index(last)  # the prompt ends after its text
            frags, where = frags[: k + 1] + [""], where[: k + 1]
        ids: list[int] = []
        run: list[str] = []  # text not tokenized yet: template text and messages' text

        def flush() -> None:
            if run:
                ids.extend(
                    self.tokenizer.encode(
                        "".join(run), add_special_tokens=False, split_special_tokens=True
                    )
                )
                run.clear()

        for j, frag in enumerate(frags):
            at = 0
            for m in self._special.finditer(frag) if self._special is not None else ():
                run.append(frag[at : m.start()])
                flush()
                ids.append(self.specials[m.group()])
                at = m.end()
            run.append(frag[at:])
            if j < len(where):
                run.append(texts[where[j]])
        flush()
        return ids


def _joined(frags: list[str], where: list[int], texts: list[str]) -> str:
    """The template's text with message where[j]'s text after fragment j."""
    out = [frags[0]]
    for j, i in enumerate(where):
        out += [texts[i], frags[j + 1]]
    return "".join(out)

"""Anthropic's Messages API (POST /v1/messages) over the same generation as the OpenAI routes.

A request becomes the chat the template renders (system prompt, user and assistant turns, tool_use
blocks as the assistant's tool calls, tool_result blocks as tool messages); the output is text and
tool_use blocks, streamed with Anthropic's event types. Errors use Anthropic's JSON shape.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from ...proto.records import Sampling
from .sampling import ANTHROPIC_TEMPERATURE, json_kind, parse as sampling_of, stops as stop_strings
from .openai import check_keys
from .tools import FieldError, ToolCall, Tools, check_function, new_call_id, show as _show

# HTTP status -> Anthropic's error type (https://docs.anthropic.com/en/api/errors)
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
MAX_STOPS = 16
# Every key a body may hold (docs/api.md's parameter table lists the same): Anthropic's, then this
# server's own (a seed, and mlx-lm's sampler and processors as on the OpenAI routes). A key of
# neither list is a 400 naming it, as Anthropic's API answers.
KEYS = frozenset(
    (
        "model",
        "messages",
        "max_tokens",
        "system",
        "stop_sequences",
        "stream",
        "temperature",
        "top_p",
        "top_k",
        "tools",
        "tool_choice",
        "metadata",
        "seed",
        "min_p",
        "repetition_penalty",
        "repetition_context_size",
        "presence_penalty",
        "presence_context_size",
        "frequency_penalty",
        "frequency_context_size",
        "logit_bias",
    )
)
# Anthropic's keys this server refuses whatever their value, with the reason
REFUSED = {
    "thinking": "nothing here sets how long a model reasons",
    "service_tier": "this server has one tier",
    "container": "this server runs no tools",
    "mcp_servers": "this server calls no MCP server",
    "context_management": "this server edits no context",
}
# Messages and content blocks of one request at most (system blocks included): far more than any
# context holds as separate turns, and few enough to check in milliseconds.
MAX_BLOCKS = 10_000


def error_body(status: int, message: str) -> dict:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


@dataclass(frozen=True)
class MessagesRequest:
    messages: list[dict]  # the chat as the template reads it (OpenAI's roles)
    tools: Tools | None
    sampling: Sampling
    stops: tuple[str, ...]
    stream: bool
    # per chat message, the request's own field of each of its keys ("content": "system",
    # "tool_call_id": "messages[1].content[0].tool_use_id"): errors name what the client sent
    fields: tuple[dict, ...] = ()
    prefill: bool = False  # the last turn is the assistant's: its text is continued


def parse_request(body: dict, vocab: int = 0) -> MessagesRequest:
    """A Messages API body, checked field by field (FieldError names the field). `vocab`: the
    model's token count (logit_bias ids below it; 0: unknown)."""
    check_keys(body, KEYS, REFUSED, "/v1/messages")
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise FieldError(
            f"'max_tokens' is required: an integer >= 1 (got {_show(max_tokens)})", "max_tokens"
        )
    # Greedy unless asked, as on the OpenAI routes here: recent anthropic clients no longer send
    # temperature at all (older ones and extra_body still may), and the same request should give the
    # same text on either API.
    # (a seed is not Anthropic's, but taken as on the OpenAI routes)
    sampling = sampling_of(body, max_tokens, ANTHROPIC_TEMPERATURE, vocab)
    stops = body.get("stop_sequences")
    if stops is not None and not isinstance(stops, list):
        raise FieldError(
            f"'stop_sequences' must be a list of up to {MAX_STOPS} strings (got "
            f"{json_kind(stops)}: {_show(stops)})",
            "stop_sequences",
        )
    stops = stop_strings(stops, "stop_sequences", MAX_STOPS)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise FieldError(f"'stream' must be a boolean (got {_show(stream)})", "stream")
    _metadata(body.get("metadata"))
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise FieldError(f"'messages' must be a non-empty list (got {_show(messages)})", "messages")
    _check_block_count(body.get("system"), messages)
    chat, fields = [], []
    if body.get("system") is not None:
        chat.append({"role": "system", "content": _text(body["system"], "system")})
        fields.append({"content": "system"})
    for i, m in enumerate(messages):
        for msg, names in _turn(m, f"messages[{i}]"):
            chat.append(msg)
            fields.append(names)
    tools = _tools(body)
    prefill = messages[-1].get("role") == "assistant"
    if prefill:
        last = chat[-1]
        if "tool_calls" in last:
            raise FieldError(
                f"messages[{len(messages) - 1}]: a last assistant turn is text to continue; one "
                "with tool_use blocks needs a user turn with their tool_result blocks after it",
                f"messages[{len(messages) - 1}].content",
            )
        if last["content"] != last["content"].rstrip():
            raise FieldError(
                "final assistant content cannot end with trailing whitespace",
                f"messages[{len(messages) - 1}].content",
            )
    return MessagesRequest(
        chat, tools, sampling, stops, bool(stream), tuple(fields), prefill=prefill
    )


def _metadata(value: Any) -> None:
    """Anthropic's metadata ({"user_id": <string>}): taken, used for nothing (docs/api.md)."""
    if value is None:
        return
    if (
        not isinstance(value, dict)
        or set(value) - {"user_id"}
        or not isinstance(value.get("user_id", ""), (str, type(None)))
    ):
        raise FieldError(
            f"'metadata' must be {{'user_id': <string>}} (got {_show(value)})", "metadata"
        )


def _check_block_count(system: Any, messages: list) -> None:
    """Refuse more content blocks than MAX_BLOCKS before looking at any: counting is a len() per
    message, while checking 400,000 blocks one by one takes seconds."""
    n = (len(system) if isinstance(system, list) else 0) + len(messages)
    n += sum(
        len(m["content"])
        for m in messages
        if isinstance(m, dict) and isinstance(m.get("content"), list)
    )
    if n > MAX_BLOCKS:
        raise FieldError(
            f"'messages' holds {n} messages and content blocks: at most {MAX_BLOCKS} are taken",
            "messages",
        )


def _text(content: Any, where: str) -> str:
    """A string, or a list of text blocks, as one string."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, block in enumerate(content):
            if not (
                isinstance(block, dict)
                and block.get("type") == "text"
                and isinstance(block.get("text"), str)
            ):
                raise FieldError(
                    f"{where}[{j}] must be a text block {{'type': 'text', 'text': <string>}} "
                    f"(got {_show(block)})",
                    f"{where}[{j}]",
                )
            parts.append(block["text"])
        return "".join(parts)
    raise FieldError(
        f"{where} must be a string or a list of text blocks (got {_show(content)})", where
    )


def _turn(m: Any, where: str) -> list[tuple[dict, dict]]:
    """One Messages API turn as chat messages: a user turn's tool results become tool messages
    (before its text); an assistant turn's tool_use blocks become its tool calls. Each comes with
    the request's field of each of its keys."""
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        got = _show(m.get("role")) if isinstance(m, dict) else json_kind(m)
        raise FieldError(
            f"{where} must have a role of user or assistant (got {got})", f"{where}.role"
        )
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [({"role": role, "content": content}, {"content": f"{where}.content"})]
    if not isinstance(content, list):
        raise FieldError(
            f"{where}.content must be a string or a list of content blocks (got {_show(content)})",
            f"{where}.content",
        )
    texts, calls, results = [], [], []
    allowed = ("text", "tool_use") if role == "assistant" else ("text", "tool_result")
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in allowed:
            raise FieldError(
                f"{at} must be a block of type {' or '.join(allowed)} in a {role} turn "
                f"(got {_show(block)})",
                at,
            )
        if kind == "text":
            texts.append(_text([block], f"{where}.content"))
        elif kind == "tool_use":
            name, args, call_id = block.get("name"), block.get("input"), block.get("id")
            if (
                not isinstance(name, str)
                or not isinstance(args, dict)
                or not isinstance(call_id, str)
            ):
                raise FieldError(
                    f"{at} must be {{'type': 'tool_use', 'id': <string>, 'name': <string>, "
                    f"'input': <object>}} (got {_show(block)})",
                    at,
                )
            calls.append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            )
        else:
            call_id, result = block.get("tool_use_id"), block.get("content", "")
            if not isinstance(call_id, str):
                raise FieldError(
                    f"{at}.tool_use_id must be the id of a tool_use block (got {_show(call_id)})",
                    f"{at}.tool_use_id",
                )
            results.append(
                (
                    {
                        "role": "tool",
                        "tool_call_id": call_id,
                        "content": _text(result, f"{at}.content"),
                    },
                    {"content": f"{at}.content", "tool_call_id": f"{at}.tool_use_id"},
                )
            )
    out = list(results)
    if texts or calls or not results:
        msg: dict = {"role": role, "content": "".join(texts)}
        if calls:
            msg["tool_calls"] = calls
        out.append((msg, {"content": f"{where}.content", "tool_calls": f"{where}.content"}))
    return out


def _tools(body: dict) -> Tools | None:
    """Anthropic's tools ({name, description, input_schema}) and tool_choice as OpenAI's."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice is not None:
            raise FieldError(f"'tool_choice' {_show(choice)} needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise FieldError(f"'tools' must be a list (got {_show(tools)})", "tools")
    specs, names = [], set()
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise FieldError(f"tools[{i}] must be an object (got {_show(t)})", f"tools[{i}]")
        if t.get("input_schema") is None:
            raise FieldError(f"tools[{i}].input_schema is required", f"tools[{i}].input_schema")
        fn = check_function(
            t.get("name"),
            t.get("description"),
            t.get("input_schema"),
            f"tools[{i}]",
            schema="input_schema",
        )
        if fn["name"] in names:
            raise FieldError(
                f"tools[{i}]: the tool name {_show(fn['name'])} appears twice", f"tools[{i}].name"
            )
        names.add(fn["name"])
        specs.append({"type": "function", "function": fn})
    kind = choice.get("type") if isinstance(choice, dict) else None
    if choice is None or kind == "auto":
        return Tools(tuple(specs), "auto")
    if kind in ("none", "any"):
        return Tools(tuple(specs), "none" if kind == "none" else "required")
    if kind == "tool":
        name = choice.get("name")
        if name not in names:
            raise FieldError(
                f"'tool_choice' names the tool {_show(name)}, which is not among 'tools' "
                f"({_show(sorted(names)) if names else 'none'})",
                "tool_choice",
            )
        return Tools(tuple(specs), "function", name)
    raise FieldError(
        "'tool_choice' must be {'type': 'auto' | 'any' | 'none'} or {'type': 'tool', 'name': <string>} "
        f"(got {_show(choice)})",
        "tool_choice",
    )


# -- answers ---------------------------------------------------------------------------------


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex[:24]}"


def tool_use_id(call: ToolCall) -> str:
    return (
        call.id
        if call.id.startswith("toolu_")
        else f"toolu_{call.id.removeprefix('call_') or new_call_id()}"
    )


def block(part: str | ToolCall) -> dict:
    if isinstance(part, str):
        return {"type": "text", "text": part}
    return {
        "type": "tool_use",
        "id": tool_use_id(part),
        "name": part.name,
        "input": json.loads(part.arguments),
    }


def stop_reason(reason: str, stop_hit: str | None) -> str:
    """An OpenAI finish reason (the Generation's) as Anthropic's stop reason."""
    return "stop_sequence" if stop_hit is not None else STOP_REASONS.get(reason, "end_turn")


def message(
    mid: str, model: str, parts: list, reason: str, stop_hit: str | None, usage: tuple[int, int]
) -> dict:
    """The whole answer: text and tool_use blocks in the order the model wrote them."""
    blocks: list[dict] = []
    for p in parts:
        if isinstance(p, str) and blocks and blocks[-1]["type"] == "text":
            blocks[-1]["text"] += p
        elif not isinstance(p, str) or p:
            blocks.append(block(p))
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": stop_reason(reason, stop_hit),
        "stop_sequence": stop_hit,
        "usage": {"input_tokens": usage[0], "output_tokens": usage[1]},
    }


def event(kind: str, data: dict) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()


class EventStream:
    """The events of one streamed answer: a text block open while text comes, a tool_use block per call
    (its input in one input_json_delta), then message_delta and message_stop."""

    def __init__(self, mid: str, model: str, input_tokens: int):
        self.mid, self.model, self.input_tokens = mid, model, input_tokens
        self._index = -1
        self._open: str | None = None  # the type of the block open now

    def start(self) -> bytes:
        msg = {
            "id": self.mid,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": self.input_tokens, "output_tokens": 0},
        }
        return event("message_start", {"message": msg}) + event("ping", {})

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        self._open = None
        return event("content_block_stop", {"index": self._index})

    def part(self, p: str | ToolCall) -> bytes:
        if isinstance(p, str):
            if not p:
                return b""
            out = b""
            if self._open != "text":
                out += self._close()
                self._index += 1
                self._open = "text"
                out += event(
                    "content_block_start",
                    {"index": self._index, "content_block": {"type": "text", "text": ""}},
                )
            return out + event(
                "content_block_delta",
                {"index": self._index, "delta": {"type": "text_delta", "text": p}},
            )
        out = self._close()
        self._index += 1
        self._open = "tool_use"
        start = {"type": "tool_use", "id": tool_use_id(p), "name": p.name, "input": {}}
        return (
            out
            + event("content_block_start", {"index": self._index, "content_block": start})
            + event(
                "content_block_delta",
                {
                    "index": self._index,
                    "delta": {"type": "input_json_delta", "partial_json": p.arguments},
                },
            )
        )

    def end(self, reason: str, stop_hit: str | None, output_tokens: int) -> bytes:
        delta = {"stop_reason": stop_reason(reason, stop_hit), "stop_sequence": stop_hit}
        return (
            self._close()
            + event("message_delta", {"delta": delta, "usage": {"output_tokens": output_tokens}})
            + event("message_stop", {})
        )

    def error(self, status: int, message: str) -> bytes:
        return f"event: error\ndata: {json.dumps(error_body(status, message))}\n\n".encode()

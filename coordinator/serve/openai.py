"""OpenAI's API (POST /v1/completions, /v1/chat/completions): a request body checked field by
field on the API's worker, each error a 400 naming the field; the answers' shapes are in
responses.py.

Every key a body may hold is in the route's table below (docs/api.md's parameter table lists the
same, and tests/unit/test_api_params.py holds them to it): a key of neither list is a 400 naming
it, as OpenAI's API answers; a key this server knows but cannot honour is refused with its reason,
or, where the value asks for nothing this server does not do, taken.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ...proto.records import Sampling
from .sampling import OPENAI_TEMPERATURE, check_text, json_kind, parse as sampling_of, stops
from .tools import SHOWN, FieldError, Tools, history_tool_calls, parse_tools, show

if TYPE_CHECKING:
    from .api import ServingOptions

MAX_STOPS = 4  # OpenAI's limit
# The keys both routes take: OpenAI's, then this server's own (mlx-lm's sampler and processors,
# the drafts per step of speculative decoding).
SHARED = (
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "prediction",
    "response_format",
    "user",
    "max_completion_tokens",
    "top_k",
    "min_p",
    "repetition_penalty",
    "repetition_context_size",
    "presence_context_size",
    "frequency_context_size",
    "draft_tokens",
)
COMPLETION_KEYS = frozenset((*SHARED, "prompt", "echo", "best_of", "suffix"))
CHAT_KEYS = frozenset(
    (
        *SHARED,
        "messages",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "top_logprobs",
        "modalities",
    )
)
# OpenAI's chat keys this server refuses whatever their value, with the reason
CHAT_REFUSED = {
    "functions": "the legacy form of 'tools': send 'tools'",
    "function_call": "the legacy form of 'tool_choice': send 'tool_choice'",
    "audio": "this model reads and writes text only",
    "reasoning_effort": "nothing here sets how long a model reasons",
    "verbosity": "nothing here sets how long an answer is but 'max_tokens'",
    "web_search_options": "this server searches nothing",
    "store": "this server stores no request",
    "metadata": "this server stores no request",
    "service_tier": "this server has one tier",
    "prompt_cache_key": "the nodes' prompt cache finds a prefix by its tokens, with no key",
    "safety_identifier": "this server keeps no record of users",
}
COMPLETION_REFUSED = {
    k: CHAT_REFUSED[k] for k in ("store", "metadata", "service_tier", "prompt_cache_key")
}


@dataclass(frozen=True)
class Request:
    """An OpenAI request as the cluster serves it (both routes; each fills its own fields)."""

    sampling: Sampling
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool  # stream_options.include_usage: a usage-only chunk before [DONE]
    draft_tokens: int | None  # drafts per step at most; None: the cluster's setting
    prediction: str  # OpenAI's prediction's text ("": none)
    prompt: str | list = ""  # /v1/completions: text, or token ids (checked by the app)
    echo: bool = False  # /v1/completions: the prompt goes before the completion's text
    messages: tuple[dict, ...] = ()  # /v1/chat/completions: the chat as the template reads it
    tools: Tools | None = None
    prefill: bool = False  # the last message is the assistant's text to continue


def check_keys(body: dict, known: frozenset, refused: dict, route: str) -> None:
    """A key of neither `known` nor `refused` is a 400 naming it; a refused one gives its reason."""
    for key in body:
        if key in known:
            continue
        if key in refused:
            raise FieldError(f"'{key}' is not supported by this server: {refused[key]}", key)
        raise FieldError(
            f"unknown parameter {show(key)}: docs/api.md lists the parameters {route} takes",
            key[:SHOWN],
        )


def _field(
    body: dict, name: str, types: tuple, default: Any = None, *, check=None, what: str = ""
) -> Any:
    if name not in body or body[name] is None:
        return default
    value = body[name]
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        raise FieldError(
            f"'{name}' must be {what or ' or '.join(t.__name__ for t in types)} "
            f"(got {show(value)})",
            name,
        )
    if check is not None and not check(value):
        raise FieldError(f"'{name}' is out of range ({show(value)}): must be {what}", name)
    return value


def _common(body: dict, options: "ServingOptions") -> dict:
    """The fields both routes share, as Request's keyword arguments."""
    max_tokens = _field(
        body,
        "max_tokens",
        (int,),
        options.default_max_tokens,
        check=lambda v: v >= 1,
        what="an integer >= 1",
    )
    max_tokens = _field(
        body,
        "max_completion_tokens",
        (int,),
        max_tokens,
        check=lambda v: v >= 1,
        what="an integer >= 1",
    )
    sampling = sampling_of(body, max_tokens, OPENAI_TEMPERATURE, options.vocab_size)
    stream = _field(body, "stream", (bool,), False, what="a boolean")
    _field(body, "n", (int,), 1, check=lambda v: v == 1, what="1 (one choice per request)")
    _field(body, "user", (str,), None, what="a string")  # taken, used for nothing: docs/api.md
    drafts, prediction = parse_speculation(body, options)
    return {
        "sampling": sampling,
        "stops": stops(body.get("stop"), "stop", MAX_STOPS),
        "stream": stream,
        "include_usage": _stream_options(body.get("stream_options"), stream),
        "draft_tokens": drafts,
        "prediction": prediction,
    }


def _stream_options(value: Any, stream: bool) -> bool:
    """OpenAI's stream_options ({"include_usage": bool}), only beside a stream, as OpenAI says."""
    if value is None:
        return False
    if not stream:
        raise FieldError("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if (
        not isinstance(value, dict)
        or set(value) - {"include_usage"}
        or not isinstance(value.get("include_usage", False), bool)
    ):
        raise FieldError(
            f"'stream_options' must be {{'include_usage': <boolean>}} (got {show(value)})",
            "stream_options",
        )
    return value.get("include_usage", False)


def parse_completion(body: dict, options: "ServingOptions") -> Request:
    """A /v1/completions body, checked (FieldError names the field)."""
    check_keys(body, COMPLETION_KEYS, COMPLETION_REFUSED, "/v1/completions")
    common = _common(body, options)
    echo = check_unsupported_completion(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    ids = isinstance(prompt, list) and prompt and not isinstance(prompt[0], (str, list))
    if not ids and not (isinstance(prompt, str) and prompt):
        raise FieldError(
            f"'prompt' must be a non-empty string (or a list of token ids), got {show(prompt)}",
            "prompt",
        )
    return Request(**common, prompt=prompt, echo=echo)


def parse_chat(body: dict, options: "ServingOptions") -> Request:
    """A /v1/chat/completions body, checked (FieldError names the field)."""
    check_keys(body, CHAT_KEYS, CHAT_REFUSED, "/v1/chat/completions")
    common = _common(body, options)
    check_unsupported(body)
    tools = parse_tools(body)
    if (
        body.get("parallel_tool_calls") is not None
        and _field(body, "parallel_tool_calls", (bool,), True, what="a boolean") is not True
    ):
        raise FieldError(
            "'parallel_tool_calls': false is not supported by this server: nothing limits the "
            "model to one call, and every call it writes is returned",
            "parallel_tool_calls",
        )
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise FieldError(
            f"'modalities' must be ['text']: this model writes text only (got {show(modalities)})",
            "modalities",
        )
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise FieldError(
            f"'messages' must be a non-empty list (got {json_kind(messages)})", "messages"
        )
    clean = tuple(chat_message(m, i, last=i == len(messages) - 1) for i, m in enumerate(messages))
    prefill = clean[-1].pop("prefix", False)
    return Request(**common, messages=clean, tools=tools, prefill=prefill)


def parse_speculation(body: dict, options: "ServingOptions") -> tuple[int | None, str]:
    """(drafts per step, predicted text) a request asks for: `draft_tokens` (this server's
    extension; 0 turns speculation off for the request) and OpenAI's `prediction` ({"type":
    "content", "content": text or text parts}), whose tokens the nodes draft from. A prediction
    only changes speed, never the output: it is taken whether or not the cluster speculates."""
    off = options.speculative == "off"
    limit = 0 if off else options.draft_tokens
    drafts = _field(
        body,
        "draft_tokens",
        (int,),
        None,
        check=lambda v: 0 <= v <= limit or (off and v >= 0),
        what=f"an integer in [0, {limit}] (serving.draft_tokens)",
    )
    if off and drafts:
        raise FieldError(
            "'draft_tokens' needs speculative decoding, which is off on this cluster "
            "(serving.speculative in cluster.yaml)",
            "draft_tokens",
        )
    prediction = body.get("prediction")
    if prediction is None:
        return drafts, ""
    if not (
        isinstance(prediction, dict)
        and prediction.get("type") == "content"
        and "content" in prediction
    ):
        raise FieldError(
            "'prediction' must be {'type': 'content', 'content': <text>} "
            f"(got {show(prediction)})",
            "prediction",
        )
    text = text_content(prediction["content"], "prediction.content")
    check_text(text, "prediction.content")
    return drafts, text


def text_content(content: Any, param: str) -> str:
    """A message's content: a string, or text parts [{"type": "text", "text": ...}] (this model
    reads text only)."""
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not (
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                raise FieldError(
                    f"{param}[{j}] must be {{'type': 'text', 'text': <string>}} (got {show(part)})",
                    param,
                )
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise FieldError(f"{param} must be a string (got {show(content)})", param)
    return content


def chat_message(m: Any, i: int, last: bool = False) -> dict:
    """messages[i] of a chat request as the template reads it: role, text content, and an
    assistant's tool calls or a tool result's call id. The last message, an assistant's with
    `"prefix": true` (as DeepSeek's and Mistral's APIs ask for it), is text to continue: it keeps
    `prefix` for the caller to take."""
    if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
        got = show(m.get("role")) if isinstance(m, dict) else json_kind(m)
        raise FieldError(
            f"messages[{i}] must have a role of system, user, assistant or tool (got {got})",
            f"messages[{i}].role",
        )
    content = m.get("content")
    calls = m.get("tool_calls") if m["role"] == "assistant" else None
    if content is None and calls:  # an assistant turn that only called tools
        content = ""
    out = {"role": m["role"], "content": text_content(content, f"messages[{i}].content")}
    if calls is not None:
        out["tool_calls"] = history_tool_calls(calls, f"messages[{i}].tool_calls")
    prefix = m.get("prefix")
    if prefix is not None:
        if not isinstance(prefix, bool) or (
            prefix and not (last and m["role"] == "assistant" and not calls)
        ):
            raise FieldError(
                f"messages[{i}].prefix: only the last message, an assistant's without tool "
                f"calls, may be a prefix to continue (true) (got {show(prefix)})",
                f"messages[{i}].prefix",
            )
        if last:
            out["prefix"] = prefix
    if m["role"] == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise FieldError(
                f"messages[{i}].tool_call_id must be the id of the call this answers "
                f"(got {show(call_id)})",
                f"messages[{i}].tool_call_id",
            )
        out["tool_call_id"] = call_id
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
    return out


def check_unsupported(body: dict) -> None:
    """Options this server cannot honour are refused, not silently ignored: the nodes send token ids
    only (no log-probabilities), and nothing constrains decoding to JSON."""
    if _field(body, "logprobs", (bool,), False, what="a boolean"):
        raise FieldError("'logprobs' is not supported by this server", "logprobs")
    if _field(
        body, "top_logprobs", (int,), 0, check=lambda v: 0 <= v <= 20, what="an integer in [0, 20]"
    ):
        raise FieldError("'top_logprobs' is not supported by this server", "top_logprobs")
    fmt = body.get("response_format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is not None and kind != "text":
        what = (
            f"{show(kind)} is not supported by this server (only 'text')"
            if isinstance(kind, str)
            else f"must be {{'type': 'text'}} (got {show(fmt)})"
        )
        raise FieldError(f"'response_format' {what}", "response_format")


def check_unsupported_completion(body: dict) -> bool:
    """/v1/completions' options: those it cannot honour are refused, as chat refuses its own (no
    log-probabilities, one choice, no text after the insertion point); returns `echo`."""
    best_of, suffix = body.get("best_of"), body.get("suffix")
    refused = {
        "logprobs": body.get("logprobs") is not None,
        "best_of": best_of is not None and (isinstance(best_of, bool) or best_of != 1),
        "suffix": suffix is not None and suffix != "",
    }
    for name, bad in refused.items():
        if bad:
            raise FieldError(
                f"'{name}' is not supported by this server (got {show(body[name])})", name
            )
    if body.get("response_format") is not None:
        check_unsupported({"response_format": body["response_format"]})
    return _field(body, "echo", (bool,), False, what="a boolean")

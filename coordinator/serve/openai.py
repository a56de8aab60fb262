"""OpenAI's API (POST /v1/completions, /v1/chat/completions): a request body checked field by
field, each error a 400 naming the field; the answers' shapes are in responses.py."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...proto.records import Sampling
from .api_error import INVALID, ApiError
from .sampling import OPENAI_TEMPERATURE, json_kind, parse as sampling_of
from .tools import history_tool_calls, show

if TYPE_CHECKING:
    from .api import ServingOptions


def _field(
    body: dict, name: str, types: tuple, default: Any = None, *, check=None, what: str = ""
) -> Any:
    if name not in body or body[name] is None:
        return default
    value = body[name]
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        raise ApiError(
            INVALID,
            f"'{name}' must be {what or ' or '.join(t.__name__ for t in types)} "
            f"(got {show(value)})",
            param=name,
        )
    if check is not None and not check(value):
        raise ApiError(
            INVALID, f"'{name}' is out of range ({show(value)}): must be {what}", param=name
        )
    return value


def parse_sampling(body: dict, default_max_tokens: int) -> tuple[Sampling, list[str], bool]:
    max_tokens = _field(
        body,
        "max_tokens",
        (int,),
        default_max_tokens,
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
    sampling = sampling_of(body, max_tokens, OPENAI_TEMPERATURE)
    stop = body.get("stop")
    if stop is None:
        stops = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= 4:
        stops = list(stop)
    else:
        raise ApiError(
            INVALID,
            f"'stop' must be a string or a list of up to 4 strings (got {show(stop)})",
            param="stop",
        )
    stops = [s for s in stops if s]
    stream = _field(body, "stream", (bool,), False, what="a boolean")
    n = _field(body, "n", (int,), 1, check=lambda v: v == 1, what="1 (one choice per request)")
    del n
    return sampling, stops, stream


def parse_speculation(body: dict, options: "ServingOptions") -> tuple[int | None, str | None]:
    """(drafts per step, predicted text) a request asks for: `draft_tokens` (this server's
    extension; 0 turns speculation off for the request) and OpenAI's `prediction` ({"type":
    "content", "content": text or text parts}), whose tokens the nodes draft from. A prediction
    only changes speed, never the output: it is taken whether or not the cluster speculates."""
    drafts = body.get("draft_tokens")
    if drafts is not None:
        limit = options.draft_tokens if options.speculative != "off" else 0
        if options.speculative == "off" and drafts != 0:
            raise ApiError(
                INVALID,
                "'draft_tokens' needs speculative decoding, which is off on this cluster "
                "(serving.speculative in cluster.yaml)",
                param="draft_tokens",
            )
        drafts = _field(
            body,
            "draft_tokens",
            (int,),
            None,
            check=lambda v: 0 <= v <= limit,
            what=f"an integer in [0, {limit}] (serving.draft_tokens)",
        )
    prediction = body.get("prediction")
    if prediction is None:
        return drafts, None
    if not (
        isinstance(prediction, dict)
        and prediction.get("type") == "content"
        and "content" in prediction
    ):
        raise ApiError(
            INVALID,
            "'prediction' must be {'type': 'content', 'content': <text>} "
            f"(got {show(prediction)})",
            param="prediction",
        )
    text = text_content(prediction["content"], "prediction.content")
    check_text(text, "prediction.content")
    return drafts, text


def check_text(text: str, param: str) -> None:
    """JSON may carry lone surrogates ("\\ud800"), which no tokenizer takes (a TypeError deep inside)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(
            INVALID,
            f"'{param}' is not valid Unicode text: a lone surrogate at character {exc.start}",
            param=param,
        ) from None


def text_content(content: Any, param: str) -> str:
    """A message's content: a string, or text parts [{"type": "text", "text": ...}] (this model reads text only)."""
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not (
                isinstance(part, dict)
                and part.get("type") == "text"
                and isinstance(part.get("text"), str)
            ):
                raise ApiError(
                    INVALID,
                    f"{param}[{j}] must be {{'type': 'text', 'text': <string>}} (got {show(part)})",
                    param=param,
                )
        content = "".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise ApiError(INVALID, f"{param} must be a string (got {show(content)})", param=param)
    return content


def chat_message(m: Any, i: int) -> dict:
    """messages[i] of a chat request as the template reads it: role, text content, and an assistant's
    tool calls or a tool result's call id."""
    if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
        got = show(m.get("role")) if isinstance(m, dict) else json_kind(m)
        raise ApiError(
            INVALID,
            f"messages[{i}] must have a role of system, user, assistant or tool (got {got})",
            param=f"messages[{i}].role",
        )
    content = m.get("content")
    calls = m.get("tool_calls") if m["role"] == "assistant" else None
    if content is None and calls:  # an assistant turn that only called tools
        content = ""
    out = {"role": m["role"], "content": text_content(content, f"messages[{i}].content")}
    if calls is not None:
        out["tool_calls"] = history_tool_calls(calls, f"messages[{i}].tool_calls")
    if m["role"] == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise ApiError(
                INVALID,
                f"messages[{i}].tool_call_id must be the id of the call this answers "
                f"(got {show(call_id)})",
                param=f"messages[{i}].tool_call_id",
            )
        out["tool_call_id"] = call_id
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
    return out


def check_unsupported(body: dict) -> None:
    """Options this server cannot honour are refused, not silently ignored: the nodes send token ids
    only (no log-probabilities), and nothing constrains decoding to JSON."""
    if _field(body, "logprobs", (bool,), False, what="a boolean"):
        raise ApiError(INVALID, "'logprobs' is not supported by this server", param="logprobs")
    if _field(
        body, "top_logprobs", (int,), 0, check=lambda v: 0 <= v <= 20, what="an integer in [0, 20]"
    ):
        raise ApiError(
            INVALID, "'top_logprobs' is not supported by this server", param="top_logprobs"
        )
    fmt = body.get("response_format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is not None and kind != "text":
        what = (
            f"{kind!r} is not supported by this server (only 'text')"
            if isinstance(kind, str)
            else f"must be {{'type': 'text'}} (got {show(fmt)})"
        )
        raise ApiError(INVALID, f"'response_format' {what}", param="response_format")


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
            raise ApiError(
                INVALID,
                f"'{name}' is not supported by this server (got {show(body[name])})",
                param=name,
            )
    if body.get("response_format") is not None:
        check_unsupported({"response_format": body["response_format"]})
    return _field(body, "echo", (bool,), False, what="a boolean")

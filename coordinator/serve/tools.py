"""Tool calls for the chat APIs: the tools and history a request carries, checked; the model's output
split into text and tool calls by mlx-lm's own text state machine and the tokenizer's tool parser.

The same format rules as `mlx_lm.server`: the chat template renders `tools` (OpenAI's shape) and
assistant `tool_calls` whose arguments are objects; the tokenizer's `tool_call_start`/`tool_call_end`
mark a call in the output and its `tool_parser` reads the text between them. Unlike mlx_lm.server,
a call the parser cannot read is returned as the text the model wrote, never dropped, and a thinking
model's reasoning stays in the text with its markers, as this API returns it without tools.
"""

from __future__ import annotations

import json
import logging
import re
import reprlib
import uuid
from dataclasses import dataclass
from typing import Any, Union

from ...proto.errors import UserError

logger = logging.getLogger(__name__)

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")  # OpenAI's rule for a function's name (plus '.')
CHOICES = ("auto", "none", "required")
SHOWN = 100  # characters of a client's value an error message quotes at most


class FieldError(UserError):
    """Bad input in one field of a request: a 400 naming `param`."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _short_repr() -> reprlib.Repr:
    r = reprlib.Repr()
    r.maxstring = r.maxother = r.maxlong = 80
    r.maxlist = r.maxtuple = r.maxset = r.maxdict = 6
    r.maxlevel = 3
    return r


_SHORT = _short_repr()


def show(value: Any, limit: int = SHOWN) -> str:
    """A value for an error message, cut short: the client sent it and may have sent megabytes,
    so only a bounded part of it is ever turned into text (reprlib), never the whole."""
    text = _SHORT.repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: arguments as a JSON object's text, as OpenAI sends them."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Tools:
    """The tools a request offers the template, and whether the output is read for calls."""

    specs: tuple[
        dict, ...
    ]  # OpenAI's {"type": "function", "function": {...}}, as the template reads them
    choice: str  # auto | none | required | function
    name: str | None = None  # the function tool_choice names

    @property
    def rendered(self) -> list[dict] | None:
        """The tools handed to the chat template (None: render as without tools)."""
        if self.choice == "none" or not self.specs:
            return None
        if self.choice == "function":  # the template offers the named one only
            return [t for t in self.specs if t["function"]["name"] == self.name]
        return list(self.specs)

    @property
    def parsed(self) -> bool:
        return self.rendered is not None


def parse_tools(body: dict) -> Tools | None:
    """`tools` and `tool_choice` of an OpenAI chat request (None: the request offers no tools)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice is not None and choice != "none":
            raise FieldError(f"'tool_choice' {show(choice)} needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise FieldError(f"'tools' must be a list (got {show(tools)})", "tools")
    specs, names = [], set()
    for i, t in enumerate(tools):
        specs.append(function_spec(t, f"tools[{i}]"))
        name = specs[-1]["function"]["name"]
        if name in names:
            raise FieldError(
                f"tools[{i}]: the function name {show(name)} appears twice",
                f"tools[{i}].function.name",
            )
        names.add(name)
    if choice is None:
        return Tools(tuple(specs), "auto")
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise FieldError(
                f"'tool_choice' must be one of {', '.join(CHOICES)} or a function (got {show(choice)})",
                "tool_choice",
            )
        return Tools(tuple(specs), choice)
    fn = (
        choice.get("function")
        if isinstance(choice, dict) and choice.get("type") == "function"
        else None
    )
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise FieldError(
            "'tool_choice' must be a string or {'type': 'function', 'function': {'name': <string>}} "
            f"(got {show(choice)})",
            "tool_choice",
        )
    if name not in names:
        raise FieldError(
            f"'tool_choice' names the function {show(name)}, which is not among 'tools' "
            f"({show(sorted(names)) if names else 'none'})",
            "tool_choice",
        )
    return Tools(tuple(specs), "function", name)


def function_spec(t: Any, where: str) -> dict:
    """One OpenAI tool, checked, as the template reads it: {"type": "function", "function": {...}}."""
    if (
        not isinstance(t, dict)
        or t.get("type") != "function"
        or not isinstance(t.get("function"), dict)
    ):
        raise FieldError(
            f"{where} must be {{'type': 'function', 'function': {{...}}}} (got {show(t)})", where
        )
    fn = t["function"]
    return {
        "type": "function",
        "function": check_function(
            fn.get("name"), fn.get("description"), fn.get("parameters"), f"{where}.function"
        ),
    }


def check_function(
    name: Any, description: Any, parameters: Any, where: str, schema: str = "parameters"
) -> dict:
    """A function tool as the template reads it; `schema`: the request's name of its JSON Schema."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise FieldError(
            f"{where}.name must be 1 to 64 letters, digits, '_', '-' or '.' (got {show(name)})",
            f"{where}.name",
        )
    out: dict[str, Any] = {"name": name}
    if description is not None:
        if not isinstance(description, str):
            raise FieldError(
                f"{where}.description must be a string (got {show(description)})",
                f"{where}.description",
            )
        out["description"] = description
    if parameters is not None:
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise FieldError(
                f"{where}.{schema} must be a JSON Schema object (got {show(parameters)})",
                f"{where}.{schema}",
            )
        out["parameters"] = parameters
    return out


def history_tool_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's `tool_calls` as the template reads them: arguments as an object
    (mlx_lm.server turns the JSON text into one the same way)."""
    if not isinstance(calls, list):
        raise FieldError(f"{where} must be a list (got {show(calls)})", where)
    out = []
    for j, c in enumerate(calls):
        at = f"{where}[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if (
            not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
            or c.get("type", "function") != "function"
        ):
            raise FieldError(
                f"{at} must be {{'type': 'function', 'id': ..., 'function': {{'name': <string>, "
                f"'arguments': <JSON text>}}}} (got {show(c)})",
                at,
            )
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args or "{}")
            except ValueError:
                raise FieldError(
                    f"{at}.function.arguments is not valid JSON ({show(fn['arguments'])})",
                    f"{at}.function.arguments",
                ) from None
        if not isinstance(args, dict):
            raise FieldError(
                f"{at}.function.arguments must be a JSON object (got {show(args)})",
                f"{at}.function.arguments",
            )
        call_id = c.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise FieldError(f"{at}.id must be a string (got {show(call_id)})", f"{at}.id")
        out.append(
            {
                "id": call_id or new_call_id(),
                "type": "function",
                "function": {"name": fn["name"], "arguments": args},
            }
        )
    return out


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# -- the model's output -----------------------------------------------------------------------

Piece = Union[str, ToolCall]


class ToolSplitter:
    """Splits generated text, fed in pieces, into text and tool calls (mlx-lm's TextStateMachine for
    the markers, the tokenizer's tool_parser for a call's text). Text that may be the start of a
    marker is held back until it is known not to be one."""

    def __init__(self, tokenizer, tools: list[dict] | None):
        from mlx_lm.generate import TextStateMachine, make_text_state_machine

        self._sm = TextStateMachine
        self._parser = tokenizer.tool_parser
        self._start, self._end = tokenizer.tool_call_start or "", tokenizer.tool_call_end or ""
        self._tools = tools
        # No stop words: the API has cut the text at the request's own stop strings already.
        if (
            tokenizer.response_transitions
        ):  # a response format decides where calls start: mlx-lm's machine
            machine = make_text_state_machine(tokenizer)
        else:  # the call markers only: other text (a thinking model's <think>) stays as it is without tools
            machine = TextStateMachine(
                {
                    "normal": [(self._start, "tool")],
                    "tool": [(self._end, "normal")] if self._end else [],
                }
                if self._start
                else {}
            )
        self._state = machine.make_state("normal")
        self._call = ""  # the text of the call being written
        self.calls = 0  # calls made, parsed or not

    def feed(self, text: str) -> list[Piece]:
        self._state, segments = self._sm.split(self._state, text)
        return self._pieces(segments)

    def finish(self) -> list[Piece]:
        """The rest: text held back, and a call the output ended inside (parsed if it can be)."""
        self._state, rest, current = self._sm.flush(self._state)
        out = self._pieces([(current, rest)])
        if current == "tool":
            out += self._close(ended=False)
        return out

    def _pieces(self, segments) -> list[Piece]:
        out: list[Piece] = []
        for i, (state, text) in enumerate(segments):
            if i > 0 and segments[i - 1][0] == "tool" and state != "tool":
                out += self._close(ended=True)
            if state == "tool":
                self._call += text
            elif text:
                out.append(text)
        return out

    def _close(self, ended: bool) -> list[Piece]:
        """The call just written: ToolCalls, or the model's own text when the parser cannot read it."""
        text, self._call = self._call, ""
        self.calls += 1
        calls = parse_call(self._parser, text, self._tools)
        if calls is None:
            return [self._start + text + (self._end if ended else "")]
        return calls


def parse_call(parser, text: str, tools: list[dict] | None) -> list[ToolCall] | None:
    """The calls in one call's text by mlx-lm's parser, or None if it is not a well-formed call."""
    try:
        parsed = parser(text, tools)
    # A parser reads what a model wrote: whatever it raises on malformed text (json's ValueError, a
    # regex that did not match, a missing key), the answer is the text, not a 500.
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as exc:
        logger.info(
            "the model's tool call is not well formed (%s: %s): returned as text",
            type(exc).__name__,
            exc,
        )
        return None
    calls = []
    for p in parsed if isinstance(parsed, list) else [parsed]:
        name = p.get("name") if isinstance(p, dict) else None
        args = p.get("arguments", {}) if isinstance(p, dict) else None
        if isinstance(args, str):  # some formats carry the arguments as JSON text
            try:
                args = json.loads(args)
            except ValueError:
                args = None
        if not isinstance(name, str) or not name or not isinstance(args, dict):
            logger.info(
                "the model's tool call has no name or no object of arguments: returned as text"
            )
            return None
        calls.append(
            ToolCall(
                p.get("id") if isinstance(p.get("id"), str) else new_call_id(),
                name,
                json.dumps(args, ensure_ascii=False),
            )
        )
    return calls or None


def split_all(tokenizer, tools: list[dict] | None, text: str) -> tuple[str, list[ToolCall]]:
    """A whole output's text (the calls taken out) and its calls."""
    s = ToolSplitter(tokenizer, tools)
    pieces = s.feed(text) + s.finish()
    return "".join(p for p in pieces if isinstance(p, str)), [
        p for p in pieces if isinstance(p, ToolCall)
    ]

"""Tool calls without a server: the tools a request offers, checked; the model's output split into text
and calls by mlx-lm's state machine and parser (the tokenizer of tests/tool_model.py, json_tools)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from moe_cluster.coordinator.serve.tools import (
    FieldError,
    ToolCall,
    ToolSplitter,
    history_tool_calls,
    parse_tools,
    split_all,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tool_model import tool_checkpoint  # noqa: E402

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from mlx_lm.utils import load_tokenizer

    t = load_tokenizer(tool_checkpoint(tmp_path_factory.mktemp("tool-model")))
    assert t.has_tool_calling and t.tool_call_start == "<tool_call>"
    return t


def fed(tok, text: str, step: int) -> list:
    """The splitter's pieces with the text fed `step` characters at a time, text pieces joined."""
    s = ToolSplitter(tok, [WEATHER])
    pieces = [p for i in range(0, len(text), step) for p in s.feed(text[i : i + step])] + s.finish()
    out: list = []
    for p in pieces:
        if isinstance(p, str) and out and isinstance(out[-1], str):
            out[-1] += p
        else:
            out.append(p)
    return out


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_call_is_split_from_the_text_however_the_text_arrives(tok, step):
    out = fed(tok, "Let me look.\n" + CALL + " Done.", step)
    assert out[0] == "Let me look.\n" and out[2] == " Done." and len(out) == 3
    call = out[1]
    assert isinstance(call, ToolCall) and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.id.startswith("call_")


@pytest.mark.parametrize("step", [1, 1000])
def test_text_without_calls_comes_back_unchanged(tok, step):
    for text in [
        "plain text",
        "a < b and <tool but not a call",
        "ends in a partial marker <tool_ca",
    ]:
        assert fed(tok, text, step) == [text]


@pytest.mark.parametrize(
    "body",
    [
        '{"name": "get_weather", "arguments": {"city": "Par',  # cut short (max_tokens)
        '{"name": "get_weather", "arguments": ',
        "not json at all",
        '["get_weather"]',  # JSON, but not a call
        '{"arguments": {"city": "Paris"}}',  # no name
        '{"name": "get_weather", "arguments": "Paris"}',  # arguments not an object
    ],
)
@pytest.mark.parametrize("closed", [True, False])
def test_a_malformed_call_comes_back_as_the_text_the_model_wrote(tok, body, closed):
    text = "Before " + "<tool_call>" + body + ("</tool_call> after" if closed else "")
    for step in (1, 1000):
        assert fed(tok, text, step) == [text]
    assert split_all(tok, [WEATHER], text) == (text, [])


def test_two_calls_and_an_unterminated_well_formed_one(tok):
    second = (
        '<tool_call>{"name": "get_time", "arguments": {}}'  # the output ended before </tool_call>
    )
    text, calls = split_all(tok, [WEATHER, TIME], CALL + "\n" + second)
    assert text == "\n" and [c.name for c in calls] == ["get_weather", "get_time"]
    assert calls[1].arguments == "{}" and calls[0].id != calls[1].id


def test_tools_and_tool_choice_are_checked_naming_the_field():
    cases = [
        ({"tools": {"a": 1}}, "tools"),
        ({"tools": [{"type": "function"}]}, "tools[0]"),
        ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools[0]"),
        (
            {"tools": [{"type": "function", "function": {"name": "has space"}}]},
            "tools[0].function.name",
        ),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
            "tools[0].function.parameters",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]},
            "tools[0].function.description",
        ),
        ({"tools": [TIME, TIME]}, "tools[1].function.name"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
        ({"tool_choice": "auto"}, "tool_choice"),
    ]
    for body, param in cases:
        with pytest.raises(FieldError) as info:
            parse_tools(body)
        assert info.value.param == param, (body, info.value)


def test_tool_choice_decides_what_the_template_offers():
    assert parse_tools({}) is None and parse_tools({"tool_choice": "none"}) is None
    assert parse_tools({"tools": [WEATHER, TIME]}).rendered == [WEATHER, TIME]
    none = parse_tools({"tools": [WEATHER], "tool_choice": "none"})
    assert none.rendered is None and not none.parsed
    named = parse_tools(
        {
            "tools": [WEATHER, TIME],
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        }
    )
    assert named.rendered == [TIME] and named.parsed


def test_history_calls_get_object_arguments_as_mlx_lm_renders_them():
    calls = history_tool_calls(
        [
            {
                "id": "c1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
        "m",
    )
    assert calls == [
        {
            "id": "c1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
        }
    ]
    for bad, param in [
        ([{"function": {"name": "f", "arguments": "{oops"}}], "m[0].function.arguments"),
        ([{"function": {"name": "f", "arguments": "[1]"}}], "m[0].function.arguments"),
        ([{"function": {"arguments": "{}"}}], "m[0]"),
        ("call", "m"),
    ]:
        with pytest.raises(FieldError) as info:
            history_tool_calls(bad, "m")
        assert info.value.param == param


def test_a_thinking_model_s_reasoning_stays_in_the_text_as_without_tools(tmp_path):
    """mlx-lm's own state machine would strip <think>...</think>; the API returns text as the model
    wrote it (as it does without tools), taking out only the calls."""
    from mlx_lm.utils import load_tokenizer

    path = tool_checkpoint(tmp_path / "thinking")
    tok_json = json.loads((path / "tokenizer.json").read_text())
    for i, t in enumerate(("<think>", "</think>")):
        tok_json["added_tokens"].append(
            {
                "id": 2000 + i,
                "content": t,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": False,
            }
        )
    (path / "tokenizer.json").write_text(json.dumps(tok_json))
    tok = load_tokenizer(path)
    assert tok.has_thinking and tok.has_tool_calling
    text, calls = split_all(tok, [WEATHER], "<think>Paris, so weather.</think>Sure." + CALL)
    assert text == "<think>Paris, so weather.</think>Sure." and [c.name for c in calls] == [
        "get_weather"
    ]

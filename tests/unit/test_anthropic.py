"""The Messages API without a server: a request as the chat the template reads, and the events of a
streamed answer in Anthropic's order."""

from __future__ import annotations

import json

import pytest

from moe_cluster.coordinator.serve.anthropic import EventStream, message, parse_request
from moe_cluster.coordinator.serve.tools import FieldError, ToolCall

TOOL = {"name": "get_weather", "description": "d", "input_schema": {"type": "object"}}


def test_blocks_become_the_chat_the_template_reads():
    r = parse_request(
        {
            "max_tokens": 5,
            "system": [{"type": "text", "text": "Be brief."}],
            "tools": [TOOL],
            "tool_choice": {"type": "tool", "name": "get_weather"},
            "stop_sequences": ["\n\n", ""],
            "messages": [
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Looking."},
                        {
                            "type": "tool_use",
                            "id": "toolu_1",
                            "name": "get_weather",
                            "input": {"city": "Oslo"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "3 C"},
                        {"type": "text", "text": "Thanks"},
                    ],
                },
            ],
        }
    )
    assert r.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Looking.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "3 C"},
        {"role": "user", "content": "Thanks"},
    ]
    assert r.tools.rendered == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "d",
                "parameters": {"type": "object"},
            },
        }
    ]
    assert (
        r.stops == ("\n\n",)
        and r.sampling.max_tokens == 5
        and r.sampling.temperature == 0.0
        and not r.stream
    )
    only_results = parse_request(
        {
            "max_tokens": 1,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}],
                }
            ],
        }
    )
    assert only_results.messages == [{"role": "tool", "tool_call_id": "t", "content": "ok"}]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
        ({"max_tokens": 4, "messages": []}, "messages"),
        ({"max_tokens": 4, "messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
            "messages[0].content[0]",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "assistant", "content": [{"type": "tool_use", "name": "f"}]}],
            },
            "messages[0].content[0]",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "x"}],
                "tools": [{"name": "f"}],
            },
            "tools[0].input_schema",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "x"}],
                "tools": [TOOL],
                "tool_choice": {"type": "tool", "name": "nope"},
            },
            "tool_choice",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "x"}],
                "tool_choice": {"type": "auto"},
            },
            "tool_choice",
        ),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": "x"}], "top_k": -1}, "top_k"),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "x"}],
                "stop_sequences": "x",
            },
            "stop_sequences",
        ),
    ],
)
def test_bad_requests_name_the_field(body, param):
    with pytest.raises(FieldError) as info:
        parse_request(body)
    assert info.value.param == param


def events(raw: bytes) -> list[tuple[str, dict]]:
    out = []
    for chunk in raw.decode().strip().split("\n\n"):
        kind, data = chunk.split("\n")
        out.append((kind.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_a_streamed_answer_opens_and_closes_each_block_in_order():
    call = ToolCall("call_abc", "get_weather", '{"city": "Oslo"}')
    s = EventStream("msg_1", "m", 12)
    got = events(
        s.start()
        + s.part("Let me ")
        + s.part("look.")
        + s.part(call)
        + s.part("")
        + s.end("tool_calls", None, 9)
    )
    assert [k for k, _ in got] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert all(d["type"] == k for k, d in got)
    assert got[0][1]["message"]["usage"] == {"input_tokens": 12, "output_tokens": 0}
    assert got[6][1] == {
        "type": "content_block_start",
        "index": 1,
        "content_block": {
            "type": "tool_use",
            "id": "toolu_abc",
            "name": "get_weather",
            "input": {},
        },
    }
    assert got[7][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"city": "Oslo"}'}
    assert got[9][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    whole = message("msg_1", "m", ["Let me ", "look.", call], "tool_calls", None, (12, 9))
    assert whole["content"] == [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {"city": "Oslo"}},
    ]
    assert message("m", "m", ["a"], "stop", "##", (1, 1))["stop_reason"] == "stop_sequence"

"""Tool calls, the Anthropic Messages API and the dashboard on a real 3-node cluster, through real
HTTP with the official `openai` and `anthropic` clients. The model (tests/tool_model.py) really
writes a tool call: its weights make greedy decoding emit <tool_call>{...}</tool_call> after any
chat, so the parsing, the streaming and the finish reasons are driven end to end; the rendering of
tools and of a history with calls and results is checked against the template rendered here."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import urllib.request
from pathlib import Path

import anthropic
import openai
import pytest

from chromium_page import CHROMIUM_FLAGS
from cluster.cluster_fixture import cluster, http, keyed_yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tool_model import CALL_ARGS, CALL_NAME, CALL_TEXT, calling_checkpoint  # noqa: E402

KEY = "sk-test-agents"
NODES = 3
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CLAUDE_WEATHER = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": WEATHER["function"]["parameters"],
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return calling_checkpoint(tmp_path_factory.mktemp("calling-model"))


@pytest.fixture(scope="module")
def api(tmp_path_factory, model):
    tmp = tmp_path_factory.mktemp("agents")
    yaml = keyed_yaml(NODES, model=str(model))
    with cluster(tmp, yaml, env={"MOE_TEST_API_KEY": KEY}, api_key=KEY) as (url, proc, lines):
        yield url


@pytest.fixture(scope="module")
def oai(api):
    return openai.OpenAI(base_url=api + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(api):
    return anthropic.Anthropic(base_url=api, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tok(model):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(model)


def rendered(tok, messages, tools=None) -> int:
    """Prompt tokens of a chat as mlx_lm.server renders it."""
    return len(
        tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    )


# -- OpenAI: tool calls ------------------------------------------------------------------------


def test_openai_client_gets_the_model_s_tool_call(oai, tok):
    r = oai.chat.completions.create(model="", messages=ASK, tools=[WEATHER], max_tokens=32)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert (
        call.type == "function" and call.function.name == CALL_NAME and call.id.startswith("call_")
    )
    assert json.loads(call.function.arguments) == CALL_ARGS
    assert r.usage.prompt_tokens == rendered(tok, ASK, [WEATHER])  # the template saw the tools


def test_openai_client_streams_the_tool_call_as_openai_does(oai):
    chunks = list(
        oai.chat.completions.create(
            model="", messages=ASK, tools=[WEATHER], max_tokens=32, stream=True
        )
    )
    deltas = [
        c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls
    ]
    assert len(deltas) == 2, deltas  # id and name first, then the arguments
    head, args = deltas[0][0], deltas[1][0]
    assert head.index == 0 and head.id.startswith("call_") and head.function.name == CALL_NAME
    assert head.function.arguments == "" and args.index == 0 and args.id is None
    assert json.loads(args.function.arguments) == CALL_ARGS
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)


def test_without_tools_or_with_tool_choice_none_the_call_is_text(oai, tok):
    for extra in ({}, {"tools": [WEATHER], "tool_choice": "none"}):
        r = oai.chat.completions.create(model="", messages=ASK, max_tokens=32, **extra)
        assert r.choices[0].message.content == CALL_TEXT and not r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "stop"
        assert r.usage.prompt_tokens == rendered(
            tok, ASK
        )  # tool_choice none: the template offers none


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_short_comes_back_as_the_model_s_text(oai, stream):
    """max_tokens ends the output inside the call: malformed JSON, returned as text, not a 500."""
    kw = dict(model="", messages=ASK, tools=[WEATHER], max_tokens=3)
    if stream:
        chunks = list(oai.chat.completions.create(stream=True, **kw))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
        finish = chunks[-1].choices[0].finish_reason
    else:
        r = oai.chat.completions.create(**kw)
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert not r.choices[0].message.tool_calls
    assert text == '<tool_call>{"name":"get_weather",' and finish == "length"


def test_a_history_with_calls_and_results_is_rendered_by_the_template(oai, tok):
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    r = oai.chat.completions.create(model="", messages=history, tools=[WEATHER], max_tokens=32)
    as_mlx_lm = history[:1] + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        history[2],
    ]
    assert r.usage.prompt_tokens == rendered(tok, as_mlx_lm, [WEATHER])
    assert "18 C, sunny" in tok.apply_chat_template(
        as_mlx_lm, tools=[WEATHER], add_generation_prompt=True, tokenize=False
    )
    assert r.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize(
    "body, param",
    [
        (
            {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
            "tools[0].function.name",
        ),
        ({"tools": [{"type": "function"}]}, "tools[0]"),
        (
            {
                "tools": [WEATHER],
                "tool_choice": {"type": "function", "function": {"name": "get_time"}},
            },
            "tool_choice",
        ),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
                ]
            },
            "messages[0].content",
        ),
        (
            {
                "messages": ASK
                + [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {
                                "id": "c",
                                "type": "function",
                                "function": {"name": "f", "arguments": "{nope"},
                            }
                        ],
                    }
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
        ({"messages": ASK + [{"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
        ({"logprobs": True}, "logprobs"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
    ],
)
def test_bad_tools_and_content_are_400_in_openai_s_shape(api, body, param):
    code, reply = http(
        api,
        "/v1/chat/completions",
        {"messages": ASK, "max_tokens": 4, **body},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert code == 400, reply
    assert reply["error"]["type"] == "invalid_request_error" and reply["error"]["param"] == param, (
        reply
    )


# -- Anthropic Messages ------------------------------------------------------------------------


def test_anthropic_client_gets_the_same_text_as_the_openai_route(oai, claude):
    text = (
        oai.chat.completions.create(model="", messages=ASK, max_tokens=32, temperature=0)
        .choices[0]
        .message.content
    )
    m = claude.messages.create(
        model="", messages=ASK, max_tokens=32
    )  # greedy unless asked, as the OpenAI route
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == text == CALL_TEXT
    assert m.stop_reason == "end_turn" and m.role == "assistant" and m.id.startswith("msg_")
    # clients that still send temperature (this one no longer has the argument) get the same
    with claude.messages.stream(
        model="", messages=ASK, max_tokens=32, extra_body={"temperature": 0}
    ) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert (
        streamed == text
        and final.stop_reason == "end_turn"
        and final.usage.output_tokens == m.usage.output_tokens
    )


def test_anthropic_system_stop_sequences_and_max_tokens(claude, tok):
    m = claude.messages.create(
        model="", system="Be brief.", messages=ASK, max_tokens=32, stop_sequences=['"arguments"']
    )
    assert m.content[0].text == CALL_TEXT[: CALL_TEXT.index('"arguments"')]
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == '"arguments"'
    assert m.usage.input_tokens == rendered(tok, [{"role": "system", "content": "Be brief."}] + ASK)
    short = claude.messages.create(model="", messages=ASK, max_tokens=2)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_client_gets_a_tool_use_block(claude, stream):
    kw = dict(model="", messages=ASK, max_tokens=32, tools=[CLAUDE_WEATHER])
    if stream:
        with claude.messages.stream(**kw) as s:
            types = [e.type for e in s]
            m = s.get_final_message()
        assert "input_json" in types and types[-1] == "message_stop"
    else:
        m = claude.messages.create(**kw)
    [use] = m.content
    assert (
        use.type == "tool_use"
        and use.name == CALL_NAME
        and use.input == CALL_ARGS
        and use.id.startswith("toolu_")
    )
    assert m.stop_reason == "tool_use"


def test_anthropic_tool_results_in_the_history(claude, tok):
    history = ASK + [
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Looking."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "toolu_1",
                    "content": [{"type": "text", "text": "18 C"}],
                },
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    m = claude.messages.create(model="", messages=history, max_tokens=32, tools=[CLAUDE_WEATHER])
    as_chat = ASK + [
        {
            "role": "assistant",
            "content": "Looking.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18 C"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert m.usage.input_tokens == rendered(tok, as_chat, [WEATHER])
    assert m.stop_reason == "tool_use"


@pytest.mark.parametrize(
    "body",
    [
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "tool_use", "id": "x", "name": "f", "input": {}}],
                }
            ]
        },
        {"messages": [{"role": "system", "content": "hi"}]},
        {"tools": [{"name": "get_weather"}]},  # no input_schema
        {"tools": [CLAUDE_WEATHER], "tool_choice": {"type": "tool", "name": "get_time"}},
        {"max_tokens": 0},
        {"extra_body": {"temperature": 1.5}},
    ],
)
def test_bad_anthropic_requests_are_400_in_anthropic_s_shape(claude, body):
    kw = {"model": "", "messages": ASK, "max_tokens": 8, **body}
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(**kw)
    assert (
        info.value.body["type"] == "error"
        and info.value.body["error"]["type"] == "invalid_request_error"
    )


def test_anthropic_auth_uses_the_same_key_as_x_api_key(api):
    with pytest.raises(anthropic.AuthenticationError) as info:
        anthropic.Anthropic(base_url=api, api_key="wrong", max_retries=0).messages.create(
            model="", messages=ASK, max_tokens=4
        )
    assert info.value.body["error"]["type"] == "authentication_error"


# -- the dashboard in headless Chromium ----------------------------------------------------------

DASHBOARD_FILES = Path(__file__).resolve().parents[2] / "coordinator" / "serve" / "dashboard"


def dashboard_dom(url: str, profile: Path) -> str:
    """The dashboard's DOM after its script ran (Chromium's virtual time covers a few polls)."""
    import subprocess

    r = subprocess.run(
        [
            shutil.which("chromium"),
            *CHROMIUM_FLAGS,
            "--virtual-time-budget=2500",
            f"--user-data-dir={profile}",
            "--dump-dom",
            f"{url}/#key={KEY}",
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert r.returncode == 0 and "</html>" in r.stdout, r.stderr[-2000:]
    return r.stdout


def heat_cells(dom: str) -> dict[tuple[int, int], int]:
    """(layer, expert) -> the selections the heat map shows."""
    cells = {}
    for row in re.finditer(r'<tr data-layer="(\d+)">(.*?)</tr>', dom, re.S):
        for cell in re.finditer(r'<td data-expert="(\d+)" data-tokens="(\d+)"', row.group(2)):
            cells[int(row.group(1)), int(cell.group(1))] = int(cell.group(2))
    return cells


def test_the_dashboard_files_load_nothing_from_outside(api):
    for f in DASHBOARD_FILES.iterdir():
        text = f.read_text()
        assert "https://" not in text and "//cdn" not in text, f
        assert set(re.findall(r"http://[^\s\"'`]+", text)) <= {"http://www.w3.org/2000/svg"}, (
            f
        )  # a namespace
    with urllib.request.urlopen(api + "/") as r:
        assert "default-src 'self'" in r.headers["Content-Security-Policy"]


@pytest.mark.needs(
    None if shutil.which("chromium") else "no chromium on PATH to load the dashboard in",
    "apt-get install chromium (CI's .ci/run installs it)",
)
def test_the_dashboard_shows_every_node_and_the_heat_map_moves_after_a_request(api, oai, tmp_path):
    before = dashboard_dom(api, tmp_path / "profile")
    assert int(re.search(r'data-updates="(\d+)"', before).group(1)) >= 2  # it polls
    assert re.search(r'id="state" class="badge ready">ready<', before)
    rows = re.findall(r'<tr data-node="(node-\d)">.*?class="state-(\w+)"', before, re.S)
    assert rows == [(f"node-{i}", "ready") for i in range(NODES)]
    assert len(re.findall(r'<g data-node="node-\d">', before)) == NODES
    assert (
        len(re.findall(r'<line [^>]*class="up"', before)) == NODES * (NODES - 1) // 2
    )  # the mesh's links
    held = re.findall(r'data-holders="(node-\d)"', before)
    assert sorted(set(held)) == [f"node-{i}" for i in range(NODES)]  # the placement overlaid
    cells = heat_cells(before)
    assert cells and len({layer for layer, _ in cells}) >= 2

    oai.chat.completions.create(
        model="", messages=[{"role": "user", "content": "Something else entirely"}], max_tokens=16
    )
    after = dashboard_dom(api, tmp_path / "profile")
    moved = heat_cells(after)
    assert moved.keys() == cells.keys() and sum(moved.values()) > sum(cells.values())
    # the same numbers as /metrics
    code, metrics = http(api, "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    for layer, expert, n in re.findall(
        r'moe_cluster_expert_selections_total\{layer="(\d+)",expert="(\d+)"\} (\d+)', metrics
    ):
        assert moved[int(layer), int(expert)] == int(n)
    generated = re.search(r"^moe_cluster_generated_tokens_total (\d+)$", metrics, re.M).group(1)
    assert re.search(rf'<b id="tokens">{generated}</b>', after)


def test_status_prints_a_table_and_watches(api):
    import os
    import subprocess

    env = {**os.environ, "MOE_CLUSTER_API_KEY": KEY}
    cmd = [sys.executable, "-m", "moe_cluster.coordinator.cli", "status", "--url", api]
    r = subprocess.run(
        [*cmd, "--watch", "0.2", "--count", "2"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert r.returncode == 0, r.stderr
    tables = r.stdout.split("cluster ready")
    assert len(tables) == 3 and "all-reduce p50" in tables[1]  # two refreshes
    for i in range(NODES):
        row = next(line for line in tables[2].splitlines() if line.startswith(f"node-{i} "))
        assert " ready " in row and "<= " in row and " ms" in row  # the node has all-reduced
    r = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=60, env=env)
    nodes = json.loads(r.stdout)["nodes"]
    assert [n["name"] for n in nodes] == [f"node-{i}" for i in range(NODES)]
    for n in nodes:  # each node's decode route, chosen at load (node/moe/route.py)
        assert n["route"] in ("skip", "device", "host"), n
        # measured at load (cluster.yaml's route: measure): every route it has, timed
        assert n["route_us"] and n["route"] == min(n["route_us"], key=n["route_us"].get), n
        row = next(line for line in tables[2].splitlines() if line.startswith(f"{n['name']} "))
        assert f" {n['route']} " in row

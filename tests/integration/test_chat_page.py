"""The chat beside the dashboard, driven in headless Chromium against a real 2-node `moe-cluster up`
of the demo model with an API key: the page asks for the key, streams the same greedy answer as the
`openai` client, stops a long answer so the cluster runs nothing, keeps the conversation in local
storage (reload, export, clear) and shows model output that holds HTML as text. Chromium gets real
key presses and clicks on the page as served, under the dashboard's own Content-Security-Policy."""

from __future__ import annotations

import base64
import json
import re
import shutil
import time

import openai
import pytest

from chromium_page import Page
from cluster.cluster_fixture import cluster, http, keyed_yaml

KEY = "sk-test-chat"
AUTH = {"Authorization": f"Bearer {KEY}"}
SYSTEM = "You are a player in a Shakespeare play."
HOSTILE = (
    "Here it is:\n<script>window.__pwned = 1</script>\n"
    '<img src=x onerror="window.__pwned = 2">\n**bold** and `<b>code</b>`\n'
    "```html\n<script>window.__pwned = 3</script>\n```\n## Steps\n- one <u>\n- two\n"
)

pytestmark = pytest.mark.needs(
    None if shutil.which("chromium") else "no chromium on PATH to load the chat in",
    "apt-get install chromium (CI's .ci/run installs it)",
)


LAST = "document.querySelector('#messages .msg.assistant:last-child')"  # the newest answer's node
ANSWERS = "document.querySelectorAll('#messages .msg.assistant').length"
SEND_OFF = "document.getElementById('send').disabled"
LOCK = "document.getElementById('chat-lock')"


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chat")
    yaml = keyed_yaml(2)
    with cluster(tmp, yaml, env={"MOE_TEST_API_KEY": KEY}, api_key=KEY) as (url, proc, lines):
        yield url


@pytest.fixture(scope="module")
def oai(api):
    return openai.OpenAI(base_url=api + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def browser(api, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chromium")
    (tmp / "downloads").mkdir()
    p = Page(tmp / "profile", tmp / "downloads")
    p.downloads = tmp / "downloads"
    yield p
    p.close()


@pytest.fixture
def page(api, browser):
    """The page with the key in this browser, an empty conversation and greedy sampling."""
    browser.open(api + "/")
    browser.js(f"localStorage.clear(); localStorage.setItem('moe-cluster-key', '{KEY}')")
    browser.open(api + "/")
    browser.wait(f"!{SEND_OFF}", what="the chat to unlock")
    browser.js("document.getElementById('chat-settings').open = true")
    return browser


def running(api) -> int:
    return http(api, "/v1/cluster/status", headers=AUTH)[1]["running"]


def cancelled(api) -> int:
    metrics = http(api, "/metrics", headers=AUTH)[1]
    line = re.search(r'^moe_cluster_requests_total\{outcome="cancelled"\} (\S+)$', metrics, re.M)
    return int(float(line.group(1)))


def ask(page, text: str) -> dict:
    """Type a message, press Enter, wait for the whole answer; the answer's node's data."""
    n = page.js(ANSWERS)
    page.type("prompt", text, enter=True)
    page.wait(
        f"{ANSWERS} === {n + 1} && {LAST}.dataset.state !== 'streaming'",
        timeout=120,
        what="the answer",
    )
    return page.js(f"({{...{LAST}.dataset, meta: {LAST}.querySelector('.meta').textContent}})")


def test_the_page_asks_for_the_key_and_cannot_chat_without_it(api, browser):
    browser.open(api + "/")
    browser.js("localStorage.clear()")
    browser.open(api + "/")
    lock = browser.wait(f"!{LOCK}.hidden && {LOCK}.textContent", what="the chat to ask for the key")
    assert "needs its API key" in lock
    assert browser.js(SEND_OFF) and not browser.js("document.getElementById('auth').hidden")
    browser.type("prompt", "Hello there", enter=True)  # Enter and a click do nothing while locked
    browser.click("send")
    time.sleep(0.5)
    assert browser.js("document.querySelectorAll('#messages .msg').length") == 0
    assert browser.stored() == []
    browser.js("document.getElementById('prompt').value = ''")
    browser.type("key", "sk-wrong")
    browser.click("use-key")
    browser.wait(f"{LOCK}.textContent.includes('refused')", what="the wrong key refused")
    assert browser.js(SEND_OFF)
    browser.type("key", KEY)
    browser.click("use-key")
    assert browser.wait("document.getElementById('chat-model').textContent") == "demo"
    assert browser.wait(f"!{SEND_OFF}") and browser.js(f"{LOCK}.hidden")
    # a key that stops working after the page checked it: the request is refused, the chat locks
    browser.js("localStorage.setItem('moe-cluster-key', 'sk-wrong')")
    browser.type("prompt", "Hello there", enter=True)
    browser.wait(f"!!{LAST} && {LAST}.dataset.state === 'error'", what="the refused request")
    assert "missing or wrong API key" in browser.js(f"{LAST}.textContent")
    browser.wait(f"{SEND_OFF} && !{LOCK}.hidden", what="the chat to lock again")


def test_the_streamed_answer_is_the_openai_client_s(page, oai):
    page.set_field("system", SYSTEM)
    page.set_field("temperature", "0")
    page.set_field("top-p", "1")
    page.set_field("max-tokens", "40")
    first = ask(page, "To be, or not to be")
    assert first["state"] == "done", first
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "To be, or not to be"},
    ]
    ref = oai.chat.completions.create(model="demo", messages=messages, temperature=0, max_tokens=40)
    stored = page.stored()
    assert [m["role"] for m in stored] == ["user", "assistant"]
    text = ref.choices[0].message.content
    assert text and stored[1]["content"] == text
    assert int(first["pieces"]) > 1  # streamed, piece by piece
    tokens = ref.usage.completion_tokens
    assert stored[1]["stats"]["tokens"] == tokens
    assert "first token" in first["meta"] and "tok/s" in first["meta"], first
    assert f"{tokens} tokens" in first["meta"], first
    # what the page shows is the model's text (no Markdown in this model's Shakespeare)
    shown = page.js(f"{LAST}.querySelector('.body').textContent")
    assert re.sub(r"\s", "", shown) == re.sub(r"\s", "", text)

    # the second turn carries the first: the same as the client sending the whole history
    second = ask(page, "Speak again")
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Speak again"}]
    ref2 = oai.chat.completions.create(
        model="demo", messages=messages, temperature=0, max_tokens=40
    )
    assert second["state"] == "done"
    assert page.stored()[3]["content"] == ref2.choices[0].message.content
    assert ref2.usage.prompt_tokens > ref.usage.prompt_tokens + tokens  # it saw the history


def test_stop_cancels_the_answer_on_the_cluster(api, page):
    page.set_field("max-tokens", "3000")  # about 90 s of this model on 2 cores
    before = cancelled(api)
    page.type("prompt", "Tell me a long tale of kings", enter=True)
    page.wait(
        f"{ANSWERS} === 1 && Number({LAST}.dataset.pieces) >= 5",
        timeout=120,
        what="the answer to start",
    )
    # the dashboard beside the chat sees the request running
    page.wait(
        "document.getElementById('running').textContent === '1'",
        timeout=10,
        what="the dashboard's running count",
    )
    assert running(api) == 1
    page.click("stop")
    page.wait(f"{LAST}.dataset.state === 'stopped'", timeout=10, what="the answer to stop")
    deadline = time.monotonic() + 10
    while running(api) != 0:
        assert time.monotonic() < deadline, "the cluster still runs the stopped request"
        time.sleep(0.1)
    # a caller that left frees its slot at once; its count lands when the nodes have ended it
    while cancelled(api) != before + 1:
        assert time.monotonic() < deadline + 10, (cancelled(api), before)
        time.sleep(0.1)
    page.wait(
        "document.getElementById('running').textContent === '0'",
        timeout=10,
        what="the dashboard's running count",
    )
    stopped = page.stored()[-1]
    assert stopped["stopped"] and stopped["content"] and stopped["stats"]["tokens"] < 3000
    assert not page.js(SEND_OFF) and page.js("document.getElementById('stop').disabled")


def test_the_conversation_survives_a_reload_and_exports_as_json(api, page):
    page.set_field("system", SYSTEM)
    page.set_field("max-tokens", "8")
    assert ask(page, "Good morrow")["state"] == "done"
    stored = page.stored()
    assert len(stored) == 2 and stored[1]["content"]
    page.open(api + "/")
    page.wait(f"!{SEND_OFF}", what="the chat to unlock")
    assert page.js("document.querySelectorAll('#messages .msg').length") == 2
    assert page.js(f"{LAST}.querySelector('.body').textContent").strip()
    assert page.js("document.getElementById('system').value") == SYSTEM  # the settings too
    page.click("export")
    deadline = time.monotonic() + 10
    while not list(page.downloads.glob("*.json")):
        assert time.monotonic() < deadline, "no export downloaded"
        time.sleep(0.1)
    [f] = page.downloads.glob("*.json")
    doc = json.loads(f.read_text())
    assert doc["messages"] == stored and doc["model"] == "demo"
    assert doc["settings"]["system"] == SYSTEM and doc["settings"]["max_tokens"] == "8"
    page.click("clear")
    assert page.js("document.querySelectorAll('#messages .msg').length") == 0
    assert page.stored() == []
    assert page.js("window.__csp") == []  # nothing the page did tripped its Content-Security-Policy


def shown_as_text(page) -> None:
    """HOSTILE, the newest answer, is on the page as text: no element of it ran or was made."""
    time.sleep(0.5)
    assert page.js("window.__pwned") is None
    made = "document.querySelectorAll('#messages script, #messages img, #messages b').length"
    assert page.js(made) == 0
    body = page.js(f"{LAST}.querySelector('.body').textContent")
    assert "<script>window.__pwned = 1</script>" in body and 'onerror="window.__pwned = 2"' in body
    # the Markdown around it is drawn: bold, inline code and a fenced block, each holding text only
    assert page.js(f"{LAST}.querySelector('strong').textContent") == "bold"
    assert page.js(f"{LAST}.querySelector('p code').textContent") == "<b>code</b>"
    assert page.js(f"{LAST}.querySelector('pre').dataset.lang") == "html"
    code = page.js(f"{LAST}.querySelector('pre code').textContent")
    assert code == "<script>window.__pwned = 3</script>"
    assert page.js(f"{LAST}.querySelector('h3').textContent") == "Steps"
    assert page.js(f"[...{LAST}.querySelectorAll('ul > li')].map((e) => e.textContent)") == [
        "one <u>",
        "two",
    ]
    assert page.js("window.__csp") == []


def test_a_streamed_answer_with_html_is_shown_as_text(api, page):
    """The demo model writes no HTML, so the browser gets this answer in place of the cluster's: the
    page's own request, paused by Chromium and answered with HOSTILE in OpenAI's stream format."""
    page.call("Fetch.enable", patterns=[{"urlPattern": "*/v1/chat/completions"}])
    try:
        page.type("prompt", "Show me some HTML", enter=True)
        paused = page.event("Fetch.requestPaused")
        assert json.loads(paused["request"]["postData"])["stream"] is True
        chunk = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": "demo"}
        pieces = [HOSTILE[i : i + 7] for i in range(0, len(HOSTILE), 7)]
        events = [
            {**chunk, "choices": [{"index": 0, "delta": {"content": p}, "finish_reason": None}]}
            for p in pieces
        ]
        events.append(
            {
                **chunk,
                "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                "usage": {
                    "prompt_tokens": 9,
                    "completion_tokens": len(pieces),
                    "total_tokens": 9 + len(pieces),
                },
            }
        )
        sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        page.call(
            "Fetch.fulfillRequest",
            requestId=paused["requestId"],
            responseCode=200,
            responseHeaders=[{"name": "Content-Type", "value": "text/event-stream"}],
            body=base64.b64encode(sse.encode()).decode(),
        )
    finally:
        page.call("Fetch.disable")
    page.wait(f"{LAST}.dataset.state === 'done'", what="the answer")
    assert page.stored()[-1]["content"] == HOSTILE
    shown_as_text(page)


def test_a_restored_answer_with_html_is_shown_as_text(api, page):
    # with entries no page wrote (a store edited by hand): left out, the rest still drawn
    convo = {
        "messages": [
            None,
            {"role": "user", "content": "<i>hi</i>"},
            {"role": "system"},
            {"role": "assistant", "content": {"html": "<b>x</b>"}},
            {"role": "assistant", "content": HOSTILE, "stats": {"tps": "fast"}},
        ]
    }
    page.js(f"localStorage.setItem('moe-cluster-chat', {json.dumps(json.dumps(convo))})")
    page.open(api + "/")
    page.wait(f"!!{LAST}", what="the restored answer")
    assert page.js("document.querySelector('#messages .msg.user').textContent") == "<i>hi</i>"
    assert page.js("document.querySelectorAll('#messages i').length") == 0
    assert page.js("document.querySelectorAll('#messages .msg').length") == 2
    shown_as_text(page)

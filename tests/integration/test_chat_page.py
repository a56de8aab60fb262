"""The chat beside the dashboard, driven in headless Chromium against a real 2-node `moe-cluster up` of
the demo model with an API key: the page asks for the key, streams the same greedy answer as the
`openai` client, stops a long answer so the cluster runs nothing, keeps the conversation in local
storage (reload, export, clear) and shows model output that holds HTML as text. Chromium gets real key
presses and clicks on the page as served, under the dashboard's own Content-Security-Policy."""

from __future__ import annotations

import json
import re
import shutil
import time

import openai
import pytest

from chromium_page import Page
from cluster.cluster_fixture import cluster, http, yaml_for

KEY = "sk-test-chat"
AUTH = {"Authorization": f"Bearer {KEY}"}
SYSTEM = "You are a player in a Shakespeare play."
HOSTILE = ("Here it is:\n<script>window.__pwned = 1</script>\n<img src=x onerror=\"window.__pwned = 2\">\n"
           "**bold** and `<b>code</b>`\n```html\n<script>window.__pwned = 3</script>\n```\n")

pytestmark = pytest.mark.skipif(shutil.which("chromium") is None,
                                reason="Debian's chromium is not installed here (apt-get install chromium): "
                                       "no browser to load the chat in")


LAST_ANSWER = "document.querySelector('#messages .msg.assistant:last-child')"


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chat")
    # heartbeats every 2 s: on a loaded 2-core machine with Chromium running, 0.5 s can call a busy node dead
    yaml = yaml_for(2, extra="api:\n  api_key_env: MOE_TEST_API_KEY\n").replace("heartbeat: 0.5s", "heartbeat: 2s")
    assert "heartbeat: 2s" in yaml
    with cluster(tmp, yaml, env={"MOE_TEST_API_KEY": KEY}, api_key=KEY) as (url, proc, lines):
        yield url


@pytest.fixture(scope="module")
def oai(api):
    return openai.OpenAI(base_url=api + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def page(api, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("chromium")
    (tmp / "downloads").mkdir()
    p = Page(tmp / "profile", tmp / "downloads")
    p.downloads = tmp / "downloads"
    p.open(api + "/")
    yield p
    p.close()


def running(api) -> int:
    return http(api, "/v1/cluster/status", headers=AUTH)[1]["running"]


def cancelled(api) -> int:
    metrics = http(api, "/metrics", headers=AUTH)[1]
    line = next(s for s in metrics.splitlines() if s.startswith('moe_cluster_requests_total{outcome="cancelled"}'))
    return int(float(line.split()[-1]))


def test_the_page_asks_for_the_key_and_cannot_chat_without_it(api, page):
    lock = page.wait("(() => { const e = document.getElementById('chat-lock'); return !e.hidden && e.textContent; })()",
                     what="the chat to ask for the key")
    assert "needs its API key" in lock
    assert page.js("document.getElementById('send').disabled") and not page.js("document.getElementById('auth').hidden")
    page.type("prompt", "Hello there", enter=True)  # Enter and a click both do nothing while locked
    page.click("send")
    time.sleep(0.5)
    assert page.js("document.querySelectorAll('#messages .msg').length") == 0 and page.stored() == []
    page.js("document.getElementById('prompt').value = ''")
    page.type("key", "sk-wrong")
    page.click("use-key")
    page.wait("document.getElementById('chat-lock').textContent.includes('refused')", what="the wrong key refused")
    assert page.js("document.getElementById('send').disabled")
    page.type("key", KEY)
    page.click("use-key")
    assert page.wait("document.getElementById('chat-model').textContent", what="the model's name") == "demo"
    assert page.wait("!document.getElementById('send').disabled") and page.js("document.getElementById('chat-lock').hidden")
    # a key that stops working after the page checked it: the request is refused and the chat locks again
    page.js("localStorage.setItem('moe-cluster-key', 'sk-wrong')")
    page.type("prompt", "Hello there", enter=True)
    page.wait(f"{LAST_ANSWER} && {LAST_ANSWER}.dataset.state === 'error'", what="the refused request")
    assert "missing or wrong API key" in page.js(f"{LAST_ANSWER}.textContent")
    page.wait("document.getElementById('send').disabled && !document.getElementById('chat-lock').hidden",
              what="the chat to lock again")
    page.click("clear")
    page.type("key", KEY)
    page.click("use-key")
    page.wait("!document.getElementById('send').disabled", what="the chat to unlock")
    assert page.stored() == []


def ask(page, text: str) -> dict:
    """Type a message, press Enter, wait for the whole answer; the answer's node's data."""
    n = page.js("document.querySelectorAll('#messages .msg.assistant').length")
    page.type("prompt", text, enter=True)
    page.wait(f"document.querySelectorAll('#messages .msg.assistant').length === {n + 1} && "
              f"{LAST_ANSWER}.dataset.state !== 'streaming'", timeout=120, what="the answer")
    return page.js(f"({{...{LAST_ANSWER}.dataset, meta: {LAST_ANSWER}.querySelector('.meta').textContent}})")


def test_the_streamed_answer_is_the_openai_client_s(api, page, oai):
    page.js("document.getElementById('chat-settings').open = true")
    page.set_field("system", SYSTEM)
    page.set_field("temperature", "0")
    page.set_field("top-p", "1")
    page.set_field("max-tokens", "40")
    first = ask(page, "To be, or not to be")
    assert first["state"] == "done", first
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "To be, or not to be"}]
    ref = oai.chat.completions.create(model="demo", messages=messages, temperature=0, max_tokens=40)
    stored = page.stored()
    assert [m["role"] for m in stored] == ["user", "assistant"]
    text = ref.choices[0].message.content
    assert text and stored[1]["content"] == text
    assert int(first["pieces"]) > 1  # streamed, piece by piece
    assert stored[1]["stats"]["tokens"] == ref.usage.completion_tokens
    assert "first token" in first["meta"] and "tok/s" in first["meta"] and f"{ref.usage.completion_tokens} tokens" \
        in first["meta"]
    # what the page shows is the model's text (no Markdown in this model's Shakespeare)
    shown = page.js(f"{LAST_ANSWER}.querySelector('.body').textContent")
    assert re.sub(r"\s", "", shown) == re.sub(r"\s", "", text)

    # the second turn carries the first: the same as the client sending the whole history
    second = ask(page, "Speak again")
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Speak again"}]
    ref2 = oai.chat.completions.create(model="demo", messages=messages, temperature=0, max_tokens=40)
    assert second["state"] == "done" and page.stored()[3]["content"] == ref2.choices[0].message.content
    assert ref2.usage.prompt_tokens > ref.usage.prompt_tokens + ref.usage.completion_tokens  # it saw the history


def test_stop_cancels_the_answer_on_the_cluster(api, page):
    page.set_field("max-tokens", "3000")
    before = cancelled(api)
    n = page.js("document.querySelectorAll('#messages .msg.assistant').length")
    page.type("prompt", "Tell me a long tale of kings", enter=True)
    page.wait(f"document.querySelectorAll('#messages .msg.assistant').length === {n + 1} && "
              f"Number({LAST_ANSWER}.dataset.pieces) >= 5", timeout=120, what="the answer to start")
    # the dashboard beside the chat sees the request running
    page.wait("document.getElementById('running').textContent === '1'", timeout=10, what="the dashboard's count")
    assert running(api) == 1
    page.click("stop")
    page.wait(f"{LAST_ANSWER}.dataset.state === 'stopped'", timeout=10, what="the answer to stop")
    deadline = time.monotonic() + 10
    while running(api) != 0:
        assert time.monotonic() < deadline, "the cluster still runs the stopped request"
        time.sleep(0.1)
    assert cancelled(api) == before + 1
    page.wait("document.getElementById('running').textContent === '0'", timeout=10, what="the dashboard's count")
    stopped = page.stored()[-1]
    assert stopped["stopped"] and stopped["content"] and stopped["stats"]["tokens"] < 3000
    assert not page.js("document.getElementById('send').disabled") and page.js("document.getElementById('stop').disabled")


def test_the_conversation_survives_a_reload_and_exports_as_json(api, page):
    stored = page.stored()
    assert len(stored) >= 6
    page.open(api + "/")
    page.wait("!document.getElementById('send').disabled", what="the chat to unlock")
    assert page.js("document.querySelectorAll('#messages .msg').length") == len(stored)
    assert page.js("document.getElementById('system').value") == SYSTEM  # the settings too
    page.click("export")
    deadline = time.monotonic() + 10
    while not [f for f in page.downloads.glob("*.json")]:
        assert time.monotonic() < deadline, "no export downloaded"
        time.sleep(0.1)
    [f] = page.downloads.glob("*.json")
    doc = json.loads(f.read_text())
    assert doc["messages"] == stored and doc["model"] == "demo" and doc["settings"]["system"] == SYSTEM
    assert page.js("window.__csp") == []  # nothing the page does trips its Content-Security-Policy


def test_model_output_with_html_is_shown_as_text(api, page):
    """A conversation restored from local storage goes through the same drawing as a streamed answer."""
    convo = {"messages": [{"role": "user", "content": "<i>hi</i>"},
                          {"role": "assistant", "content": HOSTILE, "stats": {}}]}
    page.js(f"localStorage.setItem('moe-cluster-chat', {json.dumps(json.dumps(convo))})")
    page.open(api + "/")
    page.wait(f"!!{LAST_ANSWER}", what="the restored answer")
    time.sleep(0.5)
    assert page.js("window.__pwned") is None
    assert page.js("document.querySelectorAll('#messages script, #messages img, #messages i, #messages b').length") == 0
    body = page.js(f"{LAST_ANSWER}.querySelector('.body').textContent")
    assert "<script>window.__pwned = 1</script>" in body and "onerror=" in body
    assert page.js("document.querySelector('#messages .msg.user').textContent") == "<i>hi</i>"
    # the Markdown around it is drawn: bold, inline code and a fenced block, each holding text only
    assert page.js(f"{LAST_ANSWER}.querySelector('strong').textContent") == "bold"
    assert page.js(f"{LAST_ANSWER}.querySelector('p code').textContent") == "<b>code</b>"
    assert page.js(f"{LAST_ANSWER}.querySelector('pre').dataset.lang") == "html"
    assert page.js(f"{LAST_ANSWER}.querySelector('pre code').textContent") == "<script>window.__pwned = 3</script>"
    page.click("clear")
    assert page.js("document.querySelectorAll('#messages .msg').length") == 0 and page.stored() == []
    assert page.js("window.__csp") == []

"""The README's curl call and OpenAI-client snippet, run as written against the quick start's own
cluster.yaml (the 2-node demo cluster), with only the address changed to where it listens."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
from pathlib import Path

import pytest

from cluster.cluster_fixture import cluster

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
SHOWN = "http://studio-1.local:8080"  # the address the README's examples use

pytestmark = pytest.mark.slow


def _use_it_block(lang: str) -> str:
    section = README.split("\n## Use it\n", 1)[1].split("\n## ", 1)[0]
    return re.search(rf"```{lang}\n(.*?)```", section, flags=re.S).group(1)


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("readme")
    with cluster(tmp, (ROOT / "cluster.yaml").read_text()) as (url, proc, lines):
        yield url


def test_the_readme_examples_get_the_same_greedy_answer(url):
    curl = _use_it_block("")
    assert curl.startswith("curl ") and SHOWN in curl
    curl = curl.replace(SHOWN, url).replace("curl ", "curl --silent --show-error ", 1)
    done = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    body = json.loads(done.stdout)
    answer = body["choices"][0]["message"]["content"]
    assert answer.strip() and body["choices"][0]["finish_reason"] in ("stop", "length")
    assert 0 < body["usage"]["completion_tokens"] <= 100

    snippet = _use_it_block("python")
    assert SHOWN in snippet
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(snippet.replace(SHOWN, url), "README.md", "exec"), {})
    # both greedy on the same messages: the streamed answer (up to serving.max_tokens) begins with
    # curl's (100 tokens at most)
    assert out.getvalue().startswith(answer), (out.getvalue()[:200], answer[:200])

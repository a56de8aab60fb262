"""The families the old name rules got wrong or refused, and DBRX's list of expert modules, served
by `up` on 2 node processes and asked through the official OpenAI client: stock mlx-lm's greedy
tokens, and the load-time check passed. (Every family is swept in-process by tests/families;
test_up.py serves mixtral, deepseek_v3, qwen3_next.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from cluster_fixture import cluster, stock_tokens, yaml_for

sys.path.insert(0, str(Path(__file__).parents[1] / "families"))
import tiny  # noqa: E402
from test_commands import REFUSED, WRONG  # noqa: E402

PROMPT = "To be, or not to be"
TOKENS = 12


@pytest.mark.parametrize("family", WRONG + REFUSED + ["dbrx"])
def test_up_serves_stock_tokens(family, tmp_path):
    from openai import OpenAI

    path = tiny.make_checkpoint(family, tmp_path / family, tokenizer=True)
    with cluster(tmp_path, yaml_for(2), "--model", str(path)) as (url, proc, lines):
        client = OpenAI(base_url=f"{url}/v1", api_key="none")
        model = client.models.list().data[0].id  # the cluster names its model by its path
        r = client.completions.create(model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0)
    got = r.model_extra["moe_cluster"]["tokens"]
    assert got == stock_tokens(path, PROMPT, TOKENS)
    checked = [line for line in lines if line.startswith("load check:")]
    if family == "gemma4_text":  # its blocks get their routing from outside: nothing to probe
        assert not checked
    else:
        assert checked and "match the checkpoint" in checked[0], lines

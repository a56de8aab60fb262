"""MoE families served by `up` and asked through the official OpenAI client: stock mlx-lm's
greedy tokens, and the load-time check passed.

Which families: one of each structure the rule tells apart (plain, gated shared expert, shared
experts with group routing, DBRX's per-expert list, SwitchMLP, biased experts, routing from outside
the block, hybrid attention). The families that were silently wrong or refused before the
structural rule (issue 13's lists, tiny.WRONG and tiny.REFUSED) all run in real node processes in
tests/families/test_commands.py, speculating. What `up` adds to a family beyond the
node's own code is family-agnostic (load, check, HTTP); every family's node code (each rank's
share of every MoE block, summed in rank order) is checked against stock by the sweep
(tests/families/test_sweep.py). Serving all 55 here cost 200 s of the suite's 15 minutes; the
fifteen, 30 s more than the suite's time budget holds.

Two node agents run for the whole module on loopback (`launch: remote`, static addresses), and
each family is one `up` of its tiny checkpoint onto them: a coordinator started, a Load, the load
check, one completion, a shutdown.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster_fixture import cluster, stock_tokens

sys.path.insert(0, str(Path(__file__).parents[1] / "families"))
import drawn  # noqa: E402
import tiny  # noqa: E402

PROMPT = "To be, or not to be"
TOKENS = 8
SECRET = "every-family-secret"


@pytest.fixture(scope="module")
def agents(tmp_path_factory):
    """Two node agents on loopback for the module; yields their agent ports."""
    from moe_cluster.common.ports import free_ports

    logs = tmp_path_factory.mktemp("agents")
    ports = free_ports(2)
    env = dict(os.environ, MOE_CLUSTER_SECRET=SECRET, PYTHONUNBUFFERED="1")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "moe_cluster.coordinator.cli",
                "node",
                "--name",
                f"n{i}",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--no-mdns",
            ],
            stdout=open(logs / f"n{i}.log", "w"),
            stderr=subprocess.STDOUT,
            env=env,
        )
        for i, port in enumerate(ports)
    ]
    try:
        deadline = time.monotonic() + 60
        while not all("ready on port" in (logs / f"n{i}.log").read_text() for i in range(2)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [
                (logs / f"n{i}.log").read_text() for i in range(2)
            ]
            time.sleep(0.2)
        yield ports
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)


STRUCTURES = [
    "mixtral",
    "qwen2_moe",
    "deepseek_v3",
    "dbrx",
    "nemotron_h",
    "gpt_oss",
    "gemma4",
    "jamba",
]
FAMILIES = STRUCTURES


def test_the_families_exist_in_mlx_lm():
    assert not set(FAMILIES) - set(tiny.families()), (
        "a family named here is gone from mlx-lm: update the lists"
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_up_serves_stock_tokens(family, agents, tmp_path):
    if tiny.needs_metal(family):
        pytest.skip(
            f"{family} calls mlx-lm's Metal-only kernels (refused off Metal: tests/families/test_commands.py)"
        )
    _serve_stock_tokens(
        tiny.make_checkpoint(family, tmp_path / family, tokenizer=True), agents, tmp_path
    )


# Families the structure probe refused on configs other than tiny.py's (float32 rounding judged
# with an absolute tolerance): six served here on a drawn config each (tests/families/drawn.py);
# all twelve pass the drawn sweep at N = 2 and 3 in tests/families/test_drawn.py.
DRAWN = [
    f
    for f in (
        "qwen2_moe",
        "deepseek",
        "glm4_moe",
        "ernie4_5_moe",
        "llama4",
        "nemotron_h",
    )
    if f in tiny.families()
]


@pytest.mark.parametrize("family", DRAWN)
def test_up_serves_stock_tokens_on_a_drawn_config(family, agents, tmp_path):
    d = drawn.draw(family, 0)
    if tiny.needs_metal(family):
        pytest.skip(f"{family} calls mlx-lm's Metal-only kernels")
    path = tiny.make_checkpoint(
        family, tmp_path / family, tokenizer=True, quantize=d.quantize, cfg=drawn.config(family, d)
    )
    _serve_stock_tokens(path, agents, tmp_path)


def _serve_stock_tokens(path, agents, tmp_path):
    from openai import OpenAI

    from moe_cluster.common.ports import free_ports

    envoys = free_ports(2)
    nodes = "\n".join(
        f"  - name: n{i}\n    address: 127.0.0.1:{port}\n    envoy_port: {envoys[i]}"
        for i, port in enumerate(agents)
    )
    yaml_text = f"name: every-family\nmodel: {path}\nlaunch: remote\nnodes:\n{nodes}\ntimeouts:\n  collective: 5s\n"
    with cluster(tmp_path, yaml_text, env={"MOE_CLUSTER_SECRET": SECRET}) as (url, proc, lines):
        client = OpenAI(base_url=f"{url}/v1", api_key="none")
        model = client.models.list().data[0].id  # the cluster names its model by its path
        r = client.completions.create(model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0)
    assert r.model_extra["moe_cluster"]["tokens"] == stock_tokens(path, PROMPT, TOKENS)
    checked = [line for line in lines if line.startswith("load check:")]
    if any(b.routed_call for b in _blocks(path)):  # gemma4: routing from outside, nothing to probe
        assert not checked
    else:
        assert checked and "match the checkpoint" in checked[0], lines


def _blocks(path):
    from moe_cluster.node.checkpoint import Checkpoint
    from moe_cluster.node.describe import describe

    return describe(Checkpoint.open(path)).blocks

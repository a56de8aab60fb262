"""`up` with `strategy: profile` and replication on 3 local nodes: the hottest experts are copied to
every node (each replica held by all, so the decode step assigns it on the device, routing.ArrayRule),
the API's expert map shows it, and the tokens stay stock mlx-lm's."""

from __future__ import annotations

import json

from cluster_fixture import cluster, http, stock_tokens, yaml_for
from conftest import cli

PROMPT = "To be, or not to be"
TOKENS = 12


def test_profile_placement_copies_hot_experts_to_every_node(tmp_path):
    from moe_cluster.node.checkpoint import Checkpoint
    from moe_cluster.node.describe import describe

    path = Checkpoint.open("demo").path
    (tmp_path / "prompts.txt").write_text(PROMPT + "\nShall I compare thee to a summer's day?\n")
    r = cli(
        "profile",
        "--model",
        "demo",
        "--prompts",
        str(tmp_path / "prompts.txt"),
        "--out",
        str(tmp_path / "profile.json"),
        "--max-tokens",
        "16",
    )
    assert r.returncode == 0, r.stderr
    fp = describe(Checkpoint.open(path)).sizes()
    per_set = sum(fp.per_expert.values())  # one expert of every MoE layer
    memory = (
        fp.replicated + 8 * per_set
    )  # 16 experts over 3 nodes: 5-6 each, and room for 2-3 copies
    config = yaml_for(
        3,
        "demo",
        extra="""placement:
  strategy: profile
  profile: profile.json
  memory_fraction: 1.0
  kv_reserve: 0
  replicate: true
serving:
  prompt_cache: 0
""",
    )
    for i in range(3):
        config = config.replace(
            f"  - name: node-{i}\n", f"  - name: node-{i}\n    memory: {memory}\n"
        )
    with cluster(tmp_path, config) as (url, proc, lines):
        status, body = http(
            url, "/v1/completions", {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}
        )
        experts = http(url, "/v1/cluster/experts")[1]
    assert status == 200, body
    assert body["moe_cluster"]["tokens"] == stock_tokens(path, PROMPT, TOKENS)
    assert any(line.startswith("placement: replicated hot experts:") for line in lines), lines
    copies = [len(h) for layer in experts["layers"] for h in layer["holders"]]
    assert set(copies) == {1, 3}, experts  # held by one node or by all three, never by two
    profile = json.loads((tmp_path / "profile.json").read_text())["layers"]
    for layer in experts["layers"]:
        counts = profile[str(layer["layer"])]["counts"]
        hot = max(range(len(counts)), key=lambda e: (counts[e], -e))
        assert len(layer["holders"][hot]) == 3, (
            layer,
            counts,
        )  # the profile's hottest is everywhere

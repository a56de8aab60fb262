"""`up` on two local nodes: each node times its decode routes at load and keeps the fastest, `up`
prints every node's route with the times it measured, `status` and /metrics report them, and a
route forced by cluster.yaml's `route:` is the one they take; the tokens are stock mlx-lm's either
way. (That a forced host read is not timed at all: tests/families/test_routes.py.)"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from cluster_fixture import cluster, http, stock_tokens, yaml_for

sys.path.insert(0, str(Path(__file__).parents[1] / "families"))
import tiny  # noqa: E402

PROMPT = "To be, or not to be"
TOKENS = 8


def _serve(tmp_path, path, extra: str = "") -> tuple[list[str], dict, str, list[int]]:
    tmp_path.mkdir()
    with cluster(tmp_path, yaml_for(2, str(path), extra=extra)) as (url, proc, lines):
        status, body = http(
            url, "/v1/completions", {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}
        )
        assert status == 200, body
        nodes = {n["name"]: n for n in http(url, "/v1/cluster/status")[1]["nodes"]}
        metrics = http(url, "/metrics")[1]
    return lines, nodes, metrics, body["moe_cluster"]["tokens"]


def test_up_prints_each_nodes_measured_route_and_honours_a_forced_one(tmp_path):
    path = tiny.make_checkpoint(
        "qwen3_moe", tmp_path / "model", tokenizer=True
    )  # float32: device and host
    want = stock_tokens(path, PROMPT, TOKENS)

    lines, nodes, metrics, tokens = _serve(tmp_path / "measured", path)
    assert tokens == want
    (line,) = [line for line in lines if line.startswith("decode route: ")]
    for name in ("node-0", "node-1"):
        m = re.search(rf"{name} (\w+) \(device ([\d.]+) µs, host ([\d.]+) µs\)", line)
        assert m, line
        times = {"device": float(m.group(2)), "host": float(m.group(3))}
        assert m.group(1) == min(times, key=times.get)  # the fastest it measured
        assert nodes[name]["route"] == m.group(1) and nodes[name]["route_us"] == times
        # a device route was timed on batches against the host read too: where the host read won,
        # wide calls go to it, and `up` and status say from how many positions
        host_from = nodes[name]["route_host_from"]
        said = re.search(rf"{name} [^;]*the host read from (\d+) positions", line)
        assert (host_from, said and int(said.group(1))) in ((None, None), (host_from, host_from))
        assert host_from is None or m.group(1) != "host"
        assert f'moe_cluster_node_route{{node="{name}",route="{m.group(1)}"}} 1' in metrics
        assert f'moe_cluster_node_route_seconds{{node="{name}",route="host"}}' in metrics

    # cluster.yaml's route forces one
    lines, nodes, _, tokens = _serve(tmp_path / "yaml", path, extra="route: device\n")
    assert tokens == want
    # forced: not timed at one row; where wide calls go is measured, as for a chosen route
    (line,) = [line for line in lines if line.startswith("decode route: ")]
    hand = r", the host read from \d+ positions"
    assert re.fullmatch(rf"decode route: node-0 device{hand}; node-1 device{hand}", line), line
    assert {n["route"] for n in nodes.values()} == {"device"}

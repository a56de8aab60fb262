"""`bench decode --json` through the CLI: stock mlx-lm, our single node, the cluster path at N = 1
and 2, and mlx-lm's tensor parallelism, measured in one run on the same checkpoint. The figures
are speeds (not asserted); what is asserted is that every path ran and gave stock's tokens."""

from __future__ import annotations

import json

from conftest import cli


def test_bench_decode_reports_every_path_with_stock_tokens():
    # the device route at N = 2, so that the row's decode step is one graph to count
    r = cli(
        "bench",
        "decode",
        "--route",
        "device",
        "--model",
        "demo",
        "--nodes",
        "1,2",
        "--keepalive",
        "none",
        "--max-tokens",
        "16",
        "--rounds",
        "1",
        "--json",
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["same_tokens"] and out["mlx_lm_tps"] > 0
    assert (
        out["generated_tokens"] == 16
    )  # the demo model says no EOS within 16 tokens of this prompt
    assert out["cluster_ratio"] > 0
    assert out["skip_gemv"] is False  # CUDA only: this CPU build keeps gather_mm
    assert [(c["nodes"], c["keepalive"]) for c in out["clusters"]] == [(1, "none"), (2, "none")]
    for c in out["clusters"]:
        assert c["same_tokens"] and c["generated"] == c["stock_generated"] == 16, c
        assert isinstance(c["fixed_cost_per_moe_layer_us"], float)
        # one MoE layer's primitives, ours beside stock's: alone, the shard adds nothing; at N = 2
        # (shm: the all-reduce outside the graph) the slot plan and the zeroed rows
        ops = c["primitives_per_moe_layer"]
        stock, ours = ops["stock"], ops["ours"]
        assert stock["kernels"] > 0 and stock["primitives"] >= stock["kernels"], ops
        assert sum(stock["by_type"].values()) == stock["primitives"], ops
        if c["nodes"] == 1:
            assert ours["kernels"] == stock["kernels"], ops
        else:
            assert stock["kernels"] < ours["kernels"] <= stock["kernels"] + 6, ops
    (peer,) = out["peers"]
    assert peer["name"] == "mlx_lm_tensor_parallel" and peer["nodes"] == 2, peer
    assert peer["tps"] > 0 and peer["same_tokens"] and peer["generated"] == 16, peer
    assert out["cluster_path"]["same_tokens"] and out["cluster_path"]["generated"] == 16, out[
        "cluster_path"
    ]


def test_without_room_for_two_copies_the_cluster_path_runs_after_stock(monkeypatch):
    """Where stock and the sharded model do not both fit the device (a 59 GB checkpoint on an 80 GB
    GPU), the cluster path at N = 1 runs after the stock model is dropped and is compared with stock's
    earlier rounds, still on stock's tokens; --no-peers leaves mlx-lm's tensor parallelism out."""
    from moe_cluster.coordinator.bench import decode_run as decode

    monkeypatch.setattr(decode, "_fits_twice", lambda model: False)
    out = decode.run(
        decode.DecodeBench(
            "demo", nodes=(1, 2), keepalive=("none",), max_tokens=8, rounds=1, peers=False
        )
    )
    alone = out["cluster_path"]
    assert alone["interleaved"] is False and alone["same_tokens"] and alone["generated"] == 8, alone
    assert (
        alone["mlx_lm_tps"] == out["mlx_lm_tps"]
        and out["cluster_ratio"] == alone["tps"] / out["mlx_lm_tps"]
    )
    assert out["peers"] == [] and [c["nodes"] for c in out["clusters"]] == [1, 2]
    assert all(c["same_tokens"] and c["generated"] == 8 for c in out["clusters"])
    assert 0 < out["bench_process_bytes"]


def test_where_stock_mlx_lm_fails_on_the_device_the_cluster_rows_still_run(monkeypatch):
    """mlx-lm's own module can fail where ours runs (its DBRX block feeds one token at a time to a
    quantized matmul, which MLX's CUDA build refuses): the failure is reported in one line and
    the rows are measured and compared with each other. Stock's block is broken on one token at a
    time, as DBRX's is there, in this process only: every decode use of it fails (the count of its
    primitives as well as its generation); the nodes, processes of their own, run theirs."""
    from mlx_lm.models import qwen3_moe

    from moe_cluster.coordinator.bench import decode_run as decode

    block = qwen3_moe.Qwen3MoeSparseMoeBlock
    whole = block.__call__

    def one_token_fails(self, x):
        if x.size // x.shape[-1] == 1:
            raise IndexError("SmallVector out of range.")
        return whole(self, x)

    monkeypatch.setattr(block, "__call__", one_token_fails)
    out = decode.run(
        decode.DecodeBench(
            "demo", nodes=(2,), keepalive=("none",), max_tokens=6, rounds=1, peers=False
        )
    )
    assert out["stock_error"].startswith("IndexError: SmallVector out of range.")
    assert out["ratio"] is None and out["cluster_path"] is None
    (c,) = out["clusters"]
    assert c["generated"] == 6 and c["same_tokens"] is None and c["generation_tps"] > 0, c


def test_bench_decode_alternates_routes_within_one_load():
    """--routes runs each route once per round after a warm-up pass, the route forced on every
    node before each run: every route gives stock's tokens, the expert reads follow the route (the
    device route reads one matrix per routed position, k; the host read only the experts this node
    computes), and each round's ratio is to the first route's run of the same round."""
    r = cli(
        *"bench decode --model demo --nodes 2 --keepalive none --routes host,device "
        "--max-tokens 8 --rounds 2 --no-peers --json".split(),
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    (c,) = out["clusters"]
    assert list(c["routes"]) == ["host", "device"], c["routes"].keys()
    top_k = out["model_bytes"]["top_k"]
    for name, run in c["routes"].items():
        assert run["same_tokens"] and run["generated"] == 8, (name, run)
        assert len(run["rounds_tps"]) == 2 and all(t > 0 for t in run["rounds_tps"])
        assert run["route"].startswith(f"{name}, forced"), run["route"]
        nodes = run["expert_reads"]["nodes"]
        assert [n["routes"] for n in nodes] == [[name], [name]], nodes
    host, device = c["routes"]["host"], c["routes"]["device"]
    assert host["over_first_by_round"] == [1.0, 1.0]
    assert device["over_first_by_round"] == [
        d / h for d, h in zip(device["rounds_tps"], host["rounds_tps"])
    ]
    assert all(n["matrices_per_layer"] == top_k for n in device["expert_reads"]["nodes"])
    # split between two nodes, each computes fewer than k of a token's experts
    assert all(0 < n["matrices_per_layer"] < top_k for n in host["expert_reads"]["nodes"])


def test_bench_decode_refuses_routes_it_cannot_alternate():
    from moe_cluster.node.device import on_cuda

    cases = [
        ("host,warp", "2", "unknown route 'warp'"),
        ("host,host", "2", "names a route twice"),
        ("host,device", "1", "needs a node count above 1"),
    ]
    if not on_cuda():  # the skip kernels are CUDA's: the nodes say so, naming what they can take
        cases.append(("skip,device", "2", "route skip (bench decode --routes): no MoE layer"))
    for routes, nodes, says in cases:
        r = cli(
            "bench", "decode", "--model", "demo", "--nodes", nodes, "--routes", routes, timeout=60
        )
        assert r.returncode != 0 and says in r.stderr, (routes, r.stderr)
        assert "Traceback" not in r.stderr

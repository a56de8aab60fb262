"""`bench decode --json` through the CLI: stock mlx-lm, our single node, the cluster path at N = 1
and 2, and mlx-lm's tensor parallelism, measured in one run on the same checkpoint. The figures
are speeds (not asserted); what is asserted is that every path ran and gave stock's tokens."""

from __future__ import annotations

import json
import os

from conftest import cli


def test_bench_decode_reports_every_path_with_stock_tokens():
    # the device route at N = 2, so that the row's decode step is one graph to count
    env = {**os.environ, "MOE_CLUSTER_ROUTE": "device"}
    r = cli(
        "bench",
        "decode",
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
        env=env,
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
    from moe_cluster.coordinator.bench import decode

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

    from moe_cluster.coordinator.bench import decode

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

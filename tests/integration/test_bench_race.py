"""`bench race --json` through the CLI on a tiny qwen3_moe at N = 2: ours over the ring and over the
envoy, mlx-lm pipeline and tensor parallelism, at batch 1 and at 3 streams. The speeds are not
asserted (this CPU is shared); what is: every row ran (or quotes why not), every row gave stock
mlx-lm's greedy tokens on every stream, the rows agree, and each carries its bytes and bound."""

from __future__ import annotations

import json

import pytest
from conftest import assert_one_line_error, cli

from moe_cluster.node.cores import shares, usable

# with ours over the envoy in two micro-batches per step beside it (node/overlap.py), and with
# attention by stream over the envoy
ROWS = (
    "ours_mlx",
    "ours_envoy",
    "ours_envoy_overlap",
    "ours_envoy_by_stream",
    "mlx_lm_pipeline",
    "mlx_lm_tensor",
)


@pytest.mark.slow  # ~2 minutes on 2 shared cores: 4 rows of 2 processes, stock, 2 bare collectives
def test_bench_race_runs_every_row_and_the_rows_agree(make_ckpt, tmp_path):
    ckpt = make_ckpt("qwen3_moe", layers=3, experts=8, top_k=2)
    plot = tmp_path / "race.png"
    r = cli(
        "bench",
        "race",
        "--model",
        str(ckpt),
        "--nodes",
        "2",
        "--streams",
        "1,3",
        "--max-tokens",
        "6",
        "--prompt-tokens",
        "12",
        "--rows",
        ",".join(ROWS),
        "--bandwidth",
        "20",
        "--route",
        "device",
        "--plot",
        str(plot),
        "--json",
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout)
    assert out["stock"]["ran"], out["stock"]
    # each of ours' rows loads its model once, for both batches (node.sim reuse_load)
    ours = sum(n.startswith("ours") for n in ROWS)
    assert r.stderr.count("task 0: loaded in") == 2 * ours, r.stderr[-3000:]
    assert r.stderr.count("task 1: the previous task's model taken in") == 2 * ours
    assert "task 1: loaded in" not in r.stderr
    got = {(row["name"], row["streams"]): row for row in out["rows"]}
    assert set(got) == {(n, b) for n in ROWS for b in (1, 3)}, sorted(got)
    for (name, b), row in got.items():
        # on this CPU every row runs: a failure is quoted, and fails the test with its reason
        assert "error" not in row, (name, b, row.get("error"), row.get("where"))
        assert len(row["tokens"]) == b and all(len(t) == 6 for t in row["tokens"]), (name, b)
        assert row["same_as_stock"], (name, b, row.get("stock_mismatch"))
        assert (
            row["decode_tps"] > 0 and row["ttft_s"] > 0 and row["itl_p99_s"] >= row["itl_p50_s"] > 0
        )
        assert row["bytes_per_node_per_step"] > 0 and row["bound"]["decode_tps"] > 0, row
        if name.startswith("ours"):  # every node took the route --route forced
            assert row["route"].startswith("device, forced"), (name, row["route"])
            ops = row["primitives_per_moe_layer"]
            assert ops["primitives"] >= ops["kernels"] > 0, ops  # the device route is counted
        # transport mlx's step is one graph: a pass synced at each MoE layer splits its time, with
        # the same tokens; the envoy's own timers see its layers already
        synced = row.get("synced_breakdown_per_step_s")
        if name == "ours_mlx":
            assert row["synced_same_tokens"] and row["synced_step_s"] > 0, row
            assert all(synced[k] > 0 for k in ("attention_router", "experts", "collective_wait"))
            # every rank's wait, rank 0's the breakdown's
            waits = row["synced_wait_per_rank_s"]
            assert len(waits) == 2 and waits[0] == synced["collective_wait"], waits
        else:
            assert synced is None, name
    for b in ("1", "3"):
        assert out["agreement"][b]["same"] and sorted(out["agreement"][b]["rows"]) == sorted(
            ROWS
        ), out["agreement"]
    # bytes per node per step: tensor reads half of what the whole pipeline reads; ours reads the
    # replicated part plus E[n] < k experts, so more than tensor's half and less than all of it
    one = {n: got[(n, 1)]["bytes_per_node_per_step"] for n in ROWS}
    assert one["mlx_lm_pipeline"] == one["mlx_lm_tensor"]  # the pipeline's bytes split by layers
    assert got[("mlx_lm_pipeline", 1)]["bound"]["read_s"] == pytest.approx(
        2 * got[("mlx_lm_tensor", 1)]["bound"]["read_s"]
    )
    assert one["mlx_lm_tensor"] < one["ours_mlx"] < 2 * one["mlx_lm_tensor"]
    assert got[("mlx_lm_tensor", 1)]["collectives_per_step"] == 2 * out["model_bytes"]["layers"]
    assert got[("ours_mlx", 1)]["collectives_per_step"] == out["model_bytes"]["moe_layers"]
    assert out["collective"]["mlx_ring"]["1"] > 0 and out["collective"]["envoy"]["1"] > 0
    for row in out["rows"]:
        if "loses_to" in row:  # where ours is slower, where its time per MoE layer goes
            per = row["per_moe_layer_s"]
            assert set(per) >= {"attention_router", "experts", "collective_bare", "waiting"}
            # the ring's row from its synced pass: every part of the layer seen, not all "other"
            if row["name"] == "ours_mlx":
                assert per["attention_router"] > 0 and per["experts"] > 0, per
                assert "synced step took" in per["note"], per
    # the overlap row: two lanes at 3 streams, its wait on the collective beside the unsplit row's
    split = got[("ours_envoy_overlap", 3)]
    assert (
        split["micro_batches"] == "2 per step" and got[("ours_envoy", 3)]["micro_batches"] == "off"
    )
    ov = split["overlap"]
    assert ov["without_s"] > 0 and ov["hidden"] < 1 and ov["speedup"] > 0, ov
    # the other lane's layer ran while each all-reduce was in flight: a share of it hidden
    assert 0 < ov["in_flight_waited_s"] < ov["in_flight_s"], ov
    # the share itself is held to a schedule's own books in tests/unit/test_interleave.py
    assert 0 < ov["in_flight_hidden"] < 1, ov
    assert got[("ours_envoy", 3)]["overlap_s"] == [0.0, 0.0]  # one lane: nothing in flight
    assert out["prompts"] == [12, 12, 12]  # --prompt-tokens
    # by stream each node attends for its own of the 3 streams, and holds only their KV
    replicated, mine = got[("ours_envoy", 3)], got[("ours_envoy_by_stream", 3)]
    assert replicated["peak_streams_per_node"] == [3, 3], replicated
    assert mine["peak_streams_per_node"] == [2, 1] and mine["peak_running"] == 3, mine
    kv = replicated["peak_kv_bytes_per_node"]
    assert mine["peak_kv_bytes_per_node"] == [kv[0] * 2 // 3, kv[1] // 3], (kv, mine)
    assert plot.stat().st_size > 0
    # every row's process r ran on its own share of the cores (node/cores.py), ours and mlx-lm's
    want = shares(2)
    pinned = [list(c) for c in want] if want else [usable()] * 2
    assert {name: row["cores_per_node"] for (name, _), row in got.items()} == {
        name: pinned for name in ROWS
    }


def test_bench_race_refuses_bad_input_in_one_line():
    assert_one_line_error(
        cli("bench", "race", "--model", "demo", "--rows", "ours_mlx,nope"), "--rows", "nope"
    )
    assert_one_line_error(cli("bench", "race", "--model", "demo", "--nodes", "1"), "--nodes")
    assert_one_line_error(cli("bench", "race", "--model", "demo", "--route", "fast"), "--route")
    assert_one_line_error(cli("bench", "race", "--model", "demo", "--streams", "1,x"), "--streams")
    assert_one_line_error(
        cli("bench", "race", "--model", "demo", "--placement", "/nonexistent/p.json"),
        "/nonexistent/p.json",
    )


@pytest.mark.slow  # ~15 s: one row of 2 processes and stock, with and without the file
def test_bench_race_runs_ours_on_the_placement_given(make_ckpt, tmp_path):
    """--placement: ours' nodes hold the experts the file says, replicas too (every node then
    assigns each selected copy by the same rule), and still give stock's tokens."""
    ckpt = make_ckpt("qwen3_moe", layers=3, experts=8, top_k=2)
    # experts 1-6 of every layer on both nodes, 0 and 7 on one each
    layers = {str(l): {"0": list(range(7)), "1": list(range(1, 8))} for l in range(3)}
    placement = tmp_path / "placement.json"
    placement.write_text(json.dumps({"layers": layers}))

    def race(*extra):
        r = cli(
            "bench",
            "race",
            "--model",
            str(ckpt),
            "--nodes",
            "2",
            "--streams",
            "3",
            "--max-tokens",
            "8",
            "--rows",
            "ours_by_stream",
            *extra,
            "--json",
            timeout=600,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        (row,) = json.loads(r.stdout)["rows"]
        assert "error" not in row and row["same_as_stock"], row
        return row

    even = race("--no-pin")
    row = race("--placement", str(placement))
    assert even["placement"] == {"file": None, "split": "even"}
    assert row["placement"] == {"file": str(placement), "most_held": 7, "replicated": 6}
    assert row["tokens"] == even["tokens"]
    want = shares(2)
    assert even["cores_per_node"] == [usable()] * 2  # --no-pin: wherever the OS puts them
    assert row["cores_per_node"] == ([list(c) for c in want] if want else [usable()] * 2)
    assert all(len(r["synced_wait_per_rank_s"]) == 2 for r in (row, even))
    # the same calls, each selected copy given to the node with fewer: in every call the busier
    # node computes at most the experts it did under the even split, and in some fewer
    assert 0 < row["expected_experts_measured"] < even["expected_experts_measured"], (row, even)


def test_agreement_names_the_row_and_stream_that_differ():
    from moe_cluster.coordinator.bench.race_rows import agreement

    rows = [
        {"name": "ours_mlx", "streams": 2, "tokens": [[1, 2, 3], [4, 5, 6]]},
        {"name": "mlx_lm_pipeline", "streams": 2, "tokens": [[1, 2, 3], [4, 9, 6]]},
        {"name": "mlx_lm_tensor", "streams": 2, "error": "rank 1: boom"},
    ]
    out = agreement(rows, {"tokens": [[1, 2, 3], [4, 5, 6]]})["2"]
    assert not out["same"] and out["missing"] == ["mlx_lm_tensor"]
    assert out["differences"] == [
        {"row": "mlx_lm_pipeline", "stream": 1, "first_mismatch": 1, "against": "ours_mlx"}
    ]
    assert rows[0]["same_as_stock"] and not rows[1]["same_as_stock"]
    # one row left: nothing was compared, which is not agreement
    assert agreement(rows[:1] + rows[2:], {})["2"]["same"] is None
    assert rows[1]["stock_mismatch"] == {"streams": 1, "first": {"stream": 1, "token": 1}}

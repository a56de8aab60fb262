"""`moe-cluster plan --race` and `--check-against` through the CLI."""

from __future__ import annotations

import json

from conftest import assert_one_line_error, cli_in_process as cli


def test_plan_race_prints_every_strategy_per_link_nodes_and_streams():
    r = cli(
        "plan",
        "--model",
        "qwen3-235b-a22b",
        "--bits",
        "4",
        "--hardware",
        "m3-ultra-256",
        "--nodes",
        "2,4",
        "--link",
        "10gbe,tb5-rdma",
        "--streams",
        "1,8",
        "--race",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["prediction"] is True
    keys = {(p["link"], p["nodes"], p["batch"], p["strategy"]) for p in out["points"]}
    assert keys == {
        (link, n, b, s)
        for link in ("10gbe", "tb5-rdma")
        for n in (2, 4)
        for b in (1, 8)
        for s in ("ours", "by-stream", "pipeline", "tensor")
    }
    # beside each winner: who would win were the link's cost 2x or 0.5x
    moved = {(m["link"], m["nodes"], m["batch"], m["link_cost_factor"]) for m in out["sensitivity"]}
    assert moved == {(k[0], k[1], k[2], f) for k in keys for f in (2.0, 0.5)}
    table = cli(
        "plan",
        "--model",
        "qwen3-235b-a22b",
        "--bits",
        "4",
        "--nodes",
        "2",
        "--race",
        "--streams",
        "1",
    )
    assert table.returncode == 0, table.stderr
    assert (
        "race (predicted)" in table.stdout
        and "link tb-ip" in table.stdout
        and "winner" in table.stdout
        and "link x2" in table.stdout
        and "link x0.5" in table.stdout
    )


def test_check_against_reports_the_misses_of_measured_rows(tmp_path):
    race = {
        "bandwidth_Bps": 20e9,
        "rows": [
            {"name": "ours_mlx", "nodes": 2, "streams": 1, "step_s": 0.1, "collective_s": 300e-6},
            {
                "name": "mlx_lm_pipeline",
                "nodes": 2,
                "streams": 1,
                "step_s": 0.01,
                "collective_s": 300e-6,
            },
            {"name": "mlx_lm_tensor", "nodes": 2, "streams": 1, "error": "rank 1: boom"},
        ],
    }
    path = tmp_path / "race.json"
    path.write_text(json.dumps(race))
    r = cli(
        "plan", "--model", "qwen3-235b-a22b", "--bits", "4", "--check-against", str(path), "--json"
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    rows = {x["row"]: x for x in out["rows"]}
    assert set(rows) == {"ours_mlx", "mlx_lm_pipeline"}  # a failed row has nothing to check
    assert abs(rows["ours_mlx"]["miss"]) < 1e-9 and not rows["ours_mlx"]["held_out"]
    assert rows["mlx_lm_pipeline"]["held_out"] and out["max_abs_held_out_miss"] == abs(
        rows["mlx_lm_pipeline"]["miss"]
    )
    text = cli("plan", "--model", "qwen3-235b-a22b", "--bits", "4", "--check-against", str(path))
    assert "largest held-out miss" in text.stdout, text.stderr


def test_race_refuses_bad_input_in_one_line(tmp_path):
    assert_one_line_error(
        cli("plan", "--model", "qwen3-235b-a22b", "--race", "--nodes", "1"), "--nodes"
    )
    assert_one_line_error(
        cli("plan", "--model", "qwen3-235b-a22b", "--race", "--link", "carrier-pigeon"),
        "carrier-pigeon",
    )
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"clusters": []}))
    assert_one_line_error(cli("plan", "--model", "dbrx", "--check-against", str(bad)), "bench race")

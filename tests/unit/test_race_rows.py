"""bench race's rows (coordinator/bench/race_rows.py): the merge of rows from separate calls,
compared again (`bench race --merge`: on a GPU host each row runs in its own call), and the slow
gaps a row reports."""

from __future__ import annotations

import json

import pytest
from moe_cluster.proto.errors import UserError
from moe_cluster.coordinator.bench.race_rows import merge, timing

from conftest import assert_one_line_error, cli_in_process


def _ours(tps: float) -> dict:
    step = 1 / tps
    return {
        "name": "ours_mlx",
        "streams": 1,
        "decode_tps": tps,
        "step_s": step,
        "moe_layers": 10,
        "collective_s": 1e-4,
        "tokens": [[1, 2, 3]],
        "breakdown_per_step_s": {
            "attention_router": 0.0,
            "experts": 0.0,
            "collective_wait": 0.0,
            "other": step,
        },
        "synced_step_s": 0.05,
        "synced_breakdown_per_step_s": {
            "attention_router": 0.01,
            "experts": 0.02,
            "collective_wait": 0.015,
            "other": 0.005,
        },
    }


def _peer(tps: float, tokens: list[int]) -> dict:
    return {
        "name": "mlx_lm_pipeline",
        "streams": 1,
        "decode_tps": tps,
        "step_s": 1 / tps,
        "tokens": [tokens],
    }


def test_a_row_that_loses_to_a_peer_of_another_call_says_where_its_layers_go() -> None:
    ours = {"model": "/m", "nodes": 2, "rows": [_ours(25.0)], "agreement": {}}
    peer = {"model": "/m", "nodes": 2, "rows": [_peer(40.0, [1, 2, 4])], "agreement": {}}
    out = merge([peer, ours])
    r = next(r for r in out["rows"] if r["name"] == "ours_mlx")
    assert r["loses_to"] == ["mlx_lm_pipeline"]
    layer = r["per_moe_layer_s"]
    assert layer["attention_router"] == pytest.approx(0.001)
    assert layer["experts"] == pytest.approx(0.002)
    assert layer["collective_bare"] == pytest.approx(1e-4)
    assert layer["waiting"] == pytest.approx(0.0015 - 1e-4)
    assert out["agreement"]["1"]["same"] is False
    assert out["agreement"]["1"]["differences"][0]["first_mismatch"] == 2
    assert out["model"] == "/m" and len(out["rows"]) == 2


def test_a_row_ahead_of_every_peer_has_no_loss_and_a_stale_one_is_dropped() -> None:
    ours = _ours(50.0)
    ours["loses_to"] = ["something from an earlier merge"]
    out = merge([{"rows": [ours]}, {"rows": [_peer(40.0, [1, 2, 3])]}])
    r = out["rows"][0]
    assert "loses_to" not in r and "per_moe_layer_s" not in r
    assert out["agreement"]["1"]["same"] is True


def test_nothing_to_merge_is_refused() -> None:
    with pytest.raises(UserError, match="nothing to merge"):
        merge([])


def test_merge_through_the_cli_joins_the_calls_and_compares_their_rows(tmp_path) -> None:
    ours = tmp_path / "race-2-ours_mlx.json"
    peer = tmp_path / "race-2-mlx_lm_pipeline.json"
    ours.write_text(json.dumps({"model": "/m", "nodes": 2, "max_tokens": 3, "rows": [_ours(25.0)]}))
    peer.write_text(json.dumps({"model": "/m", "nodes": 2, "rows": [_peer(40.0, [1, 2, 4])]}))
    r = cli_in_process("bench", "race", "--merge", str(ours), str(peer), "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [row["name"] for row in out["rows"]] == ["ours_mlx", "mlx_lm_pipeline"]
    assert out["rows"][0]["loses_to"] == ["mlx_lm_pipeline"]
    assert out["agreement"]["1"]["same"] is False
    (tmp_path / "other.json").write_text("{}")
    assert_one_line_error(
        cli_in_process("bench", "race", "--merge", str(ours), str(tmp_path / "other.json")),
        "other.json",
    )
    assert_one_line_error(cli_in_process("bench", "race", "--rows", "ours_mlx"), "--merge")


def test_a_stall_once_a_pass_is_reported_where_it_fell_and_what_it_cost() -> None:
    # two streams, 50 ms a step, and one 300 ms stall before stream 1's fourth token
    times = [[0.05 * i for i in range(10)], [0.05 * i for i in range(10)]]
    times[1] = times[1][:3] + [t + 0.25 for t in times[1][3:]]
    row = timing(2, -0.1, [[0] * 10, [0] * 10], times)
    slow = row["slow_gaps"]
    assert slow["count"] == 1 and slow["of"] == 18
    assert slow["longest"] == [{"stream": 1, "token": 3, "s": pytest.approx(0.3)}]
    assert slow["added_to_mean_step_s"] == pytest.approx(0.25 / 18)
    assert row["step_s_all_gaps"] == pytest.approx(0.05 + 0.25 / 18)  # the mean the stall moved
    # while both run (to stream 0's last token at 0.45 s): its 9 gaps and stream 1's first 4
    assert row["step_s"] == pytest.approx((12 * 0.05 + 0.3) / 13)
    assert row["decode_window"] == "all running" and row["decode_gaps"] == 13
    assert row["itl_p50_s"] == pytest.approx(0.05)


def test_the_decode_step_counts_only_the_gaps_while_every_stream_runs() -> None:
    # stream 0 decodes at 50 ms a step; stream 1's 1 s prefill runs between two of its steps, then
    # both decode at 80 ms a step: the prefill gap and stream 0's steps alone are not the batch's
    s0 = [0.05 * i for i in range(4)] + [1.15 + 0.08 * i for i in range(10)]
    s1 = [1.15 + 0.08 * i for i in range(10)]
    row = timing(2, 0.0, [[0] * len(s0), [0] * len(s1)], [s0, s1])
    assert row["step_s"] == pytest.approx(0.08)
    assert row["decode_tps"] == pytest.approx(2 / 0.08)
    assert (row["decode_window"], row["decode_gaps"]) == ("all running", 18)
    assert row["step_s_all_gaps"] > 0.11  # the prefill counted as a step
    # never all running at once: every gap counts, and the row says so
    apart = timing(2, 0.0, [[0, 0], [0, 0]], [[0.0, 0.1], [0.5, 0.6]])
    assert apart["decode_window"] == "all gaps" and apart["step_s"] == pytest.approx(0.1)


def test_steady_steps_report_no_slow_gap() -> None:
    times = [[0.04 * i + 0.001 * (i % 3) for i in range(12)]]
    assert timing(1, 0.0, [[0] * 12], times)["slow_gaps"]["count"] == 0
    assert timing(1, 0.0, [[0]], [[0.1]])["slow_gaps"] is None

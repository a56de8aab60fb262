"""`bench decode --speculative` through the CLI: with and without speculation on two node
processes, alternated, on the demo model. Speeds are not asserted; what is: every scenario gave
the tokens of decoding without drafts (stock mlx-lm's for the plain prompt), a right prediction is
accepted whole and pays one step per 1 + draft_tokens tokens, a spoiled one less, and bad options
get one line."""

from __future__ import annotations

import json

from conftest import assert_one_line_error, cli


def test_bench_speculative_sweeps_acceptance_with_the_tokens_of_decoding_without_drafts():
    r = cli(
        "bench",
        "decode",
        "--model",
        "demo",
        "--nodes",
        "2",
        "--speculative",
        "prompt-lookup",
        "--draft-tokens",
        "3",
        "--spoil",
        "0,1",
        "--max-tokens",
        "16",
        "--rounds",
        "1",
        "--json",
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    (run,) = out["runs"]
    assert run["nodes"] == 2 and run["tokens_equal_stock"], run
    rows = {t["scenario"]: t for t in run["rows"]}
    assert list(rows) == [
        "off",
        "prompt lookup",
        "prompt lookup, the continuation in the prompt",
        "off, the continuation in the prompt",
        "prediction, 0% spoiled",
        "prediction, 100% spoiled",
    ]
    for t in rows.values():
        assert t["tokens_equal_off"] and t["same_tokens_every_round"] and len(t["tokens"]) == 16, t
        assert t["tps"] > 0 and t["ratio_vs_off"] > 0 and t["ratio_rounds_median"] > 0, t
    off, right, wrong = (
        rows["off"],
        rows["prediction, 0% spoiled"],
        rows["prediction, 100% spoiled"],
    )
    assert off["drafted"] == 0 and off["speculative"] == "off" and off["decode_steps"] == 17
    assert right["acceptance"] == 1.0 and right["decode_steps"] <= 6, right  # 16 tokens, 4 a step
    assert right["allreduces_per_token"] <= 0.5 * out["moe_layers"], right
    assert wrong["acceptance"] < 0.5, wrong
    # the demo copies what it read (trained with repeats): prompt lookup on a prompt that holds its
    # continuation pays at most half the MoE layers' all-reduces per token
    copy = rows["prompt lookup, the continuation in the prompt"]
    assert copy["acceptance"] >= 0.8 and copy["allreduces_per_token"] <= 0.5 * out["moe_layers"], (
        copy
    )


def test_bench_auto_alternates_with_off_alone_and_as_8_streams():
    """`--speculative auto --streams 8`: the rows of auto beside off's, and the plain prompt as 8
    streams at once each way, every stream with the tokens of decoding without drafts. At 8 streams
    and 4 drafts a step, auto's batch guesses nothing (node/batch.py `_width`): one step, 8 tokens,
    as off."""
    args = "--speculative auto --spoil 0 --streams 8 --max-tokens 16 --rounds 1 --json"
    r = cli("bench", "decode", "--model", "demo", "--nodes", "2", *args.split(), timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    (run,) = out["runs"]
    rows = {t["scenario"]: t for t in run["rows"]}
    assert list(rows) == [
        "off",
        "auto",
        "auto, the continuation in the prompt",
        "off, the continuation in the prompt",
        "off, 8 streams",
        "auto, 8 streams",
        "prediction, 0% spoiled",
    ]
    for t in rows.values():
        assert t["tokens_equal_off"] and t["same_tokens_every_round"], t
    many, off_many = rows["auto, 8 streams"], rows["off, 8 streams"]
    assert many["streams"] == 8 and len(many["tokens"]) == 8 * 16, many
    # once the 8 decode together nothing is guessed (the first to finish its prompt may guess
    # while the others still read theirs): off's steps
    assert many["speculative"] == "auto, 4 drafts, MTP experts whole", many
    assert many["decode_steps"] == off_many["decode_steps"] == 16, many
    right = rows["prediction, 0% spoiled"]
    assert right["acceptance"] == 1.0 and right["allreduces_per_token"] <= 0.5 * out["moe_layers"]


def test_bench_speculative_refuses_bad_options():
    assert_one_line_error(
        cli("bench", "decode", "--model", "demo", "--spoil", "0.5"),
        "--spoil, --draft-model, --mtp-experts and --streams need --speculative",
    )
    assert_one_line_error(
        cli("bench", "decode", "--model", "demo", "--streams", "8"),
        "--spoil, --draft-model, --mtp-experts and --streams need --speculative",
    )
    assert_one_line_error(
        cli(
            "bench", "decode", "--model", "demo", "--speculative", "auto", "--mtp-experts", "whole"
        ),
        "--mtp-experts whole needs --speculative mtp",
    )
    r = cli(
        "bench", "decode", "--model", "demo", "--speculative", "mtp", "--mtp-experts", "whole,half"
    )
    assert r.returncode == 2 and "auto, whole, sharded or a list of them" in r.stderr, r.stderr
    assert_one_line_error(
        cli("bench", "decode", "--model", "demo", "--speculative", "draft"),
        "--speculative draft and --draft-model go together",
    )
    assert_one_line_error(
        cli("bench", "decode", "--model", "demo", "--speculative", "prompt-lookup", "--spoil", "2"),
        "--spoil must list shares from 0 to 1",
    )
    r = cli(
        "bench",
        "decode",
        "--model",
        "demo",
        "--speculative",
        "prompt-lookup",
        "--draft-tokens",
        "17",
    )
    assert r.returncode == 2 and "must be 1 to 16" in r.stderr, r.stderr

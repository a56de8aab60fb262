"""`moe-cluster run`: single-node generation, equal to mlx_lm.generate, and its error paths."""

from __future__ import annotations

import json

import pytest

from conftest import ARCHS, assert_one_line_error, cli

PROMPT = "Shall I compare thee to a summer's day?"


def _stock_tokens(path, prompt, max_tokens):
    from mlx_lm import load, stream_generate

    model, tok = load(str(path))
    return [r.token for r in stream_generate(model, tok, prompt, max_tokens=max_tokens)]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_equal_mlx_lm_generate(arch, make_ckpt, capsys):
    """Through the command's own entry point in this process: a subprocess per family added only an
    interpreter and MLX import (~1.5 s each); the tests below run `moe-cluster run` as a process."""
    from moe_cluster.coordinator.cli import main

    path = make_ckpt(arch)
    code = main(["run", "--model", str(path), "--prompt", PROMPT, "--max-tokens", "24", "--json"])
    r = capsys.readouterr()
    assert code == 0, r.err
    out = json.loads(r.out)  # stdout is the JSON alone
    assert set(out) >= {"text", "tokens", "prompt_tps", "generation_tps", "peak_memory_bytes"}
    assert out["tokens"] == _stock_tokens(path, PROMPT, 24)
    assert out["peak_memory_bytes"] > 0 and out["generation_tps"] > 0


def test_sampling_is_repeatable_with_a_seed_and_differs_from_greedy_and_another_seed(make_ckpt):
    path = make_ckpt("mixtral")
    args = ["run", "--model", str(path), "--prompt", PROMPT, "--max-tokens", "16", "--json"]
    sampled = ["--temperature", "0.8", "--top-p", "0.9", "--seed"]
    a, b, other, greedy = (
        json.loads(cli(*args, *extra).stdout)["tokens"]
        for extra in ([*sampled, "11"], [*sampled, "11"], [*sampled, "12"], [])
    )
    assert a == b and len(a) == 16
    assert a != greedy and a != other, (a, greedy, other)


def test_plain_output_has_text_then_figures(make_ckpt):
    """stdout is the generated text alone (stock mlx-lm's greedy tokens, decoded); the figures go to stderr."""
    from moe_cluster.node.checkpoint import load_tokenizer

    path = make_ckpt("qwen3_moe")
    r = cli("run", "--model", str(path), "--prompt", PROMPT, "--max-tokens", "8")
    assert r.returncode == 0, r.stderr
    assert r.stdout == load_tokenizer(path).decode(_stock_tokens(path, PROMPT, 8)) + "\n", r.stdout
    assert (
        "Generation: 8 tokens" in r.stderr and "tokens/s" in r.stderr and "Peak memory" in r.stderr
    )


def test_errors(tmp_path, make_ckpt):
    assert_one_line_error(
        cli("run", "--model", str(tmp_path / "nope"), "--prompt", "hi"), "does not exist"
    )
    (tmp_path / "empty").mkdir()
    assert_one_line_error(
        cli("run", "--model", str(tmp_path / "empty"), "--prompt", "hi"), "not a model checkpoint"
    )
    src = make_ckpt("mixtral")

    def copy(name, config_text):
        d = tmp_path / name
        d.mkdir()
        for f in src.iterdir():
            (d / f.name).write_bytes(f.read_bytes())
        (d / "config.json").write_text(config_text)
        return d

    config = json.loads((src / "config.json").read_text())
    unknown = copy("unknown", json.dumps({**config, "model_type": "frobnicator"}))
    assert_one_line_error(
        cli("run", "--model", str(unknown), "--prompt", "hi"), "unknown architecture", "frobnicator"
    )
    bad_json = copy("badjson", "{ this is not json")
    assert_one_line_error(
        cli("run", "--model", str(bad_json), "--prompt", "hi"), "config.json is malformed"
    )
    missing = {k: v for k, v in config.items() if k != "hidden_size"}
    partial = copy("partial", json.dumps({**missing, "model_type": "qwen3_moe"}))
    assert_one_line_error(
        cli("run", "--model", str(partial), "--prompt", "hi"), "config.json is malformed"
    )
    assert_one_line_error(
        cli("run", "--model", str(src), "--prompt", "hi", "--top-p", "1.5"), "top_p"
    )


def test_the_demo_model_writes_words():
    r = cli(
        "run", "--model", "demo", "--prompt", "To be, or not to be", "--max-tokens", "60", "--json"
    )
    assert r.returncode == 0, r.stderr
    text = json.loads(r.stdout)["text"]
    words = [w.strip(".,;:!?[]'\"").lower() for w in text.split()]
    common = {
        "the",
        "and",
        "i",
        "to",
        "of",
        "a",
        "my",
        "you",
        "is",
        "not",
        "that",
        "in",
        "me",
        "it",
        "be",
        "will",
        "with",
        "his",
        "your",
        "this",
        "he",
        "but",
        "have",
        "for",
        "so",
        "shall",
        "thou",
        "lord",
    }
    assert sum(w in common for w in words) >= 5, text

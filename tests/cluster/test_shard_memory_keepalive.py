"""Measured memory of each node process, keepalive counters from real processes, and the errors
`simulate` gives for placements and checkpoints it cannot run."""

from __future__ import annotations

import json

import pytest

from conftest import assert_one_line_error, cli
from moe_cluster.coordinator.dev.simulate import run_nodes
from moe_cluster.node.checkpoint import Checkpoint, write_checkpoint
from moe_cluster.node.demo import tokenizer
from moe_cluster.proto.records import Sampling
from moe_cluster.node.sim import SimTask

PROMPT = (345, 12, 88, 501, 7, 260, 19, 944, 3, 71)


@pytest.mark.slow  # 28 s to 31 s each
@pytest.mark.parametrize("layout", ["mlx", "hf"])
def test_each_node_holds_only_its_share(layout, make_ckpt):
    path = make_ckpt("mixtral", layout, hidden=256, experts=16, top_k=2)
    nodes = 4
    ckpt = Checkpoint(path)
    # The largest stacked expert tensor: one projection of one layer, all 16 experts, bytes.
    full = 16 * 512 * 256 * 4
    reports = run_nodes([SimTask(str(path), PROMPT, Sampling(max_tokens=4))], nodes)[0]
    expert_total = sum(r["expert_bytes"] for r in reports)
    for r in reports:
        assert expert_total >= 4 * r["expert_bytes"]  # experts are >= 4x one node's share
        own = r["replicated_bytes"] + r["expert_bytes"]
        assert r["active_memory_bytes"] <= 1.05 * own, r  # measured by MLX's allocator
        assert r["resident_weight_bytes"] <= 1.05 * own, r
        assert r["peak_memory_bytes"] < full + own, r  # peak during the load, measured
    assert ckpt.total_bytes() > 3 * max(r["active_memory_bytes"] for r in reports)


def test_keepalive_counters_in_real_processes(make_ckpt):
    path = make_ckpt("olmoe", experts=8, top_k=2)
    nodes = 3
    tasks = [
        SimTask(str(path), PROMPT, Sampling(max_tokens=24), keepalive=k)
        for k in ("none", "lru", "busy")
    ]
    none, lru, busy = run_nodes(tasks, nodes)
    for policy, reports in (("none", none), ("lru", lru), ("busy", busy)):
        assert all(r["tokens"] == none[0]["tokens"] for r in reports), (
            policy
        )  # keepalive never changes tokens
        for r in reports:
            local = r["experts_per_layer"]
            for layer, c in r["layer_counters"].items():
                assert c["calls"] >= 23
                if policy == "none":
                    assert c["computed"] == c["selected"] and c["filler"] == 0
                elif policy == "lru":
                    # every call computes the cluster-wide maximum (top-2 never exceeds a node's share)
                    assert c["computed"] == c["cluster_max"], (layer, c)
                else:
                    assert c["computed"] == local[layer] * c["calls"], (layer, c)


def _dense_checkpoint(path):
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "vocab_size": tokenizer.vocab_size(),
        "tie_word_embeddings": True,
    }
    model = llama.Model(llama.ModelArgs.from_dict(config))
    write_checkpoint(path, dict(tree_flatten(model.parameters())), config)
    tokenizer.copy_tokenizer(path)


@pytest.mark.slow  # 15 s
def test_errors(make_ckpt, tmp_path):
    path = make_ckpt("mixtral")
    base = ["simulate", "--model", str(path), "--nodes", "2", "--prompt", "hi", "--max-tokens", "2"]
    orphan = tmp_path / "orphan.json"
    orphan.write_text(
        json.dumps(
            {"layers": {"0": {"0": [0, 1, 2], "1": [3, 4, 5, 6]}, "1": {"0": list(range(8))}}}
        )
    )
    assert_one_line_error(cli(*base, "--placement", str(orphan)), "layer 0", "[7]", "on no node")
    out_of_range = tmp_path / "range.json"
    out_of_range.write_text(
        json.dumps({"layers": {"0": {"0": list(range(8)), "1": [8]}, "1": {"0": list(range(8))}}})
    )
    assert_one_line_error(
        cli(*base, "--placement", str(out_of_range)), "expert id 8", "out of range"
    )

    dense = tmp_path / "dense"
    _dense_checkpoint(dense)
    assert_one_line_error(
        cli("simulate", "--model", str(dense), "--nodes", "2", "--prompt", "hi"), "no MoE layers"
    )

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in path.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    victim = sorted(broken.glob("model-*.safetensors"))[0]
    data = bytearray(victim.read_bytes())
    victim.write_bytes(bytes(data[:-10]))  # the last tensor's byte range now runs past the end
    assert_one_line_error(
        cli(*base[:2], str(broken), *base[3:]), victim.name, "past the end of the file"
    )

"""`moe-cluster plan` end to end: the real command (its parser and handler, in this process; with
an environment of its own, in a subprocess), and the model description on checkpoints written by
`demo-model` for every supported family."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli_in_process

TABLE_6 = {  # nodes -> (load, compute or None for "<0.001", latency, transfer, time, tok/s)
    2: (0.061, 0.001, 0.040, 0.002, 0.103, 9.7),
    3: (0.055, 0.001, 0.040, 0.002, 0.096, 10.4),
    4: (0.040, 0.001, 0.040, 0.002, 0.081, 12.3),
    6: (0.031, None, 0.040, 0.002, 0.072, 13.9),
    8: (0.029, None, 0.040, 0.002, 0.070, 14.2),
}
PAPER = [
    "--model",
    "dbrx",
    "--hardware",
    "m2-ultra-192",
    "--nodes",
    "2,3,4,6,8",
    "--expected-experts",
    "2.65,2.32,1.57,1.11,1.01",
]
ROW_KEYS = {
    "nodes",
    "expected_experts",
    "load_s",
    "compute_s",
    "latency_s",
    "transfer_s",
    "time_s",
    "tokens_per_s",
    "memory_per_node_bytes",
    "fits",
    "tokens_per_s_per_usd",
}
ARCHS = [
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "deepseek_v3",
    "dbrx",
    "gpt_oss",
    "qwen3_next",
]


def plan(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    if env is None:
        return cli_in_process("plan", *args)
    return subprocess.run(
        [sys.executable, "-m", "moe_cluster.coordinator.cli", "plan", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def plan_json(*args: str) -> dict:
    r = plan(*args, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_table_6_reproduced():
    rows = plan_json(*PAPER, "--network", "paper-10gbe")["rows"]
    assert [r["nodes"] for r in rows] == [2, 3, 4, 6, 8]
    for r in rows:
        assert ROW_KEYS <= set(r)
        load, compute, latency, transfer, time, tps = TABLE_6[r["nodes"]]
        assert r["load_s"] == pytest.approx(load, abs=0.001)
        assert (
            r["compute_s"] < 0.001
            if compute is None
            else r["compute_s"] == pytest.approx(compute, abs=0.001)
        )
        assert r["latency_s"] == pytest.approx(latency, abs=0.001)
        assert r["transfer_s"] == pytest.approx(transfer, abs=0.001)
        assert r["time_s"] == pytest.approx(time, abs=0.001)
        assert r["tokens_per_s"] == pytest.approx(tps, abs=0.1)
        assert r["fits"] is True


def test_rocev2_two_nodes_about_16():
    rows = plan_json(*PAPER, "--network", "rocev2")["rows"]
    assert 16.0 <= rows[0]["tokens_per_s"] <= 16.4
    assert rows[0]["tokens_per_s_per_usd"] == pytest.approx(
        rows[0]["tokens_per_s"] / (2 * (6599 + 339))
    )


def test_table_text_output():
    r = plan(*PAPER, "--network", "paper-10gbe,rocev2")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    two = [l.split() for l in lines if l.strip().startswith("2 ")]
    assert two[0][:8] == ["2", "2.650", "0.061", "0.001", "0.040", "0.002", "0.103", "9.7"]
    assert two[1][7] == "16.1"
    assert "network   rocev2" in r.stdout and "computed: 2.646" in r.stdout


def test_expected_experts_computed():
    out = plan_json("--model", "dbrx", "--nodes", "1,2,3,4")
    e = {r["nodes"]: r["expected_experts"] for r in out["rows"]}
    assert e[1] == 4
    assert e[2] == pytest.approx(2.646, abs=5e-4)
    assert e[3] == pytest.approx(2.258, abs=5e-4)
    assert e[4] == pytest.approx(1.969, abs=5e-4)
    busy = plan_json("--model", "dbrx", "--nodes", "2,3", "--keepalive", "busy")["rows"]
    assert [r["expected_experts"] for r in busy] == [8, 6]
    auto = plan_json("--model", "dbrx", "--nodes", "4", "--replication", "auto")["rows"][0]
    assert auto["replicas_per_node"] > 0 and auto["expected_experts"] < 1.969 and auto["fits"]


def test_profile_drives_e(tmp_path):
    # Every token picks experts 0-3: all on rank 0 of an even split.
    layers = {
        str(l): {"counts": [10] * 4 + [0] * 12, "tokens": 10, "sets": [[0, 1, 2, 3]] * 10}
        for l in range(40)
    }
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps({"model": "dbrx", "num_experts": 16, "top_k": 4, "layers": layers}))
    rows = plan_json("--model", "dbrx", "--nodes", "2", "--profile", str(prof))["rows"]
    assert rows[0]["expected_experts"] == 4
    assert "profile" in rows[0]["expected_experts_method"]


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--model", "dbrx-xl"], "dbrx-xl"),
        (["--model", "dbrx", "--hardware", "m9-ultra"], "m9-ultra"),
        (["--model", "dbrx", "--network", "carrier-pigeon"], "carrier-pigeon"),
        (["--model", "dbrx", "--nodes", "2,0"], "node count 0"),
        (["--model", "dbrx", "--nodes", "two"], "'two'"),
        (
            ["--model", "dbrx", "--nodes", "2,3", "--expected-experts", "1,2,3"],
            "3 values for 2 node counts",
        ),
        (["--model", "dbrx", "--context", "-1"], "'-1'"),
        (["--model", "dbrx", "--nodes", "32"], "32"),
        (["--model", "dbrx", "--calibration", "/nonexistent/cal.json"], "/nonexistent/cal.json"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, needle):
    r = plan(*args)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert needle in r.stderr


def bench() -> dict:
    """Synthetic `bench decode --json` output of DBRX (Table 1 bytes) on 1-4 nodes: BW_eff 600 GB/s,
    150 us per layer fixed, collective 700 us per MoE layer at 2 nodes + 120 us per extra node."""
    R, X, E = 7_000_000_000, 15_854_469_120, {1: 4.0, 2: 2.65, 3: 2.32, 4: 1.57}
    clusters = []
    for n, e in E.items():
        compute = (R + X * e) / 600e9 + 40 * 150e-6
        comm = 40 * (700e-6 + 120e-6 * (n - 2)) if n > 1 else 0.0
        clusters.append(
            {
                "nodes": n,
                "keepalive": "lru",
                "transport": "envoy",
                "generation_tps": 1 / (compute + comm),
                "time_per_token_s": compute + comm,
                "expected_experts": e,
                "breakdown_s": {
                    "attention_router": 0.3 * compute,
                    "experts": 0.6 * compute,
                    "collective_wait": comm,
                    "other": 0.1 * compute,
                },
            }
        )
    return {
        "model": "dbrx-instruct",
        "prompt_tokens": 128,
        "generated_tokens": 128,
        "ours_tps": 6.1,
        "mlx_lm_tps": 7.0,
        "ratio": 0.87,
        "clusters": clusters,
        "model_bytes": {
            "replicated_read_per_token": R,
            "expert": X,
            "layers": 40,
            "moe_layers": 40,
            "hidden": 6144,
            "dtype_bytes": 2,
        },
    }


def test_calibrate_then_plan_with_it(tmp_path):
    b = tmp_path / "bench.json"
    b.write_text(json.dumps(bench()))
    cal = tmp_path / "calib.json"
    r = plan("--calibrate", str(b), "--network", "10gbe", "--out", str(cal))
    assert r.returncode == 0, r.stderr
    assert "wrote" in r.stdout and json.loads(cal.read_text())["network"] == "10gbe"
    out = plan_json(
        "--model",
        "dbrx",
        "--calibration",
        str(cal),
        "--network",
        "10gbe,rocev2",
        "--nodes",
        "2,3,4",
        "--expected-experts",
        "2.65,2.32,1.57",
    )
    assert out["calibration"]["bandwidth_Bps"] == pytest.approx(600e9)
    ten = {r["nodes"]: r for r in out["rows"] if r["network"] == "10gbe"}
    roce = {r["nodes"]: r for r in out["rows"] if r["network"] == "rocev2"}
    measured = {c["nodes"]: c["time_per_token_s"] for c in bench()["clusters"]}
    for n in (2, 3, 4):
        assert ten[n]["time_s"] == pytest.approx(measured[n], rel=2e-3)
        assert ten[n]["overhead_s"] == pytest.approx(40 * 150e-6)
        # The measured collective belongs to 10gbe; rocev2 keeps its own preset.
        assert roce[n]["latency_s"] == pytest.approx(40 * 750e-9)
    bad = plan("--calibrate", str(b), "--calibration", str(cal))
    assert bad.returncode == 2 and "not both" in bad.stderr


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "fig8.png"
    r = plan(*PAPER, "--network", "paper-10gbe,rocev2,infiniband", "--plot", str(png))
    assert r.returncode == 0, r.stderr
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


def test_plot_without_matplotlib(tmp_path):
    fake = tmp_path / "fake" / "matplotlib"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    import os

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(fake.parent), os.environ.get("PYTHONPATH", "")]),
    }
    r = plan(*PAPER, "--plot", str(tmp_path / "x.png"), env=env)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "moe-cluster plan: error: --plot needs matplotlib: pip install 'moe-cluster[plot]'"
    ]


# --- checkpoints ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demos(tmp_path_factory) -> dict[str, Path]:
    from moe_cluster.node.demo.make import DemoSpec, make_checkpoint

    root = tmp_path_factory.mktemp("demos")
    out = {}
    for arch in ARCHS:
        out[arch] = root / arch
        make_checkpoint(DemoSpec(arch=arch, layers=4, experts=8, top_k=2, hidden=64), out[arch])
    out["qwen3_next_q4"] = root / "qwen3_next_q4"
    make_checkpoint(
        DemoSpec(arch="qwen3_next", layers=4, quantize=4, mixed_bits=True), out["qwen3_next_q4"]
    )
    out["dbrx_q8"] = root / "dbrx_q8"
    make_checkpoint(DemoSpec(arch="dbrx", layers=2, experts=4, top_k=2, quantize=8), out["dbrx_q8"])
    return out


@pytest.mark.parametrize("arch", ARCHS + ["qwen3_next_q4", "dbrx_q8"])
def test_describe_matches_checkpoint(demos, arch):
    from moe_cluster.coordinator.plan.describe import describe_path
    from moe_cluster.node.checkpoint import Checkpoint

    model, on_disk = describe_path(str(demos[arch]))
    assert on_disk == Checkpoint.open(demos[arch]).total_bytes()
    assert model.total_bytes == on_disk  # every byte is either replicated or one expert's
    experts = 4 if arch == "dbrx_q8" else 8
    assert (model.num_experts, model.top_k) == (experts, 2)
    assert model.moe_layer_ids == (
        (1, 2, 3) if arch == "deepseek_v3" else tuple(range(model.layers))
    )
    assert 0 < model.replicated_read_bytes < model.replicated_bytes
    assert model.caches and model.kv_cache_bytes(1000) > model.kv_cache_bytes(0)
    if arch in ("qwen2_moe", "qwen3_next", "qwen3_next_q4", "deepseek_v3"):
        assert model.shared_bytes > 0
    else:
        assert model.shared_bytes == 0


def test_describe_details(demos, tmp_path):
    from moe_cluster.coordinator.plan.describe import describe_path

    mixtral, _ = describe_path(str(demos["mixtral"]))
    # float32 SwiGLU expert: 3 x 64 x 128 weights; untied embedding read one row (64 floats).
    assert mixtral.expert_layer_bytes == (3 * 64 * 128 * 4,) * 4
    assert mixtral.act_bytes == 4 and mixtral.hidden == 64
    assert mixtral.expert_layer_flops == (2.0 * 3 * 64 * 128,) * 4
    q4, _ = describe_path(str(demos["qwen3_next_q4"]))
    assert (
        q4.expert_layer_bytes[0] > q4.expert_layer_bytes[1]
    )  # first MoE layer's experts are 8-bit
    assert q4.weights.startswith("4-bit")
    gpt, _ = describe_path(str(demos["gpt_oss"]))
    capped = [c for c in gpt.caches if c.max_tokens]
    assert capped and all(c.max_tokens == 128 for c in capped)  # sliding-window layers
    nxt, _ = describe_path(str(demos["qwen3_next"]))
    assert any(
        c.per_token_bytes == 0 and c.fixed_bytes > 0 for c in nxt.caches
    )  # Gated DeltaNet state
    bare = tmp_path / "bare.json"
    bare.write_text((demos["mixtral"] / "config.json").read_text())
    cfg_only, none = describe_path(str(bare))
    assert none is None  # a bare config.json: no checkpoint to compare with
    assert (
        cfg_only.total_bytes < mixtral.total_bytes
    )  # no weights: bfloat16 assumed, not the demo's float32


def test_plan_a_checkpoint_and_reject_a_dense_one(demos, tmp_path):
    out = plan_json(
        "--model",
        str(demos["dbrx_q8"]),
        "--hardware",
        "m4-pro-64",
        "--network",
        "tb5",
        "--nodes",
        "1,2,4",
        "--context",
        "1024",
    )
    assert out["model"]["total_bytes"] == out["model"]["checkpoint_bytes"]
    assert [r["expected_experts"] for r in out["rows"]][:2] == [
        2,
        pytest.approx(4 / 3),
    ]  # C(4,2): E[max] = 4/3
    assert all(r["kv_cache_bytes"] > 0 for r in out["rows"])
    dense = tmp_path / "llama"
    dense.mkdir()
    (dense / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "vocab_size": 100,
                "rms_norm_eps": 1e-5,
            }
        )
    )
    r = plan("--model", str(dense))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "no routed experts" in r.stderr and "llama" in r.stderr


def test_a_batch_reads_the_experts_once_for_all_its_sequences():
    one = {
        r["nodes"]: r
        for r in plan_json("--model", "dbrx", "--nodes", "1,4", "--network", "rocev2")["rows"]
    }
    eight = {
        r["nodes"]: r
        for r in plan_json(
            "--model", "dbrx", "--nodes", "1,4", "--network", "rocev2", "--batch", "8"
        )["rows"]
    }
    for n in (1, 4):
        assert eight[n]["batch"] == 8
        assert (
            eight[n]["expected_experts"] > one[n]["expected_experts"]
        )  # the union of 8 tokens' experts
        assert one[n]["tokens_per_s"] < eight[n]["tokens_per_s"] < 8 * one[n]["tokens_per_s"]
        assert eight[n]["tokens_per_s_per_sequence"] == pytest.approx(eight[n]["tokens_per_s"] / 8)
    assert eight[4]["transfer_s"] == pytest.approx(
        8 * one[4]["transfer_s"]
    )  # B x hidden per all-reduce
    for bad, why in (("0", "--batch"), ("2.5", "whole number")):
        r = plan("--model", "dbrx", "--batch", bad)
        assert r.returncode == 2 and why in r.stderr and len(r.stderr.strip().splitlines()) == 1, (
            r.stderr
        )


def test_a_node_short_of_memory_is_warned_with_its_expert_cache_speed():
    """Where a node cannot hold its share, `plan` says what `expert_cache: auto` keeps resident and
    the tok/s the expert cache model (plan/expert_cache.py) expects of it."""
    args = ["--model", "dbrx", "--hardware", "m4-pro-64", "--nodes", "2,4,8", "--skew", "0,1"]
    out = plan_json(*args)
    rows = {r["nodes"]: r for r in out["rows"]}
    assert not rows[2]["fits"] and not rows[4]["fits"] and rows[8]["fits"]
    misfits = out["misfits"]
    assert sorted({(m["nodes"], m["skew"]) for m in misfits}) == [(2, 0), (2, 1), (4, 0), (4, 1)]
    layers = out["model"]["moe_layers"]
    per_expert = out["model"]["expert_bytes"] / layers  # one expert of one layer
    for m in misfits:
        r = rows[m["nodes"]]
        # auto keeps what usable memory holds after everything but the experts, in whole experts
        room = r["usable_memory_bytes"] - (r["memory_per_node_bytes"] - r["expert_shard_bytes"])
        local = 16 // m["nodes"]
        assert (
            m["resident_experts"] == int(room // (r["expert_shard_bytes"] / local))
            and 0 < m["resident_experts"] < local
        )
        # worked out here from the model's statement, not by the CLI's own function: the hottest
        # resident experts of Zipf(skew) popularity hit; each miss reads one expert at the
        # preset's 4 GB/s disk; the time per token grows by the misses' reads
        zipf = [(i + 1) ** -m["skew"] for i in range(local)]
        hit = sum(zipf[: m["resident_experts"]]) / sum(zipf)
        misses = r["expected_experts"] * layers * (1 - hit)
        want = 1 / (r["time_s"] + misses * per_expert / 4e9)
        assert m["tokens_per_s"] == pytest.approx(want) and m["tokens_per_s"] < r["tokens_per_s"]
    skewed = {m["nodes"]: m["tokens_per_s"] for m in misfits if m["skew"] == 1}
    assert all(
        skewed[m["nodes"]] > m["tokens_per_s"] for m in misfits if m["skew"] == 0
    )  # hotter experts stay
    text = plan(*args).stdout
    warned = [
        line for line in text.splitlines() if line.startswith("at 2 nodes (10gbe) a node needs")
    ]
    first = next(m for m in misfits if m["nodes"] == 2 and m["skew"] == 0)
    assert warned and f"expected {first['tokens_per_s']:.2f} tok/s" in warned[0], text
    assert "2 of its 8 experts per layer resident" in warned[0] and "uniform routing" in warned[0]
    # fits nowhere: the replicated weights alone exceed a node's memory
    tiny = plan_json(
        "--model", "dbrx", "--hardware", "m4-pro-64", "--nodes", "2", "--memory-fraction", "0.01"
    )
    assert tiny["misfits"] == [{**tiny["misfits"][0], "servable": False}]
    assert (
        "no expert cache helps"
        in plan(
            "--model",
            "dbrx",
            "--hardware",
            "m4-pro-64",
            "--nodes",
            "2",
            "--memory-fraction",
            "0.01",
        ).stdout
    )

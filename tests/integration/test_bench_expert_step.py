"""`moe-cluster bench expert-step` through the CLI: on this CPU the redirected route is timed at
every m and the skip route says why it cannot run; with the skip kernel stood in for by a plain
MLX reference (the kernel itself needs CUDA), the skip route is handed -1 for exactly the positions
the other node computes (nothing of theirs to read) and gives the redirected route's output."""

from __future__ import annotations

import json

import mlx.core as mx

from conftest import assert_one_line_error, cli_in_process

SMALL = ("--shapes", "dbrx", "--small", "--iters", "2", "--json")


def _run(*args: str) -> dict:
    r = cli_in_process("bench", "expert-step", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_on_a_cpu_the_redirected_route_is_timed_and_the_skip_route_says_why_not():
    out = _run("--formats", "float,affine-4-64", *SMALL)
    assert out["dtype"] == "float32" and not out["skip_kernels"]
    for case in out["cases"]:
        assert "CUDA only" in case["skip"] and case["redirected"] is None, case
        assert [s["mine"] for s in case["steps"]] == list(range(case["top_k"] + 1))
        assert all(s["redirected_ms"] > 0 and s["sorted_ms"] > 0 for s in case["steps"])
        assert not any("skip_ms" in s for s in case["steps"])


def test_the_skip_route_reads_only_the_nodes_own_positions(monkeypatch):
    from moe_cluster.node.moe import kernels, qskip, skip_gemv

    read = []  # per kernel call: the slots it was asked to read (-1: nothing)

    def stand_in(p, x, slots, per_x):
        read.append(slots.tolist())
        if p.quant is not None:
            return qskip.reference(x, qskip.QMatrix.of(p), slots, per_x)
        src = x[mx.arange(slots.shape[0]) // per_x][:, None, :]
        safe = mx.maximum(slots, 0).astype(mx.uint32)
        y = mx.gather_mm(src, p.weight.swapaxes(-1, -2), rhs_indices=safe)[:, 0, :]
        return mx.where((slots >= 0)[:, None], y, 0.0)

    monkeypatch.setattr(skip_gemv, "available", lambda: True)
    monkeypatch.setattr(kernels, "skip_fits", lambda mlp: (None, mx.float32))
    monkeypatch.setattr(kernels, "skip_proj", stand_in)
    out = _run("--formats", "float,affine-4-64", *SMALL)
    k = out["cases"][0]["top_k"]
    for case in out["cases"]:
        assert case["skip"] is None, case
        for s in case["steps"]:
            assert s["skip_ms"] > 0 and s["max_abs_diff"] < 1e-4, (case["format"], s)
    # each kernel call reads the node's m experts and is handed -1 (nothing to read) for the other
    # node's k - m positions, for every m from 0 to k
    seen = set()
    for slots in read:
        m = sum(s >= 0 for s in slots)
        assert slots == list(range(m)) + [-1] * (k - m), slots
        seen.add(m)
    assert seen == set(range(k + 1))


def test_a_bad_format_or_shape_is_one_line():
    assert_one_line_error(
        cli_in_process("bench", "expert-step", "--formats", "affine-3"), "affine-3"
    )
    assert_one_line_error(cli_in_process("bench", "expert-step", "--shapes", "gpt5"), "gpt5")

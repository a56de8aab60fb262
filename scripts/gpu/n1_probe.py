"""Where the cluster path at N = 1 loses to stock mlx-lm on a GPU (issue 15: 0.66x on an H200,
bf16, with different tokens), one suspect at a time, on one checkpoint:

- decode tok/s, stock against the sharded model (as `bench decode`'s cluster_ratio), and the
  sharded model again with the device-routed counting (`ShardState.note`) switched off;
- one MoE block per layer, chained through every layer and evaluated once (a token's MoE work,
  no attention): stock block against ours, time per block, and their outputs' largest difference;
- the dtypes of every parameter and activation that differ between the two.

    python3 scripts/gpu/n1_probe.py /tmp/qwen3-30b-a3b [--tokens 64] > n1.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
from mlx.utils import tree_flatten


def decode_tps(model, tokenizer, ids, tokens: int) -> tuple[float, list[int]]:
    from mlx_lm.generate import stream_generate

    out, last = [], None
    for last in stream_generate(model, tokenizer, ids, max_tokens=tokens):
        out.append(last.token)
    return last.generation_tps, out


def blocks_time(blocks, x, reps: int) -> tuple[float, mx.array]:
    def chain():
        y = x
        for b in blocks:
            y = b(y)
        return y

    mx.eval(chain())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        y = chain()
        mx.eval(y)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / len(blocks), y


def build_time(blocks, x, reps: int = 20) -> float:
    """Python's time to build one chain's graph, per block (nothing evaluated)."""
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        y = x
        for b in blocks:
            y = b(y)
        times.append(time.perf_counter() - t0)
        del y
    return statistics.median(times) / len(blocks)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()

    from moe_cluster.coordinator.dev.run_local import load_stock
    from moe_cluster.node.moe import experts as experts_mod
    from moe_cluster.node.moe.load import load_shard

    _, stock, tokenizer = load_stock(args.model)
    ours = load_shard(args.model, None, 0, keepalive="none", warm_up=False).model
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    out: dict = {"device": str(mx.default_device()), "mlx": mx.__version__}

    sp = dict(tree_flatten(stock.parameters()))
    op = {
        k.replace(".block.", "."): v for k, v in tree_flatten(ours.parameters())
    }  # ClusterMoE wraps the block
    out["param_dtype_diffs"] = [
        (k, str(sp[k].dtype), str(op[k].dtype))
        for k in sp
        if k in op and sp[k].dtype != op[k].dtype
    ][:20]
    out["params_missing"] = sorted(set(sp) ^ set(op))[:20]
    same_values = [k for k in sp if k in op and sp[k].shape == op[k].shape]
    out["param_max_abs_diff"] = max(
        float(mx.abs(sp[k].astype(mx.float32) - op[k].astype(mx.float32)).max())
        for k in same_values[:400]
    )

    real_note = experts_mod.ShardState.note
    rows = []
    for _ in range(args.rounds):
        s, s_tokens = decode_tps(stock, tokenizer, ids, args.tokens)
        o, o_tokens = decode_tps(ours, tokenizer, ids, args.tokens)
        experts_mod.ShardState.note = lambda self, *a: None
        try:
            q, _ = decode_tps(ours, tokenizer, ids, args.tokens)
        finally:
            experts_mod.ShardState.note = real_note
        rows.append({"stock": s, "ours": o, "ours_without_note": q})
        out["same_tokens"] = s_tokens == o_tokens
        out["first_mismatch"] = next(
            (i for i, (a, b) in enumerate(zip(s_tokens, o_tokens)) if a != b), None
        )
    out["decode_tps"] = rows

    from moe_cluster.node.moe.layer import ClusterMoE
    from moe_cluster.node.moe.structure import get_bank, set_bank

    # the stock block at each path where ours has a ClusterMoE (model.layers.i.mlp, transformer.blocks.i.ffn, ...)
    stock_at = dict(stock.named_modules())
    pairs = [(stock_at[path], m) for path, m in ours.named_modules() if isinstance(m, ClusterMoE)]
    embed = next(v for k, v in sp.items() if k.endswith(("embed_tokens.weight", "wte.weight")))
    x = (mx.random.normal((1, 1, embed.shape[-1])) * 0.5).astype(embed.dtype)
    ts, ys = blocks_time([s for s, _ in pairs], x, 20)
    to, yo = blocks_time([o for _, o in pairs], x, 20)
    one_s, one_o = pairs[0][0](x), pairs[0][1](x)
    out["block_us"] = {"stock": ts * 1e6, "ours": to * 1e6}
    out["build_us"] = {
        "stock": build_time([s for s, _ in pairs], x) * 1e6,
        "ours": build_time([o for _, o in pairs], x) * 1e6,
    }
    # suspects one at a time, per block: our wrapper around stock's bank; stock's block on our
    # prestacked weights; ours without the routing note
    attr = pairs[0][1].description.bank.attr
    banks = [(o, get_bank(o.block, attr), getattr(s, attr)) for s, o in pairs]
    for o, _, stock_bank in banks:
        set_bank(o.block, attr, stock_bank)
    out["block_us"]["ours_with_stock_bank"] = blocks_time([o for _, o in pairs], x, 20)[0] * 1e6
    for o, shard, _ in banks:
        set_bank(o.block, attr, shard)
    swapped = []
    for s, o in pairs:
        mine, theirs = get_bank(o.block, attr), getattr(s, attr)
        for name, proj in mine.children().items():
            if hasattr(theirs, name) and hasattr(proj, "weight"):
                swapped.append((getattr(theirs, name), getattr(theirs, name).weight))
                getattr(theirs, name).weight = proj.weight
    if swapped:
        out["block_us"]["stock_on_our_weights"] = blocks_time([s for s, _ in pairs], x, 20)[0] * 1e6
        for lin, w in swapped:
            lin.weight = w
    experts_mod.ShardState.note = lambda self, *a: None
    try:
        out["block_us"]["ours_without_note"] = blocks_time([o for _, o in pairs], x, 20)[0] * 1e6
    finally:
        experts_mod.ShardState.note = real_note
    out["block_out_dtype"] = {"stock": str(one_s.dtype), "ours": str(one_o.dtype)}
    out["block_max_abs_diff_one_layer"] = float(
        mx.abs(one_s.astype(mx.float32) - one_o.astype(mx.float32)).max()
    )
    out["block_max_abs_diff_chain"] = float(
        mx.abs(ys.astype(mx.float32) - yo.astype(mx.float32)).max()
    )
    out["moe_blocks"] = len(pairs)
    print(json.dumps(out, indent=1), flush=True)


if __name__ == "__main__":
    main()

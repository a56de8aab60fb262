"""Whether the cluster path at N = 1 holds more device memory than stock mlx-lm on one checkpoint, and
whether MLX's memory limit throttles it (raised to 95% of the device at the end) (issue 15: a 48-layer Qwen3-30B-A3B shape ran at ~0.6x stock
on an H100 while a 12-layer one ran at 0.93x). Stock first, then ours, one at a time:

    python3 scripts/gpu/memory_probe.py /tmp/qwen3-30b-a3b [--tokens 64] > memory.jsonl

One JSON line per stage, printed as it ends: a run cut short by the device call's limit still says
how far it got (run 7's first try printed nothing in 200 s: two 59 GB loads and a build).
"""

from __future__ import annotations

import argparse
import gc
import json

import mlx.core as mx


def memory() -> dict:
    return {
        "active": mx.get_active_memory(),
        "cache": mx.get_cache_memory(),
        "peak": mx.get_peak_memory(),
        "limit": mx.get_memory_limit() if hasattr(mx, "get_memory_limit") else None,
    }


def decode_tps(model, tokenizer, ids, tokens: int) -> float:
    from mlx_lm.generate import stream_generate

    last = None
    for last in stream_generate(model, tokenizer, ids, max_tokens=tokens):
        pass
    return last.generation_tps


def emit(stage: str, **values) -> None:
    print(json.dumps({"stage": stage, **values}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument(
        "--no-stock",
        action="store_true",
        help="only ours (stock's speed is bench decode's to measure)",
    )
    args = p.parse_args()

    from moe_cluster.coordinator.dev.run_local import load_stock
    from moe_cluster.node.moe.load import load_shard

    try:
        info = {k: v for k, v in mx.device_info().items() if isinstance(v, (int, str))}
    except Exception as exc:  # noqa: BLE001
        info = repr(exc)
    emit("device", device=str(mx.default_device()), info=info)
    from moe_cluster.node.checkpoint import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    ids = tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)
    if not args.no_stock:
        _, stock, _ = load_stock(args.model)
        emit("stock loaded", **memory())
        emit(
            "stock decoded",
            tps=[decode_tps(stock, tokenizer, ids, args.tokens) for _ in range(3)],
            **memory(),
        )
        del stock
        gc.collect()
        mx.clear_cache()
        mx.reset_peak_memory()
    ours = load_shard(args.model, None, 0, keepalive="none", warm_up=False).model
    gc.collect()
    emit("ours loaded", **memory())
    emit(
        "ours decoded",
        tps=[decode_tps(ours, tokenizer, ids, args.tokens) for _ in range(3)],
        **memory(),
    )
    mx.clear_cache()
    emit(
        "ours decoded, cache cleared first",
        tps=[decode_tps(ours, tokenizer, ids, args.tokens) for _ in range(2)],
        **memory(),
    )
    # the suspect itself: with MLX's limit raised to 95% of the card, does ours decode at stock's speed?
    total = info.get("total_memory") or info.get("memory_size") if isinstance(info, dict) else None
    if total and hasattr(mx, "set_memory_limit"):
        mx.set_memory_limit(int(0.95 * total))
        emit(
            "ours decoded, memory limit at 95% of the device",
            tps=[decode_tps(ours, tokenizer, ids, args.tokens) for _ in range(2)],
            **memory(),
        )


if __name__ == "__main__":
    main()

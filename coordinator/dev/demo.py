"""`moe-cluster demo-model` and `moe-cluster train-demo`."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

from ...proto.errors import UserError

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
}


def parse_size(text: str) -> int:
    """'200KB' -> 200000 bytes; plain numbers are bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m[2].upper() not in _UNITS:
        raise UserError(
            f"size {text!r} is not a number with an optional unit (B, KB, MB, GB, KiB, MiB, GiB)"
        )
    n = int(float(m[1]) * _UNITS[m[2].upper()])
    if n <= 0:
        raise UserError(f"size {text!r} must be positive")
    return n


def demo_model(args) -> int:
    from ...node.demo.archs import ARCHS
    from ...node.demo.make import DemoSpec, make_checkpoint

    arch = ARCHS.get(args.arch)
    try:
        overrides = json.loads(args.config) if args.config else {}
    except json.JSONDecodeError as exc:
        raise UserError(f"--config is not valid JSON: {exc}") from exc
    layers = args.layers if args.layers is not None else max(2, arch.min_layers if arch else 2)
    spec = DemoSpec(
        arch=args.arch,
        layers=layers,
        experts=args.experts,
        top_k=args.top_k,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        expert_ffn=args.ffn,
        dtype=args.dtype,
        quantize=args.quantize,
        layout=args.layout,
        seed=args.seed,
        shard_bytes=parse_size(args.shard_size),
        mixed_bits=args.mixed_bits,
        overrides=overrides,
    )
    info = make_checkpoint(spec, Path(args.out))
    print(json.dumps(info))
    return 0


def train_demo(args) -> int:
    import logging

    from ...node.demo.train import TrainConfig, train_demo as train

    logging.getLogger("moe_cluster.node.demo.train").setLevel(logging.INFO)
    if args.mtp:
        return _train_mtp(args)
    tc = _flags(TrainConfig(seed=args.seed), args)
    report = train(Path(args.out), tc)
    print(
        json.dumps(
            {k: report[k] for k in ("parameters", "bytes", "val_perplexity")} | {"out": args.out}
        )
    )
    return 0


def _train_mtp(args) -> int:
    import logging

    from ...node.demo.train_mtp import MTPTrainConfig, train_mtp

    logging.getLogger("moe_cluster.node.demo.train_mtp").setLevel(logging.INFO)
    out = Path(args.out)
    if not (out / "config.json").exists():
        raise UserError(f"train-demo --mtp trains a layer for a model: {out} has no config.json")
    tc = _flags(MTPTrainConfig(seed=args.seed), args)
    report = train_mtp(out, tc)
    last = report["history"][-1] if report["history"] else {}
    print(json.dumps({"out": args.out, "parameters": report["parameters"], **last}))
    return 0


def _flags(tc, args):
    """A training config (the model's or its MTP layer's) with `train-demo`'s --steps, --batch and
    --repeat where given."""
    if args.steps:
        tc = replace(tc, steps=args.steps, warmup=min(tc.warmup, max(1, args.steps // 10)))
    if args.batch:
        tc = replace(tc, batch=args.batch)
    if args.repeat is not None:
        tc = replace(tc, repeat=args.repeat)
    return tc

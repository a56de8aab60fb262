"""The `moe-cluster` command line: parses arguments and hands each command to its module."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback

# Quiet third-party chatter (transformers warns that PyTorch is absent; we never need it).
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

logger = logging.getLogger("moe_cluster")

EXIT_USAGE = 2  # bad input: a clear one-line error
EXIT_INTERNAL = 1


def _known_errors() -> tuple[type[BaseException], ...]:
    """Errors that are the user's input, printed as one line (imported lazily: cheap commands stay cheap)."""
    from ..node.checkpoint import CheckpointError

    errors: list[type[BaseException]] = [CheckpointError, FileNotFoundError, NotADirectoryError, ValueError]
    for mod, name in (
        ("moe_cluster.coordinator.config", "ConfigError"),
        ("moe_cluster.coordinator.placement", "PlacementError"),
        ("moe_cluster.node.shard", "ShardError"),
        ("moe_cluster.coordinator.client", "ClusterError"),
        ("moe_cluster.node.collective", "CollectiveError"),
    ):
        try:
            errors.append(getattr(importlib.import_module(mod), name))
        except (ImportError, AttributeError):
            pass
    return tuple(errors)


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {n}")
    return n


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 100) -> None:
    p.add_argument("--max-tokens", type=_positive_int, default=max_tokens, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moe-cluster",
        description="Serve Mixture-of-Experts LLMs from a LAN of Macs by expert parallelism.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("run", help="generate text on this machine alone (stock mlx-lm)")
    p.add_argument("--model", required=True, help="checkpoint folder, or 'demo'")
    p.add_argument("--prompt", required=True)
    add_sampling_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler="moe_cluster.coordinator.run_local:main")

    p = sub.add_parser("simulate", help="run N node processes of a sharded model on this machine")
    p.add_argument("--model", required=True, help="checkpoint folder, or 'demo'")
    p.add_argument("--nodes", type=_positive_int, required=True)
    p.add_argument("--keepalive", choices=("none", "lru", "busy"), default="lru")
    p.add_argument("--placement", default=None, help='JSON file {"layers": {"<layer>": {"<rank>": [experts]}}}')
    p.add_argument("--prompt", required=True)
    add_sampling_args(p, max_tokens=32)
    p.add_argument("--check", action="store_true", help="also run stock mlx-lm and compare tokens and logits")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler="moe_cluster.coordinator.simulate:main")

    p = sub.add_parser("demo-model", help="write a random-weight MoE checkpoint of a chosen family")
    p.add_argument("--arch", required=True, help="mixtral, qwen2_moe, qwen3_moe, deepseek_v3, dbrx, gpt_oss, olmoe, qwen3_next")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--layers", type=_positive_int, default=None, help="decoder layers (default: the family's minimum, at least 2)")
    p.add_argument("--experts", type=_positive_int, default=8)
    p.add_argument("--top-k", type=_positive_int, default=2)
    p.add_argument("--hidden", type=_positive_int, default=64)
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    p.add_argument("--quantize", type=int, default=None, help="4 or 8 bits")
    p.add_argument("--mixed-bits", action="store_true", help="with --quantize: 8-bit experts in the first MoE layer (a per-layer override)")
    p.add_argument("--layout", default="mlx", help="mlx (stacked experts) or hf (as Hugging Face releases store them)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-size", default="5GB", help="split the weights into files past this size (e.g. 200KB, 5GB)")
    p.set_defaults(handler="moe_cluster.coordinator.demo_cmds:demo_model")

    p = sub.add_parser("train-demo", help="train the embedded demo model on the bundled corpus")
    p.add_argument("--out", required=True, help="output folder (the shipped one is node/demo/model)")
    p.add_argument("--steps", type=_positive_int, default=None)
    p.add_argument("--batch", type=_positive_int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(handler="moe_cluster.coordinator.demo_cmds:train_demo")

    p = sub.add_parser("plan", help="capacity planning: predicted tok/s and memory per node count (paper Eq. 1)")
    importlib.import_module("moe_cluster.coordinator.plan_cmd").add_arguments(p)
    p.set_defaults(handler="moe_cluster.coordinator.plan_cmd:main")

    return parser


def _setup_logging(verbosity: int) -> None:
    level = logging.WARNING if verbosity == 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s: %(message)s", stream=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.verbose)
    module, func = args.handler.split(":")
    try:
        handler = getattr(importlib.import_module(module), func)
        return int(handler(args) or 0)
    except KeyboardInterrupt:
        print("moe-cluster: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except _known_errors() as exc:
        if args.verbose > 1:
            traceback.print_exc()
        print(f"moe-cluster {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:  # noqa: BLE001 - last resort: one line, the traceback only with -vv
        if args.verbose > 1:
            traceback.print_exc()
        print(f"moe-cluster {args.command}: internal error: {type(exc).__name__}: {exc} (rerun with -vv for details)",
              file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())

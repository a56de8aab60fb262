"""The `moe-cluster` command line: parses arguments and hands each command to its module."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import traceback

from ..common import GRPC_EXPERIMENTS, importcache

os.environ.setdefault(
    "GRPC_EXPERIMENTS", GRPC_EXPERIMENTS
)  # before anything imports grpc: every process we start inherits it
importcache.install()  # before anything imports mlx_lm (and so transformers)

from ..proto.errors import ErrorKind, MoeClusterError, UserError  # noqa: E402 - after the grpc setting
from ..proto.records import DRAFT_LIMIT, KEEPALIVES, MTP_EXPERTS, SPECULATIVE_MODES  # noqa: E402 - no mlx: cheap commands stay cheap

# Quiet third-party chatter (transformers warns that PyTorch is absent; we never need it).
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

logger = logging.getLogger("moe_cluster")

# what --model takes, everywhere (node/checkpoint.py resolve_model_path)
MODEL_HELP = "a checkpoint folder, 'demo', or a Hugging Face repo id (org/name[@revision])"

EXIT_USAGE = 2  # a UserError (bad input): one line naming the problem
EXIT_FAILURE = 1  # the cluster failed (a node down, a timeout: a typed error), or a bug


def _positive_float(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not x > 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text}")
    return x


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {n}")
    return n


def _share(text: str) -> float:
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a share from 0 to 1, got {text!r}") from None
    if not 0 <= x <= 1:
        raise argparse.ArgumentTypeError(f"expected a share from 0 to 1, got {text}")
    return x


def add_sampling_args(p: argparse.ArgumentParser, max_tokens: int = 100) -> None:
    p.add_argument(
        "--max-tokens", type=_positive_int, default=max_tokens, help="tokens to generate at most"
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")


def _draft_tokens(text: str) -> int:
    n = _positive_int(text)
    if n > DRAFT_LIMIT:
        raise argparse.ArgumentTypeError(f"must be 1 to {DRAFT_LIMIT} (got {n})")
    return n


def _mtp_experts(text: str) -> str:
    bad = [h for h in text.split(",") if h not in MTP_EXPERTS]
    if bad or len(set(text.split(","))) != len(text.split(",")):
        raise argparse.ArgumentTypeError(
            f"expected {', '.join(MTP_EXPERTS)} or a list of them, each once (got {text})"
        )
    return text


def add_speculation_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--speculative",
        choices=SPECULATIVE_MODES,
        default="off",
        help="verify drafted tokens in one step (serving.speculative)",
    )
    p.add_argument("--draft-tokens", type=_draft_tokens, default=4, help="drafts per step at most")
    p.add_argument(
        "--draft-model",
        default=None,
        help="with --speculative draft: a small checkpoint with the model's tokenizer, or 'demo'",
    )
    p.add_argument(
        "--mtp-experts",
        type=_mtp_experts,
        default="auto",
        help="with --speculative mtp: the MTP layer's routed experts whole on every node, or "
        "sharded (serving.mtp_experts: auto, whole, sharded); bench decode alternates a list "
        "(whole,sharded)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moe-cluster",
        description="Serve Mixture-of-Experts LLMs from a LAN of Macs by expert parallelism.",
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser("run", help="generate text on this machine alone (stock mlx-lm)")
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--prompt", required=True)
    add_sampling_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler="moe_cluster.coordinator.dev.run_local:main")

    p = sub.add_parser("simulate", help="run N node processes of a sharded model on this machine")
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--nodes", type=_positive_int, required=True)
    p.add_argument("--keepalive", choices=KEEPALIVES, default="lru")
    p.add_argument(
        "--placement", default=None, help='JSON file {"layers": {"<layer>": {"<rank>": [experts]}}}'
    )
    p.add_argument(
        "--expert-cache",
        default="off",
        help="experts each node keeps resident: off, a percent of its share (50%%) or a size (8GB); "
        "the rest are read from disk on a miss",
    )
    p.add_argument(
        "--routing-profile",
        default=None,
        help="profile JSON from `moe-cluster profile`: the hottest experts start resident, pinned",
    )
    p.add_argument("--prompt", required=True)
    add_sampling_args(p, max_tokens=32)
    p.add_argument(
        "--check", action="store_true", help="also run stock mlx-lm and compare tokens and logits"
    )
    p.add_argument(
        "--transport",
        choices=("shm", "envoy", "mlx"),
        default="shm",
        help="how the nodes all-reduce: shared memory, the envoy transport (TCP) or mx.distributed",
    )
    add_speculation_args(p)
    p.add_argument(
        "--prediction", default=None, help="the output you expect: speculation drafts from it"
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler="moe_cluster.coordinator.dev.simulate:main")

    p = sub.add_parser("demo-model", help="write a random-weight MoE checkpoint of a chosen family")
    p.add_argument(
        "--arch",
        required=True,
        help="mixtral, qwen2_moe, qwen3_moe, deepseek_v3, dbrx, gpt_oss, olmoe, qwen3_next",
    )
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument(
        "--layers",
        type=_positive_int,
        default=None,
        help="decoder layers (default: the family's minimum, at least 2)",
    )
    p.add_argument("--experts", type=_positive_int, default=8)
    p.add_argument("--top-k", type=_positive_int, default=2)
    p.add_argument("--hidden", type=_positive_int, default=64)
    p.add_argument("--heads", type=_positive_int, default=None, help="attention heads (default 4)")
    p.add_argument(
        "--kv-heads", type=_positive_int, default=None, help="key/value heads (default 2)"
    )
    p.add_argument(
        "--ffn",
        type=_positive_int,
        default=None,
        help="width of one routed expert (default: the family's)",
    )
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16")
    p.add_argument("--quantize", type=int, default=None, help="4 or 8 bits")
    p.add_argument(
        "--mixed-bits",
        action="store_true",
        help="with --quantize: 8-bit experts in the first MoE layer (a per-layer override)",
    )
    p.add_argument(
        "--layout",
        default="mlx",
        help="mlx (stacked experts) or hf (as Hugging Face releases store them)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--shard-size",
        default="5GB",
        help="split the weights into files past this size (e.g. 200KB, 5GB)",
    )
    p.add_argument(
        "--config",
        default=None,
        help="JSON object of config keys set over the family's, e.g. '{\"kv_lora_rank\": 512}'",
    )
    p.set_defaults(handler="moe_cluster.coordinator.dev.demo:demo_model")

    p = sub.add_parser("train-demo", help="train the embedded demo model on the bundled corpus")
    p.add_argument(
        "--out", required=True, help="output folder (the shipped one is node/demo/model)"
    )
    p.add_argument("--steps", type=_positive_int, default=None)
    p.add_argument("--batch", type=_positive_int, default=None)
    p.add_argument(
        "--repeat",
        type=_share,
        default=None,
        metavar="SHARE",
        help="share of training sequences that hold a passage twice, to teach copying "
        "(default: the shipped model's)",
    )
    p.add_argument(
        "--mtp",
        action="store_true",
        help="train a multi-token-prediction layer for the model in --out (the draft of "
        "speculative: mtp), leaving the model as it is",
    )
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(handler="moe_cluster.coordinator.dev.demo:train_demo")

    p = sub.add_parser("bench", help="benchmarks on this machine")
    bench = p.add_subparsers(dest="benchmark", metavar="BENCHMARK")
    bench.required = True
    b = bench.add_parser(
        "allreduce", help="one all-reduce: the envoy transport vs mx.distributed (ring, NCCL)"
    )
    importlib.import_module("moe_cluster.coordinator.bench.allreduce").add_arguments(b)
    b.set_defaults(handler="moe_cluster.coordinator.bench.allreduce:main")

    b = bench.add_parser(
        "link",
        help="the link between running nodes, measured by them both ways; writes a calibration",
    )
    importlib.import_module("moe_cluster.coordinator.bench.link").add_arguments(b)
    b.set_defaults(handler="moe_cluster.coordinator.bench.link:main")

    b = bench.add_parser(
        "decode",
        help="decode tok/s of our path vs stock mlx-lm, and the per-token breakdown on N nodes",
    )
    b.add_argument("--model", required=True, help=MODEL_HELP)
    b.add_argument("--nodes", default="1", help="comma list of node counts, e.g. 1,2,3,4")
    b.add_argument("--keepalive", default="none,lru", help="comma list of policies for N > 1")
    b.add_argument("--max-tokens", type=_positive_int, default=64)
    b.add_argument(
        "--rounds",
        type=_positive_int,
        default=3,
        help="timed rounds per side (medians are reported)",
    )
    b.add_argument("--prompt", default=None)
    b.add_argument(
        "--transport",
        default="shm",
        help="collective(s) for N > 1, a comma list of shm, envoy, mlx",
    )
    b.add_argument(
        "--gpus", action="store_true", help="bind node r to GPU r (CUDA_VISIBLE_DEVICES)"
    )
    b.add_argument(
        "--mlx-backend",
        choices=("auto", "ring"),
        default="auto",
        help="transport mlx's backend: auto (NCCL with --gpus where MLX has it, else the ring) or "
        "ring (to compare the host-mediated ring with the envoy)",
    )
    b.add_argument(
        "--no-peers",
        action="store_true",
        help="skip mlx-lm's tensor parallelism at N > 1 (e.g. where its processes would share one GPU)",
    )
    b.add_argument(
        "--calibrate",
        action="store_true",
        help="fit the performance model to these measurements and print its predictions beside them",
    )
    b.add_argument(
        "--expert-cache",
        default=None,
        help="comma list of resident shares to measure, e.g. 100%%,50%%,25%%: tok/s, hit rate, bytes read "
        "per token, each without and with a routing profile",
    )
    b.add_argument(
        "--routing-profile",
        default=None,
        help="profile JSON the cached runs pin from (default: one made on two other prompts)",
    )
    b.add_argument(
        "--prefetch",
        default="auto",
        help="cached runs with a profile: when a layer begins, read this many of the next layer's hottest "
        "non-resident experts; auto (default): those the profile saw selected by at least half of "
        "its tokens, at most top-k; off",
    )
    b.add_argument(
        "--route",
        default=None,
        help="the decode route every node takes at load, as cluster.yaml's `route:` (skip, device, "
        "host, measure); default: measured at load",
    )
    b.add_argument(
        "--routes",
        default=None,
        help="comma list of decode routes (skip, device, host) to alternate round by round in each "
        "cluster row at N > 1, within one load: per route tok/s, tokens and expert reads",
    )
    add_speculation_args(b)
    b.add_argument(
        "--spoil",
        default=None,
        help="with --speculative: comma list of shares of the predicted output to spoil, from 0 (every "
        "draft holds) to 1 (none does); default 0,0.1,0.25,0.5,1",
    )
    b.add_argument(
        "--streams",
        type=_positive_int,
        default=1,
        help="with --speculative: also the plain prompt as this many streams at once, with and "
        "without speculation (the batch's tok/s)",
    )
    b.add_argument("--json", action="store_true")
    b.set_defaults(handler="moe_cluster.coordinator.bench.decode:main")

    b = bench.add_parser(
        "placement", help="measured per-node expert load: even split vs profile-guided placement"
    )
    b.add_argument("--model", default="demo")
    b.add_argument("--nodes", type=_positive_int, default=2)
    b.add_argument(
        "--spare-experts",
        type=int,
        default=4,
        help="room per node for this many extra experts per layer",
    )
    b.add_argument("--max-tokens", type=_positive_int, default=48)
    b.add_argument("--json", action="store_true")
    b.set_defaults(handler="moe_cluster.coordinator.bench.placement:main")

    b = bench.add_parser(
        "prompt-cache", help="time to first token of a follow-up chat turn, prompt cache on vs off"
    )
    b.add_argument("--model", default="demo")
    b.add_argument("--nodes", type=_positive_int, default=2)
    b.add_argument(
        "--prefix-tokens", type=_positive_int, default=1200, help="size of the shared prefix"
    )
    b.add_argument("--max-tokens", type=_positive_int, default=16)
    b.add_argument("--json", action="store_true")
    b.set_defaults(handler="moe_cluster.coordinator.bench.prompt_cache:main")

    b = bench.add_parser(
        "soak", help="serve a stream of requests while a node is killed every so often"
    )
    b.add_argument("--model", default="demo")
    b.add_argument("--nodes", type=_positive_int, default=2)
    b.add_argument("--minutes", type=_positive_float, default=10.0, help="how long the soak runs")
    b.add_argument("--kill-every", type=_positive_float, default=60.0, help="seconds between kills")
    b.add_argument(
        "--kill",
        choices=("node", "coordinator"),
        default="node",
        help="what dies: a node process, or `up` (run under `supervise`, adopting the nodes)",
    )
    b.add_argument(
        "--request-timeout",
        type=_positive_float,
        default=30.0,
        help="seconds a request may take before it counts as hung",
    )
    b.add_argument(
        "--log-dir",
        default=None,
        help="keep the coordinator's and the nodes' logs here (default: none kept)",
    )
    b.add_argument("--json", action="store_true")
    b.set_defaults(handler="moe_cluster.coordinator.bench.soak:main")

    b = bench.add_parser(
        "adopt",
        help="kill -9 of the coordinator while streams decode: orphans dropped, a new up adopts",
    )
    importlib.import_module("moe_cluster.coordinator.bench.adopt").add_arguments(b)
    b.set_defaults(handler="moe_cluster.coordinator.bench.adopt:main")

    b = bench.add_parser(
        "serve",
        help="many users at once: aggregate tok/s, TTFT and ITL of our cluster and mlx_lm.server",
    )
    importlib.import_module("moe_cluster.coordinator.bench.serve").add_arguments(b)
    b.set_defaults(handler="moe_cluster.coordinator.bench.serve:main")

    b = bench.add_parser(
        "race", help="ours against mlx-lm's pipeline and tensor parallelism: batch 1 and B streams"
    )
    importlib.import_module("moe_cluster.coordinator.bench.race").add_arguments(b)
    b.set_defaults(handler="moe_cluster.coordinator.bench.race:main")

    b = bench.add_parser(
        "expert-step",
        help="does a node read only its own experts? one decode token's expert step per kernel",
    )
    importlib.import_module("moe_cluster.coordinator.bench.expert_step").add_arguments(b)
    b.set_defaults(handler="moe_cluster.coordinator.bench.expert_step:main")

    b = bench.add_parser(
        "ship", help="shipping a shard to a node: throughput against raw TCP, coordinator memory"
    )
    importlib.import_module("moe_cluster.coordinator.bench.ship").add_arguments(b)
    b.set_defaults(handler="moe_cluster.coordinator.bench.ship:main")

    p = sub.add_parser(
        "envoy",
        help="run one envoy by hand (nodes start their own); secret from $MOE_CLUSTER_SECRET",
    )
    importlib.import_module("moe_cluster.envoy.main").add_arguments(p)
    p.set_defaults(handler="moe_cluster.envoy.main:run")

    p = sub.add_parser(
        "up", help="start (or find) the nodes of a cluster.yaml, load the model, serve the API"
    )
    p.add_argument("file", help="cluster.yaml")
    p.add_argument("--model", default=None, help="override the file's model: " + MODEL_HELP)
    p.add_argument(
        "--api-port", type=int, default=None, help="override the file's API port (0: any free port)"
    )
    p.add_argument("--log-dir", default=None, help="where local nodes write their logs")
    p.set_defaults(handler="moe_cluster.coordinator.serve.up:main")

    p = sub.add_parser(
        "supervise",
        help="run `up FILE` and start it again whenever it dies, holding the API's port meanwhile",
    )
    p.add_argument("file", help="cluster.yaml")
    p.add_argument("--model", default=None, help="override the file's model: " + MODEL_HELP)
    p.add_argument("--api-port", type=int, default=None, help="override the file's API port")
    p.add_argument("--log-dir", default=None, help="where local nodes write their logs")
    p.set_defaults(handler="moe_cluster.coordinator.service.supervise:main")

    p = sub.add_parser(
        "service",
        help="run a node or the coordinator as a service: a launchd agent or a systemd unit",
    )
    importlib.import_module("moe_cluster.coordinator.service.command").add_arguments(p)
    p.set_defaults(handler="moe_cluster.coordinator.service.command:main")

    p = sub.add_parser("down", help="stop the cluster that `up` started")
    p.add_argument(
        "--url",
        default=None,
        help="the cluster's API URL (default: the one started on this machine)",
    )
    p.set_defaults(handler="moe_cluster.coordinator.serve.remote:down")

    p = sub.add_parser(
        "status", help="nodes, health, memory, experts and all-reduce of a running cluster"
    )
    p.add_argument("--url", default=None)
    p.add_argument(
        "--json", action="store_true", help="the cluster's status as JSON (one line per refresh)"
    )
    p.add_argument(
        "--watch",
        type=float,
        default=None,
        metavar="SECONDS",
        help="refresh every SECONDS until Ctrl-C",
    )
    p.add_argument(
        "--count", type=int, default=None, help="with --watch: stop after this many refreshes"
    )
    p.set_defaults(handler="moe_cluster.coordinator.serve.remote:status")

    p = sub.add_parser("generate", help="generate text on a running cluster")
    p.add_argument("--url", default=None)
    p.add_argument("--prompt", required=True)
    add_sampling_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler="moe_cluster.coordinator.serve.remote:generate")

    p = sub.add_parser(
        "profile", help="record which experts the routers pick on real prompts (for placement)"
    )
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument(
        "--prompts",
        required=True,
        help='text file, one prompt per line (or .jsonl with {"prompt"})',
    )
    p.add_argument("--out", required=True, help="profile.json to write")
    p.add_argument(
        "--max-tokens", type=_positive_int, default=32, help="tokens to generate per prompt"
    )
    p.set_defaults(handler="moe_cluster.coordinator.dev.profile:main")

    p = sub.add_parser(
        "chat", help="chat with a running cluster in the terminal (streaming, multi-turn)"
    )
    p.add_argument("--url", default=None)
    p.add_argument("--system", default=None, help="a system prompt")
    add_sampling_args(p, max_tokens=256)
    p.add_argument("--api-key", default=None, help="API key (default: $MOE_CLUSTER_API_KEY)")
    p.add_argument(
        "--verbose-stats",
        action="store_true",
        help="print tokens and time to first token per answer",
    )
    p.set_defaults(handler="moe_cluster.coordinator.dev.chat:main")

    p = sub.add_parser("validate", help="check a cluster.yaml")
    p.add_argument("file")
    p.set_defaults(handler="moe_cluster.coordinator.serve.config:validate_main")

    p = sub.add_parser(
        "node", help="the agent to run on each Mac: advertises itself, loads its shard, serves"
    )
    p.add_argument("--name", default=None, help="node name (default: this host's name)")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on")
    p.add_argument("--port", type=int, default=7700, help="agent port (0: any free port)")
    p.add_argument("--advertise", default=None, help="address to put in the mDNS record")
    p.add_argument("--cluster", default="moe-cluster", help="cluster name to advertise")
    p.add_argument(
        "--interface",
        action="append",
        help="advertise only on this interface (name or IPv4); repeatable",
    )
    p.add_argument(
        "--no-mdns", action="store_true", help="do not advertise (static addresses only)"
    )
    p.add_argument(
        "--secret-file",
        default=None,
        help="read the cluster secret from this file (else $MOE_CLUSTER_SECRET)",
    )
    p.add_argument(
        "--memory", type=int, default=None, help="memory bytes to report instead of the device's"
    )
    p.add_argument("--tls-cert", default=None)
    p.add_argument("--tls-key", default=None)
    p.add_argument("--tls-ca", default=None)
    p.add_argument(
        "--cache-dir",
        default=None,
        help="where shards the coordinator ships are kept (default ~/.cache/moe-cluster/shards)",
    )
    p.add_argument("--exit-with-parent", action="store_true", help=argparse.SUPPRESS)
    p.set_defaults(handler="moe_cluster.node.start:main")

    p = sub.add_parser(
        "cache", help="shards the coordinator shipped to this node: list, verify or remove them"
    )
    cache = p.add_subparsers(dest="cache_command", required=True)
    for name, text in (
        ("ls", "list the cached shards"),
        ("rm", "remove cached shards by name"),
        (
            "verify",
            "hash every blob of the cached shards against their manifests (a load "
            "hashes only files changed since they were last hashed)",
        ),
    ):
        c = cache.add_parser(name, help=text)
        c.add_argument(
            "--cache-dir",
            default=None,
            help="the node's --cache-dir (default ~/.cache/moe-cluster/shards)",
        )
        if name == "rm":
            c.add_argument("names", nargs="+", help="shard names, as `cache ls` shows them")
        if name == "verify":
            c.add_argument(
                "names",
                nargs="*",
                help="shard names, as `cache ls` shows them (default: every complete one)",
            )
    p.set_defaults(handler="moe_cluster.node.cache_command:cache_main")

    p = sub.add_parser(
        "plan", help="capacity planning: predicted tok/s and memory per node count (paper Eq. 1)"
    )
    importlib.import_module("moe_cluster.coordinator.plan.command").add_arguments(p)
    p.set_defaults(handler="moe_cluster.coordinator.plan.command:main")

    return parser


def _setup_logging(verbosity: int) -> None:
    level = logging.WARNING if verbosity == 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    logging.basicConfig(
        level=level, format="%(asctime)s %(name)s %(levelname)s: %(message)s", stream=sys.stderr
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _setup_logging(args.verbose)
    module, func = args.handler.split(":")
    prog = f"moe-cluster {args.command}"  # as argparse names a subcommand in its own errors
    try:
        handler = getattr(importlib.import_module(module), func)
        return int(handler(args) or 0)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except UserError as exc:
        _traceback_if(args.verbose)
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except MoeClusterError as exc:
        _traceback_if(args.verbose)
        if exc.kind is ErrorKind.INTERNAL:  # a bug relayed from a node or a child process
            print(f"{prog}: internal error: {exc} (run with -v for the traceback)", file=sys.stderr)
        else:  # the cluster, not the input: a node down, a timeout, a busy node
            print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except Exception as exc:  # noqa: BLE001 - anything else is a bug: one line, the traceback with -v
        _traceback_if(args.verbose)
        print(
            f"{prog}: internal error: {type(exc).__name__}: {exc} (run with -v for the traceback)",
            file=sys.stderr,
        )
        return EXIT_FAILURE


def _traceback_if(verbose: int) -> None:
    if verbose:
        traceback.print_exc()


if __name__ == "__main__":
    sys.exit(main())

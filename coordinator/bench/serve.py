"""`moe-cluster bench serve`: many users at once — our cluster against `mlx_lm.server` on the same
model, measured in the same run through the same HTTP client.

For each node count a local cluster is started (`moe-cluster up`, as `bench prompt-cache` does); then
`python -m mlx_lm server` on a loopback port. At each concurrency C, C clients each send
`--requests` streamed greedy completions one after another (distinct prompts), and the run reports
aggregate tok/s (streamed text events of all clients / wall time), time to first token and the gaps
between events (inter-token latency), p50 and p99. Both servers are counted by the same rule.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from ...common.ports import free_ports
from ...proto.errors import UserError
from .output import emitted
from .prompt_cache import local_cluster

PROMPTS = (
    "To be, or not to be, that is the question:",
    "Now is the winter of our discontent",
    "All the world's a stage, and all the men and women",
    "Friends, Romans, countrymen, lend me",
    "Shall I compare thee to a summer's day?",
    "The quality of mercy is not strained;",
    "If music be the food of love, play on;",
    "O Romeo, Romeo, wherefore art thou Romeo?",
)
SERVER_START_S = 120.0  # mlx_lm.server must answer /v1/models within this long
REQUEST_TIMEOUT_S = 300.0


def add_arguments(p) -> None:
    p.add_argument(
        "--model",
        default="demo",
        help="a checkpoint folder, 'demo', or a Hugging Face repo id (org/name)",
    )
    p.add_argument("--nodes", default="1,2", help="comma list of node counts")
    p.add_argument("--concurrency", default="1,4,8,16", help="comma list of concurrent clients")
    p.add_argument(
        "--requests", type=int, default=4, help="requests each client sends, one after another"
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--max-batch",
        type=int,
        help="our serving.max_batch (default: the largest --concurrency, "
        "so neither server queues a client)",
    )
    p.add_argument(
        "--overlap",
        default="off",
        help="our serving.overlap, a comma list of off and on: each a cluster of its own, "
        "measured in this run (on: two micro-batches per decode step)",
    )
    p.add_argument(
        "--speculative",
        choices=("off", "prompt-lookup"),
        default="off",
        help="our serving.speculative (docs/speculative.md)",
    )
    p.add_argument(
        "--draft-tokens", type=int, default=4, help="our serving.draft_tokens, with --speculative"
    )
    p.add_argument("--no-mlx-lm", action="store_true", help="measure only our cluster")
    p.add_argument(
        "--gpus",
        action="store_true",
        help="node i on CUDA GPU i (a multi-GPU host; mlx_lm.server on GPU 0)",
    )
    p.add_argument(
        "--plot",
        metavar="FILE.png",
        help="aggregate tok/s and p99 inter-token latency against concurrency",
    )
    p.add_argument("--json", action="store_true")


def _ints(text: str, flag: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        raise UserError(f"{flag} must list whole numbers, e.g. 1,4,8 (got {text!r})") from None
    if not out or any(n < 1 for n in out):
        raise UserError(f"{flag} must list numbers >= 1 (got {text!r})")
    return out


def _stream(url: str, prompt: str, max_tokens: int) -> tuple[float, list[float], int]:
    """One streamed greedy completion: (seconds to the first text event, the gaps between text
    events, text events). Raises on an HTTP error or a stream that ends without [DONE]."""
    body = json.dumps(
        {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    ).encode()
    req = urllib.request.Request(
        url + "/v1/completions",
        data=body,
        method="POST",
        headers={"Content-Type": "application/json", "Accept": "text/event-stream"},
    )
    t0 = time.perf_counter()
    first, last, gaps, events = None, None, [], 0
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                if first is None:
                    raise RuntimeError(f"{url}: a stream with no text")
                return first, gaps, events
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"{url}: {event['error'].get('message', event['error'])}")
            text = (event.get("choices") or [{}])[0].get("text")
            if text:
                now = time.perf_counter()
                if first is None:
                    first = now - t0
                else:
                    gaps.append(now - last)
                last = now
                events += 1
    raise RuntimeError(f"{url}: the stream ended without [DONE]")


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


_COUNTED = (
    "moe_cluster_generated_tokens_total",
    "moe_cluster_speculative_drafted_total",
    "moe_cluster_speculative_accepted_total",
    "moe_cluster_decode_allreduces_total",
)


def _counted(url: str) -> dict[str, float]:
    """Our cluster's /metrics counters of decoding (tokens, drafts, all-reduces)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in _COUNTED:
            out[name] = float(value)
    return out


def _decoding(before: dict[str, float], after: dict[str, float]) -> dict:
    """What our cluster's decoding did between two /metrics reads: drafts verified and accepted,
    and all-reduces per generated token (per MoE layer per decode step)."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in _COUNTED}
    tokens = d["moe_cluster_generated_tokens_total"]
    return {
        "drafted": int(d["moe_cluster_speculative_drafted_total"]),
        "accepted": int(d["moe_cluster_speculative_accepted_total"]),
        "allreduces_per_token": d["moe_cluster_decode_allreduces_total"] / tokens
        if tokens
        else None,
    }


def measure(url: str, concurrency: int, requests: int, max_tokens: int) -> dict:
    """C clients, each `requests` streamed completions in a row; the figures of them all."""
    ttft, itl, events, errors = [], [], [0], []
    lock = threading.Lock()

    def client(c: int) -> None:
        for i in range(requests):
            prompt = f"{PROMPTS[(c + i) % len(PROMPTS)]} ({c}.{i})"
            try:
                first, gaps, n = _stream(url, prompt, max_tokens)
            except (OSError, RuntimeError, ValueError) as exc:
                with lock:
                    errors.append(f"{type(exc).__name__}: {exc}"[:300])
                continue
            with lock:
                ttft.append(first)
                itl.extend(gaps)
                events[0] += n

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(concurrency)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(REQUEST_TIMEOUT_S * requests)
    wall = time.perf_counter() - t0
    return {
        "concurrency": concurrency,
        "requests": concurrency * requests,
        "failed": len(errors),
        "errors": errors[:3],
        "aggregate_tps": events[0] / wall,
        "seconds": wall,
        "ttft_p50_s": _pct(ttft, 0.5),
        "ttft_p99_s": _pct(ttft, 0.99),
        "ttft_max_s": max(ttft, default=0.0),
        "itl_p50_s": _pct(itl, 0.5),
        "itl_p99_s": _pct(itl, 0.99),
    }


def mlx_lm_server(model_path: str):
    """Start `python -m mlx_lm server` on a loopback port; a context manager yielding its URL."""
    import contextlib

    @contextlib.contextmanager
    def run():
        (port,) = free_ports(1)
        url = f"http://127.0.0.1:{port}"
        with tempfile.TemporaryFile("w+") as log:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "mlx_lm",
                    "server",
                    "--model",
                    model_path,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                deadline = time.monotonic() + SERVER_START_S
                while True:
                    try:
                        urllib.request.urlopen(url + "/v1/models", timeout=5).read()
                        break
                    except (urllib.error.URLError, OSError):
                        if proc.poll() is not None or time.monotonic() > deadline:
                            log.seek(0)
                            tail = log.read()[-600:].strip().replace("\n", " | ")
                            raise UserError(
                                f"mlx_lm.server did not start (exit {proc.poll()}): {tail}"
                            ) from None
                        time.sleep(0.2)
                yield url
            finally:
                proc.terminate()
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    return run()


def run(
    model: str,
    nodes: list[int],
    concurrency: list[int],
    requests: int,
    max_tokens: int,
    with_mlx_lm: bool = True,
    max_batch: int | None = None,
    gpus: bool = False,
    overlap: tuple[bool, ...] = (False,),
    speculative: str = "off",
    draft_tokens: int = 4,
) -> dict:
    from ...node.checkpoint import Checkpoint

    path = str(Checkpoint.open(model).path)  # 'demo' or a folder: refused in one line if unusable
    max_batch = max_batch or max(concurrency)
    out: dict = {
        "model": path,
        "max_tokens": max_tokens,
        "requests_per_client": requests,
        "max_batch": max_batch,
        "speculative": speculative,
        "rows": [],
        "mlx_lm_server": [],
    }
    for n in nodes:
        for ov in overlap:
            serving = {
                "max_batch": max_batch,
                "queue": max(16, max(concurrency)),
                "overlap": str(ov).lower(),
                "speculative": speculative,
                "draft_tokens": draft_tokens,
            }
            with local_cluster(
                n, path, "0", serving=serving, gpus=gpus
            ) as url:  # no prompt cache: every request computes its prompt
                for c in concurrency:
                    before = _counted(url)
                    row = measure(url, c, requests, max_tokens)
                    row.update(_decoding(before, _counted(url)))
                    out["rows"].append({"nodes": n, "overlap": ov, **row})
    if with_mlx_lm:
        with mlx_lm_server(path) as url:
            for c in concurrency:
                out["mlx_lm_server"].append(measure(url, c, requests, max_tokens))
    base = {r["concurrency"]: r["aggregate_tps"] for r in out["mlx_lm_server"]}
    for r in out["rows"]:
        if base.get(r["concurrency"]):
            r["vs_mlx_lm_server"] = r["aggregate_tps"] / base[r["concurrency"]]
    return out


def plot(out: dict, path: str) -> None:
    from ..plan.plot import pyplot

    plt = pyplot()
    series = [
        (
            f"ours, N = {n}" + (", overlap" if ov else ""),
            [r for r in out["rows"] if r["nodes"] == n and r.get("overlap", False) == ov],
        )
        for n, ov in sorted({(r["nodes"], r.get("overlap", False)) for r in out["rows"]})
    ]
    if out["mlx_lm_server"]:
        series.append(("mlx_lm.server", out["mlx_lm_server"]))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120)
    for name, rows in series:
        cs = [r["concurrency"] for r in rows]
        a.plot(cs, [r["aggregate_tps"] for r in rows], "o-", label=name)
        b.plot(cs, [1e3 * r["itl_p99_s"] for r in rows], "o-", label=name)
    for ax, label in ((a, "aggregate tok/s"), (b, "p99 inter-token latency (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"{Path(out['model']).name}: {out['requests_per_client']} streamed requests of "
        f"{out['max_tokens']} tokens per client"
    )
    fig.tight_layout()
    fig.savefig(path)


def _overlap(text: str) -> tuple[bool, ...]:
    words = [w.strip() for w in text.split(",")]
    bad = [w for w in words if w not in ("off", "on")]
    if bad or not words:
        raise UserError(f"--overlap must list off and/or on (got {text!r})")
    return tuple(dict.fromkeys(w == "on" for w in words))


def main(args) -> int:
    if args.requests < 1 or args.max_tokens < 1:
        raise UserError("--requests and --max-tokens must be at least 1")
    if args.max_batch is not None and args.max_batch < 1:
        raise UserError(f"--max-batch must be at least 1 (got {args.max_batch})")
    from ...proto.records import DRAFT_LIMIT

    if not 1 <= args.draft_tokens <= DRAFT_LIMIT:
        raise UserError(f"--draft-tokens must be 1 to {DRAFT_LIMIT} (got {args.draft_tokens})")
    out = run(
        args.model,
        _ints(args.nodes, "--nodes"),
        _ints(args.concurrency, "--concurrency"),
        args.requests,
        args.max_tokens,
        not args.no_mlx_lm,
        args.max_batch,
        args.gpus,
        _overlap(args.overlap),
        args.speculative,
        args.draft_tokens,
    )
    if emitted(out, args, plot):
        return 0
    print(
        f"{out['model']}: {args.requests} streamed requests of {args.max_tokens} tokens per client"
    )
    print(
        f"{'server':>16} {'C':>4} {'agg tok/s':>10} {'ttft p50':>9} {'ttft p99':>9} {'itl p50':>8} {'itl p99':>8} {'failed':>6}"
    )
    rows = [
        (f"ours, N={r['nodes']}" + (", overlap" if r["overlap"] else ""), r) for r in out["rows"]
    ] + [("mlx_lm.server", r) for r in out["mlx_lm_server"]]
    for name, r in rows:
        print(
            f"{name:>16} {r['concurrency']:>4} {r['aggregate_tps']:>10.1f} {r['ttft_p50_s']:>9.3f} "
            f"{r['ttft_p99_s']:>9.3f} {r['itl_p50_s']:>8.4f} {r['itl_p99_s']:>8.4f} {r['failed']:>6}"
        )
    return 0

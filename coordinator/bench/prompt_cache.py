"""`moe-cluster bench prompt-cache`: time to first token of a follow-up chat turn, cache on vs off.

A multi-turn chat shares a long prefix (a system prompt and earlier turns, >= 1,000 tokens). With
the nodes' prompt cache, the follow-up turn prefills only its new tokens. The benchmark starts two
local clusters in one run, identical but for the cache budget, plays the same conversation on
both, and reports the follow-up turn's time to first token on each.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from ...proto.errors import UserError

READY = re.compile(r"moe-cluster ready: (http://\S+)")


@contextmanager
def local_cluster(
    nodes: int,
    model: str,
    prompt_cache: str,
    timeout_s: float = 300,
    log_dir: Path | None = None,
    serving: dict | None = None,
    gpus: bool = False,
):
    """Start `moe-cluster up` on a temporary local cluster; yields its URL; stops it after.
    `log_dir`: keep the coordinator's (coordinator.log, at -v) and the nodes' logs there;
    `serving`: more cluster.yaml `serving:` keys; `gpus`: node i on GPU i (`gpu:`)."""
    with tempfile.TemporaryDirectory(prefix="moe-bench-") as tmp:
        cfg = Path(tmp) / "cluster.yaml"
        names = "\n".join(
            f"  - name: bench-{i}" + (f"\n    gpu: {i}" if gpus else "") for i in range(nodes)
        )
        cfg.write_text(
            f"name: bench\nmodel: {model}\nlaunch: local\nnodes:\n{names}\n"
            f"serving:\n  prompt_cache: {prompt_cache}\n  prefill_chunk: 512\n"
            + "".join(f"  {k}: {v}\n" for k, v in (serving or {}).items())
        )
        env = dict(os.environ, PYTHONUNBUFFERED="1", XDG_RUNTIME_DIR=tmp)
        logs = Path(log_dir) if log_dir is not None else Path(tmp) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        err = open(logs / "coordinator.log", "w") if log_dir is not None else subprocess.DEVNULL
        verbose = ["-v"] if log_dir is not None else []
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "moe_cluster.coordinator.cli",
                *verbose,
                "up",
                str(cfg),
                "--api-port",
                "0",
                "--log-dir",
                str(logs),
            ],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env=env,
            start_new_session=True,
        )
        if log_dir is not None:
            err.close()  # the child holds its own copy
        url = None
        try:
            deadline = time.monotonic() + timeout_s
            for line in proc.stdout:
                m = READY.search(line)
                if m:
                    url = m.group(1)
                    break
                if time.monotonic() > deadline:
                    break
            if url is None:
                raise RuntimeError(f"benchmark cluster did not start (exit code {proc.poll()})")
            yield url
        finally:
            if url:
                try:
                    urllib.request.urlopen(
                        urllib.request.Request(
                            url + "/v1/cluster/shutdown", data=b"{}", method="POST"
                        ),
                        timeout=10,
                    ).read()
                except OSError:
                    pass
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _ttft(url: str, messages: list[dict], max_tokens: int) -> tuple[float, str, dict]:
    """(seconds to the first streamed text, the full answer, the final event) of one chat turn."""
    from ..dev.chat import stream_chat

    t0 = time.perf_counter()
    first, text, final = None, [], {}
    for event in stream_chat(
        url, messages, max_tokens=max_tokens, temperature=0.0, top_p=1.0, seed=None
    ):
        if "error" in event:
            raise RuntimeError(f"benchmark request failed: {event['error']['message']}")
        delta = event["choices"][0].get("delta", {}).get("content")
        if delta and first is None:
            first = time.perf_counter() - t0
        if delta:
            text.append(delta)
        if "usage" in event:
            final = event
    return (first if first is not None else time.perf_counter() - t0), "".join(text), final


def conversation(tokenizer, prefix_tokens: int) -> tuple[list[dict], list[str]]:
    """A system prompt of `prefix_tokens` tokens of the demo corpus, and two user turns."""
    from ...node.demo.tokenizer import corpus_texts

    text = corpus_texts()[0][: 8 * prefix_tokens]  # more characters than tokens for any tokenizer
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < prefix_tokens:
        raise UserError(
            f"the demo corpus has only {len(ids)} tokens for this tokenizer "
            f"(--prefix-tokens {prefix_tokens})"
        )
    system = tokenizer.decode(ids[:prefix_tokens])
    return [{"role": "system", "content": "You are a scholar of this text:\n" + system}], [
        "Which line do you like best?",
        "And why that one?",
    ]


def run(nodes: int, model: str, prefix_tokens: int, max_tokens: int) -> dict:
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from ...node.checkpoint import Checkpoint

    tokenizer = load_tokenizer(Checkpoint.open(model).path)
    base, turns = conversation(tokenizer, prefix_tokens)
    first_turn = base + [{"role": "user", "content": turns[0]}]
    results = {}
    for label, budget in (("without_cache", "0"), ("with_cache", "512MB")):
        with local_cluster(nodes, model, budget) as url:
            _, answer, _ = _ttft(url, first_turn, max_tokens)
            messages = first_turn + [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": turns[1]},
            ]
            ttft, follow_up, final = _ttft(url, messages, max_tokens)
            results[label] = {
                "ttft": ttft,
                "answer": follow_up,
                "prompt_tokens": final["usage"]["prompt_tokens"],
                "cached_tokens": final.get("moe_cluster", {}).get("cached_tokens", 0),
            }
    off, on = results["without_cache"], results["with_cache"]
    return {
        "nodes": nodes,
        "model": model,
        "shared_prefix_tokens": len(
            tokenizer.apply_chat_template(first_turn, add_generation_prompt=True, tokenize=True)
        ),
        "follow_up_prompt_tokens": on["prompt_tokens"],
        "without_cache_ttft_s": off["ttft"],
        "with_cache_ttft_s": on["ttft"],
        "speedup": off["ttft"] / on["ttft"],
        "cached_tokens": on["cached_tokens"],
        "same_answer": off["answer"] == on["answer"],
    }


def main(args) -> int:
    out = run(args.nodes, args.model, args.prefix_tokens, args.max_tokens)
    if args.json:
        print(json.dumps(out))
        return 0
    print(
        f"follow-up turn after a {out['shared_prefix_tokens']}-token shared prefix on {out['nodes']} nodes: "
        f"time to first token {out['without_cache_ttft_s']:.3f}s without the prompt cache, "
        f"{out['with_cache_ttft_s']:.3f}s with it ({out['speedup']:.1f}x; {out['cached_tokens']} tokens reused)"
    )
    return 0

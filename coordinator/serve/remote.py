"""Commands that talk to a running cluster's API: `status`, `down`, `generate`."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request

from ...proto.errors import NotFoundError, UserError, error_for, kind_from_http
from .client import ClusterError


def _url(args) -> str:
    if args.url:
        return args.url.rstrip("/")
    from .up import state_file

    f = state_file()
    try:
        return json.loads(f.read_text())["url"].rstrip("/")
    except (OSError, ValueError, KeyError):
        raise NotFoundError("no running cluster found on this machine; pass --url URL") from None


def _call(
    url: str, path: str, body: dict | None = None, api_key: str | None = None, timeout: float = 600
) -> dict:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        url + path,
        data=data,
        method="POST" if body is not None else "GET",
        headers={"Content-Type": "application/json"},
    )
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            detail = json.loads(exc.read())
            msg = detail.get("error", {}).get("message") or detail.get("reason") or str(detail)
        except ValueError:
            msg = exc.reason
        if path == "/health":  # 503 still carries the state
            return detail
        raise error_for(kind_from_http(exc.code), f"{url}{path}: HTTP {exc.code}: {msg}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ClusterError(f"cannot reach {url}: {reason}") from None


def _api_key(args) -> str | None:
    import os

    return getattr(args, "api_key", None) or os.environ.get("MOE_CLUSTER_API_KEY")


def status(args) -> int:
    """The cluster's status as a table (or JSON), once or every --watch seconds."""
    import time

    url = _url(args)
    watch, count = getattr(args, "watch", None), getattr(args, "count", None)
    if watch is not None and watch <= 0:
        raise UserError(f"--watch must be a number of seconds > 0 (got {watch})")
    shown = 0
    try:
        while True:
            s = _call(url, "/v1/cluster/status", api_key=_api_key(args), timeout=10)
            if args.json:
                print(json.dumps(s), flush=True)
            else:
                if watch is not None and sys.stdout.isatty():
                    print("\x1b[H\x1b[2J", end="")  # clear the terminal, as watch(1) does
                print(status_table(s), flush=True)
            shown += 1
            if watch is None or (count is not None and shown >= count):
                return 0
            time.sleep(watch)
    except KeyboardInterrupt:
        return 0


def status_table(s: dict) -> str:
    """/v1/cluster/status as the lines `moe-cluster status` prints."""
    from .placement import fmt_bytes

    lines = [
        f"cluster {s['state']}{': ' + s['reason'] if s.get('reason') else ''} — model {s['model']}, "
        f"transport {s['transport']}, up {s['uptime_s']:.0f}s, running {s.get('running', 0)}, "
        f"waiting {s.get('waiting', 0)}, attention {s.get('attention', 'replicated')}",
        f"{'node':<14} {'state':<8} {'address':<22} {'memory used / budget':<24} {'experts':>7} "
        f"{'streams':>7} {'KV':>9} {'route':<6} {'all-reduce p50':>14} {'pid':>7}",
    ]
    for n in s["nodes"]:
        mem = f"{fmt_bytes(n['used_bytes'])} / {fmt_bytes(n['budget_bytes'])}"
        p50 = n.get("allreduce_p50_s")
        p50 = "-" if p50 is None else f"<= {p50 * 1e3:g} ms"
        route = n.get("route") or "-"  # the node's decode route (node/moe/route.py), chosen at load
        # the running streams it attends for, and the KV its batch reserved for them
        kv = fmt_bytes(n.get("kv_bytes") or 0)
        lines.append(
            f"{n['name']:<14} {n['state']:<8} {n['address']:<22} {mem:<24} {n['experts']:>7} "
            f"{n.get('streams', 0):>7} {kv:>9} {route:<6} {p50:>14} {n['pid'] or '-':>7}"
        )
    return "\n".join(lines)


def down(args) -> int:
    url = _url(args)
    _call(url, "/v1/cluster/shutdown", {}, api_key=_api_key(args), timeout=10)
    print(f"stopping the cluster at {url}")
    return 0


def generate(args) -> int:
    from ...proto.records import Sampling

    Sampling(args.max_tokens, args.temperature, args.top_p, args.seed).check()
    url = _url(args)
    body = {
        "prompt": args.prompt,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
    }
    if args.seed is not None:
        body["seed"] = args.seed
    out = _call(url, "/v1/completions", body, api_key=_api_key(args))
    extra = out.get("moe_cluster", {})
    text = out["choices"][0]["text"]
    if args.json:
        print(
            json.dumps(
                {
                    "text": text,
                    "tokens": extra.get("tokens", []),
                    "prompt_tps": extra.get("prompt_tps"),
                    "generation_tps": extra.get("generation_tps"),
                    "peak_memory_bytes": extra.get("peak_memory_bytes"),
                    "finish_reason": out["choices"][0]["finish_reason"],
                    "cached_tokens": extra.get("cached_tokens", 0),
                    "usage": out.get("usage"),
                }
            )
        )
        return 0
    print(text, flush=True)
    print(
        f"{'=' * 10}\ngeneration: {len(extra.get('tokens', []))} tokens, {extra.get('generation_tps', 0):.1f} tokens/s",
        file=sys.stderr,
    )
    return 0

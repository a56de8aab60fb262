"""The rows of `bench race` and what compares them, without running anything: each row's figures
from its token times, the rows' agreement on tokens, where ours loses to a peer, what the overlap
rows hid, and rows of separate calls or passes joined into one race."""

from __future__ import annotations

import statistics

from ...proto.errors import UserError
from .serve import _pct

ROWS = (
    "ours_mlx",
    "ours_envoy",
    "ours_by_stream",
    "ours_envoy_by_stream",
    "mlx_lm_pipeline",
    "mlx_lm_tensor",
)
# ours with attention by stream (serving.attention: by-stream): each stream's owner attends for it
BY_STREAM_ROWS = ("ours_by_stream", "ours_envoy_by_stream")
# serving.attention: auto (replicated for a stream that finds nothing else running): by name
AUTO_ROWS = ("ours_auto", "ours_envoy_auto")
# ours with two micro-batches per decode step (node/overlap.py): asked for by name (--rows)
OVERLAP_ROWS = ("ours_mlx_overlap", "ours_envoy_overlap")
PEER_MODE = {"mlx_lm_pipeline": "pipeline", "mlx_lm_tensor": "tensor"}
TRANSPORT = {
    "ours_mlx": "mlx",
    "ours_envoy": "envoy",
    "ours_mlx_overlap": "mlx",
    "ours_envoy_overlap": "envoy",
    "ours_by_stream": "mlx",
    "ours_envoy_by_stream": "envoy",
    "ours_auto": "mlx",
    "ours_envoy_auto": "envoy",
}


def timing(streams: int, t0: float, tokens: list[list[int]], times: list[list[float]]) -> dict:
    """The row's figures from each stream's token times (all rows are counted by this one rule).

    The decode step is the mean gap between a stream's tokens while all `streams` run: from the
    last stream's first token to the first stream's last. A scheduler that prefills a joining
    stream between the others' decode steps (ours) puts that prefill in the gaps before it;
    one that prefills every prompt first (mlx-lm's BatchGenerator) puts none there: counting
    every gap would compare prefill with decode. Where that window holds no gap (streams that
    never all ran at once), every gap counts, and `decode_window` says so."""
    gaps = [b - a for ts in times for a, b in zip(ts, ts[1:])]
    firsts = [ts[0] - t0 for ts in times if ts]
    last = max((ts[-1] for ts in times if ts), default=t0)
    ran = [ts for ts in times if ts]
    lo = max((ts[0] for ts in ran), default=t0)
    hi = min((ts[-1] for ts in ran), default=t0)
    steady = [b - a for ts in times for a, b in zip(ts, ts[1:]) if a >= lo and b <= hi]
    window = "all running" if steady else "all gaps"
    step = statistics.mean(steady or gaps) if gaps else None
    return {
        "streams": streams,
        "generated": sum(len(t) for t in tokens),
        "ttft_s": statistics.median(firsts) if firsts else None,
        "ttft_max_s": max(firsts, default=None),
        "step_s": step,  # mean gap between a stream's tokens: one decode step of the batch
        "decode_tps": streams / step if step else None,  # all streams together, decode steps only
        "decode_window": window,
        "decode_gaps": len(steady or gaps),
        # every gap, joining streams' prefill included
        "step_s_all_gaps": statistics.mean(gaps) if gaps else None,
        "aggregate_tps": sum(len(t) for t in tokens) / (last - t0)
        if last > t0
        else None,  # prefill included
        "itl_p50_s": _pct(gaps, 0.5) if gaps else None,
        "itl_p99_s": _pct(gaps, 0.99) if gaps else None,
        "slow_gaps": slow_gaps(times),
    }


SLOW_GAP = 2.0  # a gap this many times the row's median gap is reported where it fell
SLOW_GAPS_LISTED = 8


def slow_gaps(times: list[list[float]]) -> dict | None:
    """The gaps between a stream's tokens that took over SLOW_GAP times the median gap: how many,
    what they added to the row's mean step, and the longest few with the stream and the token
    they came before (1: the first decode step). A mean step over the median is then told apart:
    a stall once a pass (a kernel built, a collective set up) against every step being slower."""
    gaps = [
        (s, i + 1, b - a) for s, ts in enumerate(times) for i, (a, b) in enumerate(zip(ts, ts[1:]))
    ]
    if not gaps:
        return None
    median = statistics.median(g for *_, g in gaps)
    slow = sorted((g for g in gaps if g[2] > SLOW_GAP * median), key=lambda g: -g[2])
    return {
        "count": len(slow),
        "of": len(gaps),
        "added_to_mean_step_s": sum(g - median for *_, g in slow) / len(gaps),
        "longest": [{"stream": s, "token": i, "s": g} for s, i, g in slow[:SLOW_GAPS_LISTED]],
    }


def _first_mismatch(a: list[int], b: list[int]) -> int | None:
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return first if first is not None or len(a) == len(b) else min(len(a), len(b))


def agreement(rows: list[dict], stock: dict) -> dict:
    """Per batch: whether every row that ran gave the same greedy tokens on every stream (None where
    fewer than two ran), and each row's streams against stock's batch-1 tokens of the same
    prompts. Sets each row's same_as_stock."""
    out = {}
    for b in dict.fromkeys(r["streams"] for r in rows):
        ran = [r for r in rows if r["streams"] == b and "tokens" in r]
        ref = ran[0] if ran else None
        differ = []
        for r in ran[1:]:
            for s, (x, y) in enumerate(zip(r["tokens"], ref["tokens"])):
                at = _first_mismatch(x, y)
                if at is not None:
                    differ.append(
                        {
                            "row": r["name"],
                            "stream": s,
                            "first_mismatch": at,
                            "against": ref["name"],
                        }
                    )
                    break
        for r in ran:
            if "tokens" in stock:
                wrong = [
                    (s, _first_mismatch(t, stock["tokens"][s])) for s, t in enumerate(r["tokens"])
                ]
                wrong = [(s, at) for s, at in wrong if at is not None]
                r["same_as_stock"] = not wrong
                if wrong:
                    r["stock_mismatch"] = {
                        "streams": len(wrong),
                        "first": {"stream": wrong[0][0], "token": wrong[0][1]},
                    }
        out[str(b)] = {
            "rows": [r["name"] for r in ran],
            "same": not differ if len(ran) > 1 else None,  # None: fewer than two rows to compare
            "differences": differ,
            "missing": [r["name"] for r in rows if r["streams"] == b and "tokens" not in r],
        }
    return out


def collective_path(row: dict) -> str:
    """The bare collective (collectives()) that stands for `row`'s: its transport and backend."""
    if TRANSPORT.get(row["name"]) == "envoy":
        return "envoy"
    return "mlx_nccl" if row.get("backend") == "nccl" else "mlx_ring"


def hidden(rows: list[dict]) -> None:
    """Each overlap row beside its row without: per MoE layer, rank 0's wait on the collective
    with and without; and of the time its all-reduces were in flight (handed over -> summed), the
    share the other micro-batch's work filled (`in_flight_hidden`: the rest the node waited)."""
    for r in rows:
        if r["name"] not in OVERLAP_ROWS or "breakdown_per_step_s" not in r:
            continue
        base = next(
            (
                b
                for b in rows
                if b["name"] == r["name"].removesuffix("_overlap")
                and b["streams"] == r["streams"]
                and "breakdown_per_step_s" in b
            ),
            None,
        )
        if base is None:
            continue
        per = r["moe_layers"] or 1
        wait = r["breakdown_per_step_s"]["collective_wait"] / per
        was = base["breakdown_per_step_s"]["collective_wait"] / per
        flight, waited = r.get("overlap_s") or (0.0, 0.0)
        r["overlap"] = {
            "collective_wait_per_layer_s": wait,
            "without_s": was,
            "hidden": 1 - wait / was if was else None,
            "in_flight_s": flight,
            "in_flight_waited_s": waited,
            "in_flight_hidden": 1 - waited / flight if flight else None,
            "speedup": r["decode_tps"] / base["decode_tps"]
            if r.get("decode_tps") and base.get("decode_tps")
            else None,
            "note": "rank 0's timers; where the step is one lazy graph (transport mlx) the "
            "collective runs inside it and its wait reads 0 (and nothing is in flight); the "
            "collective wait of pipelined lanes holds the peer's device time",
        }


def losses(rows: list[dict]) -> None:
    """Where an ours row is slower than a peer at the same batch: which peers, and where its time per
    MoE layer goes (attention+router, experts, the bare collective, waiting for the slowest node
    beyond it, the rest)."""
    for r in (r for r in rows if r["name"] in TRANSPORT and r.get("decode_tps")):
        faster = [
            p["name"]
            for p in rows
            if p["name"] in PEER_MODE
            and p["streams"] == r["streams"]
            and (p.get("decode_tps") or 0) > r["decode_tps"]
        ]
        if not faster:
            continue
        per = r["moe_layers"] or 1
        synced = "synced_breakdown_per_step_s" in r
        b = r["synced_breakdown_per_step_s" if synced else "breakdown_per_step_s"]
        bare = r.get("collective_s")
        wait = b["collective_wait"] / per
        r["loses_to"] = faster
        r["per_moe_layer_s"] = {
            "attention_router": b["attention_router"] / per,
            "experts": b["experts"] / per,
            "collective_bare": bare,
            "waiting": max(wait - bare, 0.0) if bare is not None else wait,
            "other": b["other"] / per,
            "note": (
                "timers of rank 0 in a pass with a host sync at each MoE layer's input, partial "
                "and sum (the step is one lazy graph): attention_router is everything since the "
                "last MoE layer, experts the router and the experts; the synced step took "
                f"{r['synced_step_s'] * 1e3:.1f} ms against the graph's {r['step_s'] * 1e3:.1f} ms"
                if synced
                else "timers of rank 0"
            ),
        }


def alternated(passes: list[list[dict]]) -> list[dict]:
    """One row per (row, streams) from passes over the same rows: the last pass's figures, with
    decode_tps the median of every pass's and each pass's in `decode_tps_passes`."""
    if len(passes) == 1:
        return passes[0]
    out = []
    for i, row in enumerate(passes[-1]):
        tps = [p[i].get("decode_tps") for p in passes]
        if any(t is None for t in tps):
            out.append(row)
            continue
        out.append({**row, "decode_tps": statistics.median(tps), "decode_tps_passes": tps})
    return out


def merge(parts: list[dict]) -> dict:
    """One race from the JSON of calls that each ran some of its rows on the same checkpoint
    (`bench race --merge`: on a GPU host each row runs in its own call, so that a row that crashes
    loses only itself): the rows together, each call's other fields from the first call that has
    them, and what compares rows with each other (agreement, losses, the overlap rows' hidden
    share) done again over all of them, since no single call saw its row beside the others."""
    if not parts:
        raise UserError("nothing to merge: no race JSON given")
    out: dict = {}
    rows: list[dict] = []
    for part in parts:
        rows += part["rows"]
        for k, v in part.items():
            if k not in ("rows", "agreement", "failed"):
                out.setdefault(k, v)
    for r in rows:  # set again below from all the rows
        for k in ("loses_to", "per_moe_layer_s", "overlap"):
            r.pop(k, None)
    losses(rows)
    hidden(rows)
    out["agreement"] = agreement(rows, {})
    out["rows"] = rows
    return out

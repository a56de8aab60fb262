"""`moe-cluster bench decode --speculative prompt-lookup`: decode with and without speculation in
one run, on N node processes, the scenarios alternated round by round.

Acceptance is controlled, not hoped for: the model's own greedy continuation (stock mlx-lm on the
same checkpoint) is sent as the request's predicted output with a share of its tokens spoiled,
which sweeps the rate at which drafts hold from all to none, so tok/s against acceptance is a
measured curve. Two natural scenarios sit beside it: the plain prompt (drafts from its own
n-grams) and the prompt followed by its continuation and the prompt again, the case where prompt
lookup is meant to pay on a model that repeats what it read. With `--streams B`, the plain prompt
also runs as B streams at once, with and without speculation (the batch's tok/s).
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

from ...node.checkpoint import Checkpoint
from ...proto.errors import UserError
from ...proto.records import Sampling

SPOIL = (0.0, 0.1, 0.25, 0.5, 1.0)  # shares of the prediction's tokens spoiled


@dataclass(frozen=True)
class SpeculativeBench:
    model: str
    nodes: tuple[int, ...] = (2,)
    transports: tuple[str, ...] = ("shm",)
    max_tokens: int = 64
    rounds: int = 3
    prompt: str = ""
    mode: str = "prompt-lookup"
    draft_tokens: int = 4
    spoil: tuple[float, ...] = SPOIL
    gpus: bool = False
    draft_model: str = ""  # mode "draft": its checkpoint
    streams: int = 1  # > 1: also the plain prompt as this many streams at once, off and on
    # mode "mtp": its routed experts at N > 1 (serving.mtp_experts), each alternated with the rest
    mtp_experts: tuple[str, ...] = ("auto",)


def spoiled(tokens: list[int], share: float, vocab: int, seed: int = 0) -> tuple[int, ...]:
    """`tokens` with `share` of them (chosen by `seed`) replaced by another id below `vocab`."""
    rnd = random.Random(seed)
    picked = set(rnd.sample(range(len(tokens)), round(share * len(tokens))))
    return tuple(
        (t + 1 + rnd.randrange(vocab - 1)) % vocab if i in picked else t
        for i, t in enumerate(tokens)
    )


def scenarios(
    spec: SpeculativeBench, ids: list[int], continuation: list[int], vocab: int
) -> list[dict]:
    """(name, prompt ids, prediction ids, speculative mode) of every scenario, the baseline first."""
    off = {"scenario": "off", "prompt": tuple(ids), "prediction": (), "mode": "off"}
    name = {"draft": "draft model", "auto": "auto", "mtp": "MTP layer"}.get(
        spec.mode, "prompt lookup"
    )
    # mode "mtp" with several holdings of its experts: each its own rows, alternated with the rest
    held = spec.mtp_experts if spec.mode == "mtp" else ("auto",)
    named = [(f"{name}, experts {h}" if len(held) > 1 else name, h) for h in held]
    rows = [
        off,
        *({**off, "scenario": n, "mode": spec.mode, "mtp_experts": h} for n, h in named),
        *(
            {
                **off,
                "scenario": f"{n}, the continuation in the prompt",
                "mode": spec.mode,
                "prompt": (*ids, *continuation, *ids),
                "mtp_experts": h,
            }
            for n, h in named
        ),
        {
            **off,
            "scenario": "off, the continuation in the prompt",
            "prompt": (*ids, *continuation, *ids),
        },
    ]
    if spec.streams > 1:
        many = {**off, "streams": spec.streams}
        rows.append({**many, "scenario": f"off, {spec.streams} streams"})
        rows.append({**many, "scenario": f"{name}, {spec.streams} streams", "mode": spec.mode})
    # a draft model and the MTP layer ignore predictions
    for share in spec.spoil if spec.mode not in ("draft", "mtp") else ():
        rows.append(
            {
                **off,
                "scenario": f"prediction, {share:.0%} spoiled",
                "mode": spec.mode,
                "prediction": spoiled(continuation, share, vocab, seed=int(share * 1000)),
            }
        )
    return rows


def run(spec: SpeculativeBench) -> dict:
    from ..dev.simulate import reference, run_nodes
    from ...node.checkpoint import load_tokenizer
    from ...node.sim import SimTask
    from ...node.describe import describe

    ckpt = Checkpoint.open(spec.model)
    if (spec.mode == "draft") != bool(spec.draft_model):
        raise UserError("--speculative draft and --draft-model go together")
    draft = str(Checkpoint.open(spec.draft_model).path) if spec.draft_model else ""
    if spec.mtp_experts != ("auto",) and spec.mode != "mtp":
        raise UserError(f"--mtp-experts {','.join(spec.mtp_experts)} needs --speculative mtp")
    tokenizer = load_tokenizer(ckpt.path)
    from ..dev.run_local import encode_prompt

    ids = encode_prompt(tokenizer, spec.prompt)
    sampling = Sampling(max_tokens=spec.max_tokens)
    continuation, _ = reference(str(ckpt.path), ids, sampling, ())
    if len(continuation) < spec.max_tokens:
        raise UserError(
            f"stock mlx-lm stops after {len(continuation)} tokens on this prompt; pick a longer one"
        )
    desc = describe(ckpt)
    desc.require_moe()
    rows = scenarios(spec, ids, continuation, desc.vocab)
    layers = len(desc.moe)
    out = {
        "model": spec.model,
        "max_tokens": spec.max_tokens,
        "rounds": spec.rounds,
        "draft_tokens": spec.draft_tokens,
        "mtp_experts": spec.mtp_experts,
        "moe_layers": layers,
        "runs": [],
    }
    for nodes in spec.nodes:
        for transport in spec.transports if nodes > 1 else ("shm",):
            tasks = [
                SimTask(
                    str(ckpt.path),
                    r["prompt"],
                    sampling,
                    speculative=r["mode"],
                    draft_tokens=spec.draft_tokens,
                    prediction=r["prediction"],
                    draft_model=draft if r["mode"] == "draft" else "",
                    mtp_experts=r.get("mtp_experts", "auto"),
                    streams=(r["prompt"],) * r["streams"] if r.get("streams") else None,
                )
                for _ in range(spec.rounds + 1)
                for r in rows
            ]  # the first round warms up
            reports = run_nodes(tasks, nodes, transport=transport, gpus=spec.gpus)
            out["runs"].append(
                _summary(nodes, transport, rows, reports, spec.rounds, layers, continuation)
            )
    return out


def _summary(
    nodes: int,
    transport: str,
    rows: list[dict],
    reports: list,
    rounds: int,
    layers: int,
    continuation: list[int],
) -> dict:
    per = len(rows)
    table = []
    for j, r in enumerate(rows):
        runs = [reports[i * per + j][0] for i in range(1, rounds + 1)]
        if r.get("streams"):
            runs = [_as_one(x) for x in runs]
        tps = [x["generation_tps"] for x in runs]
        f = runs[-1]["figures"]
        generated = len(runs[-1]["tokens"])
        table.append(
            {
                "scenario": r["scenario"],
                "streams": r.get("streams", 1),
                "speculative": runs[-1]["speculative"],
                "tps": statistics.median(tps),
                "rounds_tps": tps,
                "drafted": f["drafted"],
                "accepted": f["accepted"],
                "decode_steps": f["steps"],
                "acceptance": f["accepted"] / f["drafted"] if f["drafted"] else None,
                "allreduces_per_token": f["steps"] * layers / generated if generated else None,
                # counted: every MoE call of rank 0's decode steps (each one all-reduce), the MTP
                # layer's too where its experts are sharded
                "moe_calls_per_token": (
                    sum(c["calls"] for c in runs[-1]["layer_counters"].values()) / generated
                    if generated and "layer_counters" in runs[-1]
                    else None
                ),
                # every round, every node: the same tokens; with the prompt alone, stock's
                "same_tokens_every_round": all(
                    _flat(reports[i * per + j][k]["tokens"]) == runs[-1]["tokens"]
                    for i in range(1, rounds + 1)
                    for k in range(nodes)
                ),
                "tokens": runs[-1]["tokens"],
            }
        )
    base = {t["scenario"]: t for t in table}
    for t in table:
        ref = base[
            "off, the continuation in the prompt"
            if "in the prompt" in t["scenario"]
            else f"off, {t['streams']} streams"
            if t["streams"] > 1
            else "off"
        ]
        t["ratio_vs_off"] = t["tps"] / ref["tps"] if ref["tps"] else None
        # each round's ratio against the baseline's same round (run beside it), their median: a
        # machine whose speed drifts during the run moves both sides of one round alike
        t["ratio_rounds_median"] = statistics.median(
            a / b for a, b in zip(t["rounds_tps"], ref["rounds_tps"]) if b
        )
        t["tokens_equal_off"] = t["tokens"] == ref["tokens"]
    return {
        "nodes": nodes,
        "transport": transport,
        "tokens_equal_stock": base["off"]["tokens"] == continuation,
        "rows": table,
    }


def _flat(tokens: list) -> list[int]:
    """A report's tokens: one stream's, or every stream's one after another."""
    return [t for x in tokens for t in x] if tokens and isinstance(tokens[0], list) else tokens


def _as_one(report: dict) -> dict:
    """A streams pass (node/sim.py) read as one request: every stream's tokens, their tok/s over
    the batch's decode steps (once every stream has its first token), their figures summed, and
    the batch's steps as its decode steps (one all-reduce per MoE layer each)."""
    tokens = report["tokens"]
    figures = report["figures"]
    decoded = sum(len(t) for t in tokens) - len(tokens)
    return {
        "tokens": _flat(tokens),
        "generation_tps": decoded / report["decode_seconds"] if report["decode_seconds"] else 0.0,
        "speculative": report.get("speculative", ""),
        "figures": {
            "drafted": sum(f["drafted"] for f in figures),
            "accepted": sum(f["accepted"] for f in figures),
            "steps": report["decode_steps"] + 1,  # and the step that gave the first tokens
        },
    }


def main(args, nodes: tuple[int, ...], transports: tuple[str, ...], prompt: str) -> int:
    """`bench decode --speculative` (its caller checked the node counts and transports)."""
    import json

    spoil = SPOIL
    if args.spoil is not None:
        try:
            spoil = tuple(float(s) for s in args.spoil.split(","))
        except ValueError:
            raise UserError(
                f"--spoil must list shares from 0 to 1, e.g. 0,0.5,1 (got {args.spoil})"
            ) from None
        if not all(0 <= s <= 1 for s in spoil):
            raise UserError(f"--spoil must list shares from 0 to 1 (got {args.spoil})")
    spec = SpeculativeBench(
        args.model,
        nodes,
        transports,
        args.max_tokens,
        args.rounds,
        prompt,
        args.speculative,
        args.draft_tokens,
        spoil,
        args.gpus,
        args.draft_model or "",
        args.streams,
        tuple(args.mtp_experts.split(",")),
    )
    out = run(spec)
    if args.json:
        print(json.dumps(out))
        return 0
    for r in out["runs"]:
        print(
            f"N = {r['nodes']} over {r['transport']}: tokens {'equal' if r['tokens_equal_stock'] else 'DIFFER from'} "
            f"stock mlx-lm's"
        )
        for t in r["rows"]:
            acc = "-" if t["acceptance"] is None else f"{t['acceptance']:.0%}"
            print(
                f"  {t['scenario']:<48} {t['tps']:7.1f} tok/s  x{t['ratio_vs_off']:.2f}  accepted {acc:>4}  "
                f"{t['allreduces_per_token']:.2f} all-reduces/token  tokens "
                f"{'same' if t['tokens_equal_off'] else 'DIFFER'}"
            )
    return 0

"""OpenAI's answers: a completion or chat completion as one JSON object, or streamed as server-sent
events (a chunk per text delta, a tool call as its head then its arguments, usage at the end)."""

from __future__ import annotations

import json
import time
from typing import Any

from aiohttp import web

from .requests import Outcome
from .generation import Generation
from .metrics import prompt_tps
from .resume import event_stream
from .tools import ToolCall


def call_json(call: ToolCall, index: int | None = None) -> dict:
    """A tool call in OpenAI's shape (with its index, in a stream)."""
    out = {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    return out if index is None else {"index": index, **out}


def speculation_figures(counters: dict, generated: int) -> dict:
    """A request's speculation as the client sees it: drafts verified and accepted, and the
    all-reduces its decoding paid per generated token (one per MoE layer per step)."""
    steps, layers = counters.get("decode_steps", 0.0), counters.get("moe_layers", 0.0)
    return {
        "drafted": int(counters.get("drafted", 0)),
        "accepted": int(counters.get("accepted", 0)),
        "decode_steps": int(steps),
        "allreduces_per_token": round(steps * layers / generated, 3) if generated else 0.0,
    }


def usage(gen: Generation, outcome: Outcome) -> dict:
    n = len(outcome.tokens)
    return {
        "prompt_tokens": len(gen.req.prompt),
        "completion_tokens": n,
        "total_tokens": len(gen.req.prompt) + n,
    }


def extra(gen: Generation, outcome: Outcome) -> dict:
    d = outcome.done
    t = d.timings if d else None
    return {
        "tokens": outcome.tokens,
        "cached_tokens": d.cached_tokens if d else 0,
        "prompt_tps": prompt_tps(d),
        "generation_tps": (max(len(outcome.tokens), 1) / t.generation_s)
        if t and t.generation_s
        else 0.0,
        "time_to_first_token_s": gen.ttft,
        "stalls_s": [round(s, 3) for s in outcome.stalls],  # one per resume after a lost node
        "speculative": speculation_figures(d.counters if d else {}, len(outcome.tokens)),
        # rank 0's MLX peak since it started (the nodes of one cluster hold about the same)
        "peak_memory_bytes": int(d.counters.get("peak_memory_bytes", 0)) if d else 0,
    }


def final(gen: Generation, text: str, outcome: Outcome, chat: bool, model: str) -> dict:
    choice: dict[str, Any] = {"index": 0, "finish_reason": gen.reason, "logprobs": None}
    if chat:
        text = "".join(p for p in gen.parts if isinstance(p, str))
        calls = [call_json(p) for p in gen.parts if isinstance(p, ToolCall)]
        choice["message"] = {"role": "assistant", "content": text or (None if calls else "")}
        if calls:
            choice["message"]["tool_calls"] = calls
    else:
        choice["text"] = text
    return {
        "id": gen.req.request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage(gen, outcome),
        "moe_cluster": extra(gen, outcome),
    }


async def stream(
    request: web.Request,
    gen: Generation,
    chat: bool,
    model: str,
    echo: str = "",
    include_usage: bool = False,
) -> web.StreamResponse:
    """The answer as server-sent events. The last chunk carries the usage (and this server's
    figures) always; `include_usage` (stream_options) adds OpenAI's usage-only chunk after it."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    created = 0  # seconds, set once the generation has started (its first token is due)

    def chunk(
        delta_text: str | None,
        finish: str | None,
        first: bool = False,
        calls: list | None = None,
    ) -> dict:
        if chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if delta_text:
                delta["content"] = delta_text
            if calls:
                delta["tool_calls"] = calls
            choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        else:
            choice = {
                "index": 0,
                "text": delta_text or "",
                "finish_reason": finish,
                "logprobs": None,
            }
        return {
            "id": gen.req.request_id,
            "object": obj,
            "created": created,
            "model": model,
            "choices": [choice],
        }

    def sse(event: dict) -> bytes:
        return f"data: {json.dumps(event)}\n\n".encode()

    async with event_stream(request, gen) as resp:
        created = int(time.time())
        if chat:
            await resp.write(sse(chunk(None, None, first=True)))
        elif echo:
            await resp.write(sse(chunk(echo, None)))
        calls = 0
        async for piece in gen.stream_parts():
            if isinstance(piece, str):
                await resp.write(sse(chunk(piece, None)))
                continue
            # as OpenAI streams a call: its id and name first, then its arguments in deltas
            head = {
                **call_json(piece, calls),
                "function": {"name": piece.name, "arguments": ""},
            }
            await resp.write(sse(chunk(None, None, calls=[head])))
            await resp.write(
                sse(
                    chunk(
                        None,
                        None,
                        calls=[{"index": calls, "function": {"arguments": piece.arguments}}],
                    )
                )
            )
            calls += 1
        outcome = gen.outcome
        if outcome.error:
            e = gen.failure()
            await resp.write(
                sse(
                    {
                        "error": {
                            "message": e.message,
                            "type": e.type,
                            "param": None,
                            "code": e.code,
                        }
                    }
                )
            )
        else:
            final = chunk(None, gen.reason)
            final["usage"] = usage(gen, outcome)
            final["moe_cluster"] = extra(gen, outcome)
            await resp.write(sse(final))
            if include_usage:
                only = chunk(None, None)
                only["choices"], only["usage"] = [], usage(gen, outcome)
                await resp.write(sse(only))
        await resp.write(b"data: [DONE]\n\n")
    return resp

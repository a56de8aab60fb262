"""The Node service's Generate and Cancel: a request as every node runs it, and the events it
streams back (tokens, the end with its timings, or an error)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import node_pb2 as npb
from .enums import (
    FINISH_FROM_PB,
    FINISH_TO_PB,
    ConvertError,
    error_from_proto,
    error_to_proto,
    lookup,
)

if TYPE_CHECKING:
    from ..records import GenerateEvent, GenerateRequest


def generate_request_to_proto(req: GenerateRequest) -> npb.GenerateRequest:
    s = req.sampling
    try:  # protobuf refuses values its fields cannot hold (a negative id, a seed past uint64)
        msg = npb.GenerateRequest(
            request_id=req.request_id,
            prompt=list(req.prompt),
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            eos_token_ids=list(req.eos_token_ids),
            seq=req.seq,
            sampler_step=s.step,
            prediction=list(req.prediction),
            quiet=req.quiet,
            stop_sequences=[npb.Tokens(ids=list(t)) for t in req.stop_sequences],
            top_k=s.top_k,
            min_p=s.min_p,
            repetition_penalty=s.repetition_penalty,
            repetition_context_size=s.repetition_context_size,
            presence_penalty=s.presence_penalty,
            presence_context_size=s.presence_context_size,
            frequency_penalty=s.frequency_penalty,
            frequency_context_size=s.frequency_context_size,
            logit_bias=dict(s.logit_bias),
        )
        if s.seed is not None:
            msg.seed = s.seed
        if req.draft_tokens is not None:
            msg.draft_tokens = req.draft_tokens
        if req.owner >= 0:
            msg.owner = req.owner
    except (ValueError, TypeError) as exc:
        raise ConvertError(
            f"GenerateRequest {req.request_id} does not fit the wire format: {exc}"
        ) from None
    return msg


def generate_request_from_proto(
    msg: npb.GenerateRequest, *, prefill_step: int | None = None
) -> GenerateRequest:
    """GenerateRequest -> node.runtime.GenerateRequest; the prefill chunk comes from the Load."""
    from ..records import DEFAULT_PREFILL_STEP, Sampling
    from ..records import GenerateRequest

    if not msg.request_id:
        raise ConvertError("GenerateRequest.request_id is empty")
    if not msg.prompt:
        raise ConvertError(f"GenerateRequest {msg.request_id} has an empty prompt")
    seed = msg.seed if msg.HasField("seed") else None
    sampling = Sampling(
        msg.max_tokens,
        msg.temperature,
        msg.top_p,
        seed,
        msg.sampler_step,
        top_k=msg.top_k,
        min_p=msg.min_p,
        repetition_penalty=msg.repetition_penalty,
        repetition_context_size=msg.repetition_context_size,
        presence_penalty=msg.presence_penalty,
        presence_context_size=msg.presence_context_size,
        frequency_penalty=msg.frequency_penalty,
        frequency_context_size=msg.frequency_context_size,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
    )
    try:
        sampling.check()
    except ValueError as exc:
        raise ConvertError(f"GenerateRequest {msg.request_id}: {exc}") from exc
    return GenerateRequest(
        msg.request_id,
        tuple(msg.prompt),
        sampling,
        tuple(msg.eos_token_ids),
        prefill_step or DEFAULT_PREFILL_STEP,
        seq=msg.seq,
        draft_tokens=msg.draft_tokens if msg.HasField("draft_tokens") else None,
        prediction=tuple(msg.prediction),
        quiet=msg.quiet,
        stop_sequences=tuple(tuple(t.ids) for t in msg.stop_sequences if t.ids),
        owner=msg.owner if msg.HasField("owner") else -1,
    )


def generate_event_to_proto(event: GenerateEvent) -> npb.GenerateEvent:
    from ..records import GenerateDone, GeneratedTokens, NodeError

    if isinstance(event, GeneratedTokens):
        return npb.GenerateEvent(tokens=npb.Tokens(ids=list(event.ids)))
    if isinstance(event, GenerateDone):
        t = event.timings
        return npb.GenerateEvent(
            done=npb.GenerateDone(
                finish_reason=lookup(FINISH_TO_PB, event.finish_reason, "finish reason"),
                prompt_tokens=event.prompt_tokens,
                cached_tokens=event.cached_tokens,
                generated_tokens=event.generated_tokens,
                timings=npb.Timings(
                    prompt_s=t.prompt_s,
                    generation_s=t.generation_s,
                    collective_s=t.collective_s,
                    queue_s=t.queue_s,
                ),
                counters=dict(event.counters),
            )
        )
    if isinstance(event, NodeError):
        return npb.GenerateEvent(error=error_to_proto(event))
    raise ConvertError(f"not a generate event: {type(event).__name__}")


def generate_event_from_proto(msg: npb.GenerateEvent) -> GenerateEvent:
    from ..records import GenerateDone, GeneratedTokens, Timings

    kind = msg.WhichOneof("event")
    if kind == "tokens":
        return GeneratedTokens(tuple(msg.tokens.ids))
    if kind == "done":
        d, t = msg.done, msg.done.timings
        return GenerateDone(
            finish_reason=lookup(FINISH_FROM_PB, d.finish_reason, "finish reason"),
            prompt_tokens=d.prompt_tokens,
            cached_tokens=d.cached_tokens,
            generated_tokens=d.generated_tokens,
            timings=Timings(t.prompt_s, t.generation_s, t.collective_s, t.queue_s),
            counters=dict(d.counters),
        )
    if kind == "error":
        return error_from_proto(msg.error)
    raise ConvertError("GenerateEvent is empty (expected tokens, done or error)")


def cancel_request_to_proto(request_id: str, abort: bool = False) -> npb.CancelRequest:
    return npb.CancelRequest(request_id=request_id, abort=abort)


def cancel_request_from_proto(msg: npb.CancelRequest) -> str:
    if not msg.request_id:
        raise ConvertError("CancelRequest.request_id is empty")
    return msg.request_id


def cancel_is_abort(msg: npb.CancelRequest) -> bool:
    """The request failed elsewhere: its collective steps fail now (see node.proto)."""
    return msg.abort


def cancel_reply_to_proto(found: bool) -> npb.CancelReply:
    return npb.CancelReply(found=found)


def cancel_reply_from_proto(msg: npb.CancelReply) -> bool:
    return msg.found

"""The running batch: every sequence a node generates, stepped together and in lock-step with the
other nodes (continuous batching).

Each step, every node
1. rides one vector on the step's first MoE all-reduce (an explicit round trip only where the step
   runs no MoE layer): the ids of the requests it holds queued (the smallest `max_batch`), a cancel
   flag per running sequence and the token each decoding sequence sampled last step;
2. prefills joining sequences in whole chunks, at most `prefill_budget` tokens while others decode
   (a 10,000-token prompt never stalls the running streams), and runs one decode step for every
   decoding sequence at once (one all-reduce per MoE layer for all of them);
3. reads what every rank rode: a token is handed out only once every rank sampled it (a mismatch
   fails that sequence, never drifts), a cancel on any rank ends that sequence, and the requests held by
   every rank join in request order while `max_batch` and the KV budget allow (first come, first
   served: the head of the queue is never overtaken, so no request starves).
Every decision is taken from what all ranks agreed, so every node runs the same sequences in the same
order at every step. Alone (one node) there is nothing to agree and no round trip at all.

A sequence's sampler has its own key (its seed's, or one drawn for it, advanced past the draws a
resumed request made before), so its tokens do not depend on what else runs beside it; a lone
decoding sequence keeps its own KV cache (the stock path's bytes), two or more share mlx-lm's
batched caches.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
import weakref
import zlib
from dataclasses import dataclass, field
from typing import Callable, Protocol

import mlx.core as mx

from ..proto.errors import MoeClusterError, UserError
from ..proto.records import GenerateRequest
from . import sampling
from .collective.base import RIDE_MAX_TOKEN, TokenMismatch, agree, waiting

logger = logging.getLogger(__name__)

KV_STEP = 256  # mlx-lm's KVCache grows in steps of this many positions
_EPOCHS: "weakref.WeakKeyDictionary" = (
    weakref.WeakKeyDictionary()
)  # collective -> batches begun on it


@dataclass(frozen=True)
class BatchLimits:
    max_batch: int = 8  # sequences running at once
    prefill_budget: int = 512  # prompt tokens prefilled per step while other sequences decode
    kv_budget_bytes: int = 0  # KV of running sequences plus the prompt cache; 0: no limit
    speculative: str = "off"  # node.speculate.MODES
    draft_tokens: int = 4  # drafts a step verifies per sequence at most, where speculation is on
    draft_model: str = ""  # speculative "draft": the draft checkpoint (read on rank 0 only)
    overlap: bool = False  # two micro-batches per decode step (node/overlap.py)


class Sink(Protocol):
    """Where a sequence's results go (called on the engine's thread)."""

    def tokens(self, ids: list[int]) -> None: ...

    def done(self, result) -> None: ...

    def failed(self, exc: BaseException) -> None: ...


@dataclass(eq=False)
class Sequence:
    req: GenerateRequest
    seq: int
    sink: Sink
    result: object  # runtime.GenerateResult
    reserve: int = 0  # KV bytes held for it while it runs
    cancel: bool = False  # asked for on this node
    state: str = "queued"  # queued -> prefill -> decode
    cache: list | None = None  # its own KV cache until it joins the batch's
    todo: list[int] = field(
        default_factory=list
    )  # prompt tokens still to prefill (all but the last)
    first_input: int | None = None  # the last prompt token: the input of its first decode step
    token: mx.array | None = None  # sampled last step, lazy, not agreed yet
    logits: mx.array | None = None  # the row `token` was sampled from (record_logits)
    prev_logits: mx.array | None = None  # the row of the token being agreed
    key: mx.array | None = None  # its sampler's key (not greedy)
    error: BaseException | None = None  # its own failure: it leaves the batch alone after the step
    fed: list[int] = field(default_factory=list)  # tokens fed after the prompt
    t_start: float = 0.0
    t_first: float = 0.0
    # speculation (node/speculate.py): the step's tokens are read on the host, not agreed yet
    drafts: int = 0  # drafts per step at most; 0: one token per step
    allowance: int = (
        0  # drafts this step may verify (node/speculate.py adapt), from agreed steps only
    )
    cool: int = 0  # steps left without drafts after its guesses kept failing
    pending: list[int] = field(
        default_factory=list
    )  # emitted last step; the last is the next input
    pending_logits: list = field(default_factory=list)  # their rows (record_logits)

    @property
    def figures(self) -> "SequenceFigures":
        return self.result.figures


@dataclass
class SequenceFigures:
    """What one sequence's decoding cost, counted on its own (not the node's running totals)."""

    steps: int = 0  # decode steps it took part in (each: one all-reduce per MoE layer)
    collective_s: float = (
        0.0  # waiting on all-reduces in the steps it ran in (each waited for them)
    )
    drafted: int = 0  # drafts verified
    accepted: int = 0  # drafts accepted


@dataclass(frozen=True)
class StepReport:
    """What one step of the running batch did (RunningBatch.step's answer)."""

    step: int
    prefilled: int = 0  # prompt tokens prefilled
    decoded: int = 0  # sequences in the decode pass
    positions: int = 0  # positions the decode pass fed (sequences x (1 + their guesses' room))
    handed_out: int = 0  # tokens handed to the sequences' callers
    drafted: int = 0  # guesses verified
    accepted: int = 0  # guesses accepted
    admitted: tuple[str, ...] = ()  # request ids that joined
    finished: tuple[tuple[str, str], ...] = ()  # (request id, finish reason) of those that ended
    collective_s: float = 0.0  # waiting on all-reduces (0 where the step failed)
    seconds: float = 0.0


@dataclass
class _Tally:
    """A step's figures while it runs (StepReport once it ends)."""

    prefilled: int = 0
    decoded: int = 0
    positions: int = 0
    handed_out: int = 0
    drafted: int = 0
    accepted: int = 0
    admitted: list = field(default_factory=list)
    finished: list = field(default_factory=list)
    collective_s: float = 0.0


class _Lane:
    """Decoding sequences whose KV rows share one batched cache (mlx-lm's `merge`); a lone one
    keeps its own. The batch has one lane, or two where a step runs two micro-batches."""

    def __init__(self) -> None:
        self.rows: list[Sequence] = []  # the order of the cache's rows
        self.cache: list | None = None

    def join(self, s: Sequence) -> None:
        if not self.rows:
            self.cache = s.cache
        elif len(self.rows) == 1 and self.rows[0].cache is self.cache:
            first = self.rows[0]
            self.cache = [type(a).merge([a, b]) for a, b in zip(first.cache, s.cache)]
        else:
            for mine, theirs in zip(self.cache, s.cache):
                mine.extend(type(theirs).merge([theirs]))
        self.rows.append(s)

    def leave(self, s: Sequence) -> list:
        """`s` leaves; its own cache (its row, extracted) is the answer."""
        i = self.rows.index(s)
        cache = (
            self.cache
            if len(self.rows) == 1 and s.cache is self.cache
            else [c.extract(i) for c in self.cache]
        )
        keep = [j for j in range(len(self.rows)) if j != i]
        self.rows.pop(i)
        if not keep:
            self.cache = None
        elif cache is not self.cache:
            for c in self.cache:
                c.filter(keep)
        return cache

    def forward(self, model, inputs: mx.array) -> mx.array:
        return model(inputs, cache=self.cache)


class RunningBatch:
    """The node's continuous batch (see the module docstring). `submit` and `cancel` are thread-safe;
    `step` runs on the one thread that drives MLX."""

    def __init__(self, runtime, limits: BatchLimits = BatchLimits()):
        from mlx_lm.models.cache import make_prompt_cache

        self.runtime = runtime
        self.model = runtime.sharded.model
        self.collective = runtime.sharded.collective
        mergeable = all(hasattr(type(c), "merge") for c in make_prompt_cache(self.model))
        if not mergeable and limits.max_batch > 1:
            logger.info("this family's caches cannot be batched: one sequence at a time")
            limits = dataclasses.replace(limits, max_batch=1)
        if self.collective.world_size > 1 and runtime.vocab >= RIDE_MAX_TOKEN - 1:
            raise UserError(
                f"a vocabulary of {runtime.vocab} tokens is past what a step's agreement carries "
                f"({RIDE_MAX_TOKEN - 2})"
            )
        self.limits = limits
        self.kv_per_token = kv_bytes_per_token(self.model)
        self.draft_max = limits.draft_tokens if limits.speculative != "off" else 0
        self.speculation_off = None  # why a node asked to speculate cannot, for its status
        if self.draft_max:
            from .speculate import can_roll_back

            self.speculation_off = can_roll_back(make_prompt_cache(self.model))
            if self.speculation_off:
                logger.warning("speculative decoding is off: %s", self.speculation_off)
                self.draft_max = 0
        self.drafter = None  # speculative "draft": the draft model, on rank 0
        if self.draft_max and limits.speculative == "draft" and self.collective.rank == 0:
            from .speculate import Drafter

            if not limits.draft_model:
                raise UserError("speculative: draft needs a draft model (serving.draft_model)")
            self.drafter = Drafter(limits.draft_model, runtime.vocab)
        self.slots = 1 + self.draft_max  # tokens a decoding sequence rides per step
        self.overlap_off = None  # why a node asked to overlap micro-batches cannot, for its status
        self._interleave = None  # node/overlap.py, where the collective is not a graph operation
        lanes = 1
        if limits.overlap:
            self.overlap_off = _why_no_overlap(self.collective, self.draft_max, limits.max_batch)
            if self.overlap_off:
                logger.warning("two micro-batches per step are off: %s", self.overlap_off)
            else:
                lanes = 2
                if not getattr(self.collective, "in_graph", False):
                    from .overlap import Interleave

                    self._interleave = Interleave(self.collective)
        self._lock = threading.Lock()
        self._queued: dict[int, Sequence] = {}
        self._active: list[Sequence] = []  # admission order
        self._lanes = [_Lane() for _ in range(lanes)]
        self._steps = 0
        self._shapes: dict[tuple[int, int], int] = {}  # steps run per shape (_shape)
        self._recent_cancels: dict[str, None] = {}  # request ids cancelled before they arrived
        self._tally = _Tally()

    # -- from other threads --------------------------------------------------------------------

    def submit(self, req: GenerateRequest, seq: int | None, sink: Sink, result) -> Sequence:
        """`req` joins the queue as admission number `seq` (None: the request's own, else the
        runtime's next). Refused first (UserError, `NodeRuntime.check`), before any MLX work: every
        node refuses the same request, and an id past the embedding would end the process."""
        self.runtime.check(req)
        seq = seq or req.seq or self.runtime.next_seq()
        s = Sequence(req, seq, sink, result, reserve=self._reserve(req))
        with self._lock:
            if req.request_id in self._recent_cancels:
                s.cancel = True
            self._queued[seq] = s
        return s

    def withdraw(self, s: Sequence) -> None:
        """Its caller left: it ends at the next step after it joined. A queued one stays queued (the
        other ranks may admit it already; every rank must run the same sequences) and leaves at once."""
        with self._lock:
            s.cancel = True

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            found = False
            for s in [*self._queued.values(), *self._active]:
                if s.req.request_id == request_id:
                    s.cancel, found = True, True
            if not found:
                self._recent_cancels[request_id] = None
                while len(self._recent_cancels) > 1024:
                    self._recent_cancels.pop(next(iter(self._recent_cancels)))
            return found

    def cancel_all(self) -> None:
        with self._lock:
            for s in [*self._queued.values(), *self._active]:
                s.cancel = True

    def speculation(self) -> str:
        """What the node's status says of speculative decoding."""
        if self.draft_max:
            return f"{self.limits.speculative}, {self.draft_max} drafts"
        return f"off: {self.speculation_off}" if self.speculation_off else "off"

    def busy(self) -> bool:
        with self._lock:
            return bool(self._active or self._queued)

    def running(self) -> tuple[int, int]:
        with self._lock:
            return len(self._active), len(self._queued)

    def micro_batches(self) -> str:
        """What the node's status says of overlapped micro-batches."""
        if len(self._lanes) > 1:
            return "2 per step"
        return f"off: {self.overlap_off}" if self.overlap_off else "off"

    def overlapped(self) -> int:
        """All-reduces that travelled while the other micro-batch computed, since the load."""
        return self._interleave.overlapped if self._interleave is not None else 0

    def overlap_seconds(self) -> tuple[float, float]:
        """(seconds the micro-batches' all-reduces were in flight, seconds of it the node waited
        for them), since the load: the rest ran the other micro-batch (node/overlap.py)."""
        il = self._interleave
        return (il.in_flight_s, il.waited_s) if il is not None else (0.0, 0.0)

    @property
    def _decoding(self) -> list[Sequence]:
        """The decoding sequences in the order their tokens ride: lane after lane."""
        return [s for lane in self._lanes for s in lane.rows]

    @property
    def epoch_id(self) -> str:
        return f"batch-{_EPOCHS.get(self.collective, 0)}"

    # -- the step ------------------------------------------------------------------------------

    def step(self) -> StepReport:
        """One step of every running sequence, and what it did. A sequence's own failure (its
        sampler, a token the ranks sampled differently) ends that sequence alone; any other error
        fails every sequence (the report lists them as failed)."""
        t0 = time.perf_counter()
        self._tally = _Tally()
        try:
            self._step()
        except BaseException as exc:  # noqa: BLE001 - every sequence gets it, the driver goes on
            with self._lock:
                ids = [s.req.request_id for s in [*self._active, *self._queued.values()]]
            self.fail_all(exc)
            self._tally.finished.extend((rid, "failed") for rid in ids)
            if not isinstance(exc, MoeClusterError):
                raise
        t = self._tally
        return StepReport(
            self._steps,
            t.prefilled,
            t.decoded,
            t.positions,
            t.handed_out,
            t.drafted,
            t.accepted,
            tuple(t.admitted),
            tuple(t.finished),
            t.collective_s,
            time.perf_counter() - t0,
        )

    def fail_all(self, exc: BaseException) -> None:
        with self._lock:
            everyone = [*self._active, *self._queued.values()]
            self._active = []
            self._lanes = [_Lane() for _ in self._lanes]
            self._queued.clear()
        for s in everyone:
            s.sink.failed(exc)

    def _step(self) -> None:
        c = self.collective
        alone = c.world_size == 1
        timers = self.runtime.sharded.state.timers
        collective_before = timers.collective
        self.runtime.sharded.state.step_begins()
        if not self._active:  # from idle: a new epoch, the same on every node
            # numbered per collective, not per batch: one envoy may serve batches of several
            # models in turn (simulate), and a request id it has seen before is not a new request
            _EPOCHS[c] = _EPOCHS.get(c, 0) + 1
            c.begin(self.epoch_id)
        with self._lock:
            held = sorted(self._queued)[: self.limits.max_batch]
            active = list(self._active)
            cancels = [1 if s.cancel else 0 for s in active]
        decoding = list(self._decoding)
        previous = [s.token for s in decoding]  # sampled last step: what this step agrees on
        width = self.limits.max_batch
        values = None
        if self.draft_max:
            previous = [list(s.pending) for s in decoding]
        if not alone:
            host = mx.array(held + [0] * (width - len(held)) + cancels, dtype=mx.int32)
            if self.draft_max:  # every emitted token + 1, zero where a sequence emitted fewer
                toks = [
                    mx.array([t + 1 for t in p] + [0] * (self.slots - len(p)), dtype=mx.int32)
                    for p in previous
                ]
            else:
                toks = [
                    (t.reshape(-1)[:1].astype(mx.int32) + 1)
                    if t is not None
                    else mx.zeros((1,), mx.int32)
                    for t in previous
                ]
            values = mx.concatenate([host, *toks]) if toks else host
            c.ride(values)

        # mx.distributed cannot time out: the whole step is watched (MLX may block in async_eval
        # too). The first two steps of a shape may build kernels, and the second waits for the
        # first's graph: on a fresh GPU host the first decode steps of a 94-layer model build
        # theirs for longer than a stall's bound
        joining = [s for s in active if s.state == "prefill"]
        shape = self._shape(joining, decoding)
        cold = self._shapes.get(shape, 0) < 2
        with waiting(c, f"batch step {self._steps}", cold), mx.stream(_generation_stream()):
            self._prefill(joining, bool(decoding))
            logits_before = [
                s.pending_logits if self.draft_max else [s.prev_logits] for s in decoding
            ]
            if self.draft_max:
                self._verify(decoding)
            else:
                sampled = self._decode(decoding)
                if sampled is not None:
                    mx.async_eval(sampled)
            agreement = None if alone else (c.settle() or agree(c, values))

        if alone:
            common = held
            cancel = [bool(f) for f in cancels]
            if self.draft_max:
                agreed = [p or None for p in previous]
            else:
                agreed = [[int(t.item())] if t is not None else None for t in previous]
        else:
            common = sorted(set.intersection(*(set(r[:width]) for r in agreement.values)) - {0})
            cancel = [agreement.any_set(width + i) for i in range(len(active))]
            agreed = []
            for i, s in enumerate(decoding):  # token + 1; 0 where the step had none to agree on
                at = width + len(active) + i * self.slots
                try:
                    ts = [
                        agreement.token(
                            at + j, f"request {s.req.request_id}, step {len(s.fed) + j}", offset=1
                        )
                        for j in range(self.slots)
                    ]
                except (
                    TokenMismatch
                ) as exc:  # every rank reads the same agreement: all drop it alike
                    s.error, ts = exc, []
                ts = [t for t in ts if t >= 0]
                agreed.append(ts or None)
        self._steps += 1
        self._shapes[shape] = self._shapes.get(shape, 0) + 1
        waited = max(0.0, timers.collective - collective_before)  # a benchmark may reset the timers
        self._tally.collective_s = waited
        for s in active:
            s.figures.collective_s += waited
        self._settle(decoding, agreed, logits_before)
        for s in decoding:  # a sequence that failed alone leaves alone; the others go on
            if s.error is not None and s in self._active:
                self._finish(s, "failed")
        for s, flag in zip(active, cancel):
            if flag and s in self._active:
                self._finish(s, "cancelled")
        self._admit(common)

    # -- prefill and decode --------------------------------------------------------------------

    def _prefill(self, joining: list[Sequence], others_decode: bool) -> None:
        """Whole chunks of the joining prompts, in order, within the step's budget."""
        budget = self.limits.prefill_budget if others_decode else 0
        used = 0
        for s in joining:
            while s.todo:
                n = min(self._chunk(s), len(s.todo))
                if used and (not budget or used + n > budget):
                    return
                self.model(mx.array(s.todo[:n], dtype=mx.uint32)[None], cache=s.cache)
                mx.eval([x.state for x in s.cache])
                s.todo = s.todo[n:]
                used += n
                self._tally.prefilled += n
            s.state = "decode"  # its last prompt token goes in with the next decode step

    def _shape(self, joining: list[Sequence], decoding: list[Sequence]) -> tuple[int, int]:
        """What decides the kernels a step builds: its first prefill chunk's length (rounded up to a
        power of two; 0: none) and the rows it decodes."""
        first = min(self._chunk(joining[0]), len(joining[0].todo)) if joining else 0
        return (1 << (first - 1).bit_length() if first else 0, len(decoding) * self.slots)

    def _chunk(self, s: Sequence) -> int:
        return max(1, min(s.req.prefill_step, self.limits.prefill_budget))

    def _decode(self, decoding: list[Sequence]) -> mx.array | None:
        if not decoding:
            return None

        def inputs(rows: list[Sequence]) -> mx.array:
            return mx.concatenate(
                [
                    s.token.reshape(-1)[:1].astype(mx.uint32)
                    if s.token is not None
                    else mx.array([s.first_input], mx.uint32)
                    for s in rows
                ]
            )[:, None]

        lanes = [lane for lane in self._lanes if lane.rows]
        if len(lanes) == 1:
            logits = lanes[0].forward(self.model, inputs(lanes[0].rows))[:, -1, :]
        else:
            logits = mx.concatenate([x[:, -1, :] for x in self._micro_batches(lanes, inputs)])
        self._tally.decoded = self._tally.positions = len(decoding)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        sampled = sampling.sample_tokens(decoding, logprobs)
        for i, s in enumerate(decoding):
            s.token = sampled[i : i + 1] if len(decoding) > 1 else sampled
            s.figures.steps += 1
            if s.req.record_logits:
                s.logits = logits[i]
        return sampled

    def _verify(self, decoding: list[Sequence]) -> None:
        """One speculative step (node/speculate.py): each sequence feeds its next input and up to
        its own number of drafts; what the model agrees with is emitted, the rest rolled back.
        Every row is as wide as the widest allowance, whatever each sequence found to draft: the
        step's shape then depends only on what the ranks agreed, never on a token not yet agreed."""
        import numpy as np

        from .speculate import accept, lookup, predicted, rollback

        if not decoding:
            return
        width = 1 + max(s.allowance for s in decoding)
        histories = [[*s.req.prompt, *s.fed, *s.pending] for s in decoding]
        # no guess past max_tokens: the step's own token is the last one a sequence may still need
        wanted = [
            min(s.allowance, max(0, s.req.sampling.max_tokens - len(h) + len(s.req.prompt) - 1))
            for s, h in zip(decoding, histories)
        ]
        if self.limits.speculative == "draft":
            drafts = self._guessed(decoding, histories, wanted)
        else:
            drafts = []
            for s, history, k in zip(decoding, histories, wanted):
                done = len(history) - len(s.req.prompt)
                drafts.append(
                    (predicted(s.req.prediction, history, done, k) or lookup(history, k))
                    if k
                    else []
                )
        rows = []
        for s, mine in zip(decoding, drafts):
            first = s.pending[-1] if s.pending else s.first_input
            rows.append([first, *mine] + [first] * (width - 1 - len(mine)))
        (lane,) = self._lanes  # speculation keeps one lane (_why_no_overlap)
        logits = lane.forward(self.model, mx.array(rows, dtype=mx.uint32))
        self._tally.decoded, self._tally.positions = len(decoding), len(decoding) * width
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        chosen, keys = sampling.sample_positions(decoding, logprobs)
        chosen = np.array(chosen).tolist()
        drop = []
        for i, s in enumerate(decoding):
            v = accept(drafts[i], chosen[i])
            if keys[i] is not None:
                s.key = keys[i][len(v.tokens) - 1]
            s.pending = v.tokens
            s.pending_logits = (
                [logits[i, j] for j in range(len(v.tokens))] if s.req.record_logits else []
            )
            f = s.figures
            f.steps, f.drafted, f.accepted = (
                f.steps + 1,
                f.drafted + len(drafts[i]),
                f.accepted + v.accepted,
            )
            self._tally.drafted += len(drafts[i])
            self._tally.accepted += v.accepted
            drop.append(width - len(v.tokens))
            if self.drafter is not None:
                self.drafter.keep(s.seq, len(histories[i]) + v.accepted)
        rollback(lane.cache, drop)

    def _guessed(
        self, decoding: list[Sequence], histories: list[list[int]], wanted: list[int]
    ) -> list[list[int]]:
        """The draft model's guesses (node.speculate.Drafter), `wanted[i]` for sequence i at most:
        rank 0 makes them, and every rank reads rank 0's from one explicit agreement (the others
        put zeros)."""
        guesses = [
            self.drafter.guess(s.seq, h, k) if self.drafter is not None and k else []
            for s, h, k in zip(decoding, histories, wanted)
        ]
        c = self.collective
        if c.world_size == 1:
            return guesses
        k = self.draft_max
        values = [g + 1 for mine in guesses for g in (mine + [-1] * (k - len(mine)))]
        row = agree(c, values).values[0]
        return [[t - 1 for t in row[i * k : (i + 1) * k] if t > 0] for i in range(len(decoding))]

    # -- after the step ------------------------------------------------------------------------

    def _settle(
        self, decoding: list[Sequence], agreed: list[list[int] | None], rows: list[list]
    ) -> None:
        """Hand out the agreed tokens (`rows`: the logits each was taken from, where recorded);
        sequences that end leave the batch."""
        import numpy as np

        now = time.perf_counter()
        for s, tokens, logits in zip(decoding, agreed, rows):
            if tokens is None:
                continue  # its first decode step: nothing sampled before it
            r = s.result
            stats = r.stats
            if not s.t_first:
                s.t_first = now
                stats.prompt_seconds = now - s.t_start
            else:
                stats.generation_seconds = now - s.t_first
            if s.drafts:  # the agreed tokens say how many of its guesses held: the next allowance
                from .speculate import adapt

                s.allowance, s.cool = adapt(s.allowance, s.cool, len(tokens) - 1, s.drafts)
            out = []
            for token, row in zip(tokens, logits if s.req.record_logits else [None] * len(tokens)):
                s.fed.append(token)
                if row is not None:
                    r.logits.append(np.array(row.astype(mx.float32)).reshape(-1))
                if token in set(s.req.eos_token_ids):
                    stats.finish_reason = "stop"
                    break
                stats.generated += 1
                stats.tokens.append(token)
                r.tokens.append(token)
                out.append(token)
                if any(_ends_with(r.tokens, stop) for stop in s.req.stop_sequences):
                    stats.finish_reason = (
                        "stop"  # on the agreed token: every rank ends it at this step
                    )
                    break
                if stats.generated >= s.req.sampling.max_tokens:
                    stats.finish_reason = "length"
                    break
            if out:
                s.sink.tokens(out)
                self._tally.handed_out += len(out)
            if stats.finish_reason:
                self._finish(s, stats.finish_reason)
        for s in decoding:
            s.prev_logits = s.logits

    def _finish(self, s: Sequence, reason: str) -> None:
        if self.drafter is not None:
            self.drafter.drop(s.seq)
        s.result.stats.finish_reason = reason
        s.result.cancelled = reason == "cancelled"
        self._tally.finished.append((s.req.request_id, reason))
        for lane in self._lanes:
            if s in lane.rows:
                s.cache = lane.leave(s)
        with self._lock:
            self._active.remove(s)
            idle = not self._active and not self._queued
        if idle:  # the counters its caller reads are complete (this waits for the step in flight)
            self.runtime.sharded.state.settle()
        if self.runtime.prompt_cache is not None and s.cache is not None and reason != "failed":
            self.runtime.prompt_cache.store(list(s.req.prompt) + s.fed, s.cache)
        s.cache = None
        s.result.stats.prompt_tokens = len(s.req.prompt)
        if reason == "failed":
            s.sink.failed(s.error)
        else:
            s.sink.done(s.result)

    def _admit(self, common: list[int]) -> None:
        """Requests every rank holds join in request order while max_batch and the KV budget allow."""
        from mlx_lm.models.cache import make_prompt_cache

        # prefilled sequences join the decode batch first (their caches merge into the batch's)
        for s in list(self._active):
            if s.state == "decode" and s not in self._decoding:
                self._join(s)
        budget = self.limits.kv_budget_bytes
        for seq in common:
            held = sum(s.reserve for s in self._active)
            with self._lock:
                s = self._queued[
                    seq
                ]  # every rank held it when it rode, and queued ones stay queued
                if len(self._active) >= self.limits.max_batch or (
                    budget and self._active and held + s.reserve > budget
                ):
                    return  # the head of the queue waits: nobody overtakes it
                del self._queued[seq]
                self._active.append(s)
            s.t_start = time.perf_counter()
            self._tally.admitted.append(s.req.request_id)
            pc = self.runtime.prompt_cache
            cache, covered = pc.reuse(list(s.req.prompt)) if pc is not None else (None, 0)
            if cache is None:
                cache = make_prompt_cache(self.model)
            s.result.cached_tokens = covered
            s.cache = cache
            wanted = s.req.draft_tokens
            s.drafts = self.draft_max if wanted is None else min(wanted, self.draft_max)
            s.allowance = s.drafts
            prompt = list(s.req.prompt)
            s.todo = prompt[covered:-1]
            s.first_input = prompt[-1]
            s.state = "prefill" if s.todo else "decode"
            if not s.req.sampling.greedy:
                seed = s.req.sampling.seed
                key = mx.random.key(
                    seed if seed is not None else zlib.crc32(s.req.request_id.encode())
                )
                s.key = sampling.advance_key(
                    key, s.req.sampling.step
                )  # a resumed request: past its draws
            if budget and pc is not None:
                pc.make_room(budget - held - s.reserve)
            if s.state == "decode":
                self._join(s)

    def _join(self, s: Sequence) -> None:
        """`s` (prefilled) joins the decode batch, in the lane with fewer rows (the first on a tie:
        every rank joins the same sequences in the same order, so the lanes match)."""
        min(self._lanes, key=lambda lane: len(lane.rows)).join(s)

    def _micro_batches(self, lanes: list[_Lane], inputs) -> list[mx.array]:
        """One forward pass per lane, overlapped (node/overlap.py): each lane's all-reduce of a
        MoE layer is in flight while the other lane computes."""
        calls = [lambda lane=lane: lane.forward(self.model, inputs(lane.rows)) for lane in lanes]
        if self._interleave is None:  # graph collectives: one lazy graph holds both passes
            return [call() for call in calls]
        # the MoE layers hand their partials to the interleave for this pass; the node's own
        # collective (read by other threads: health, abort) stays what it is
        layers = self.runtime.sharded.layers
        for layer in layers:
            layer.set_collective(self._interleave)
        try:
            return self._interleave.run(calls)
        finally:
            for layer in layers:
                layer.set_collective(self.collective)

    def _reserve(self, req: GenerateRequest) -> int:
        if not self.kv_per_token:
            return 0
        # a verifying step holds its drafts before the rejected ones roll back
        positions = (
            math.ceil((len(req.prompt) + req.sampling.max_tokens + self.draft_max) / KV_STEP)
            * KV_STEP
        )
        return positions * self.kv_per_token


def _why_no_overlap(collective, draft_max: int, max_batch: int) -> str | None:
    """Why a node cannot run two micro-batches per step, or None where it can."""
    if collective.world_size == 1:
        return "one node has no all-reduce to hide"
    if draft_max:
        return "speculative decoding verifies the batch in one pass"
    if max_batch < 2:
        return "max_batch is 1"
    return None


def _ends_with(tokens: list[int], stop) -> bool:
    n = len(stop)
    return 0 < n <= len(tokens) and tuple(tokens[-n:]) == tuple(stop)


def _generation_stream():
    """mlx-lm's own stream for generation: the step runs where stock generate_step runs it (on the
    default stream it measured 0.73x stock at one sequence on this CPU)."""
    from mlx_lm.generate import generation_stream

    return generation_stream


def kv_bytes_per_token(model) -> int:
    """KV bytes one position takes over every layer (0 where the config does not say)."""
    args = getattr(model, "args", None)
    layers = getattr(model, "layers", None)
    if args is None or layers is None:
        return 0
    heads = getattr(args, "num_attention_heads", None)
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    head_dim = getattr(args, "head_dim", None) or (args.hidden_size // heads if heads else None)
    if not kv_heads or not head_dim:
        return 0
    from mlx.utils import tree_flatten

    floats = (
        mx.float32,
        mx.float16,
        mx.bfloat16,
    )  # the activations' dtype, not a quantized weight's
    dtype = next(
        (p.dtype for _, p in tree_flatten(model.parameters()) if p.dtype in floats), mx.float32
    )
    return len(layers) * 2 * kv_heads * head_dim * dtype.size

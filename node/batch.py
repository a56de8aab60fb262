"""The running batch: every sequence a node generates, stepped together and in lock-step with the
other nodes (continuous batching).

One step, on every node:

    vote   = (queued ids held, cancel flags, tokens emitted last step, MTP guesses)  # agreement.py
    ride(vote)                        # on the step's first MoE all-reduce: no round trip of its own
    for (sequence, n) in prefill_chunks(joining):                       # node/scheduler.py
        model(its next n prompt tokens)                                 # (1, n) -> its own KV
    logits = model(each decoding sequence's last token)                 # (B, 1) -> (B, 1, vocab)
    tokens = sample(logits)                                             # node/sampling.py, lazy
    agreed = what every rank voted                                      # the ride comes back
    for each decoding sequence: emit(agreed tokens) -> handed out, or it ends (stop, length)
    the failed, then the cancelled, leave; admissions(agreed queue) join

A token is handed out only once every rank sampled it (a mismatch fails that sequence, never
drifts), a cancel on any rank ends that sequence, and the requests held by every rank join in
request order while `max_batch` and the KV budget allow. Every decision is a pure function of
what all ranks agreed (node/scheduler.py), so every node runs the same sequences in the same
order at every step. Alone (one node) there is nothing to agree and no round trip at all.

A lone decoding sequence keeps its own KV cache (the stock path's bytes), two or more share
mlx-lm's batched caches (node/lanes.py); speculative steps verify guesses (node/speculate.py).

Over 700 lines, on purpose: what is left here is one state machine, `RunningBatch`, whose phases
(admit, prefill, decode or verify, settle, finish) read and write the same per-sequence state in
one order; each idea they call (the plan, the vote, lanes, sampling, speculation, streams, the
two micro-batches) already lives in its own module above. Cut further, the phases would pass
that state between files rather than read as one step.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Callable, Protocol

import mlx.core as mx

from ..proto.errors import MoeClusterError, UserError
from ..proto.records import GenerateRequest
from . import sampling
from .agreement import Agreed, Layout
from .collective.base import RIDE_MAX_TOKEN, agree, waiting
from .figures import SequenceFigures, StepReport, Tally
from .kv import kv_bytes_per_token, kv_reserve
from .lanes import Lane, shortest
from .moe.telemetry import StepTimes
from .scheduler import admissions, emit, prefill_passes
from .speculate import COOL_STEPS, speculation

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BatchLimits:
    max_batch: int = 8  # sequences running at once
    prefill_budget: int = 512  # prompt tokens prefilled per step while other sequences decode
    kv_budget_bytes: int = 0  # KV of running sequences plus the prompt cache; 0: no limit
    speculative: str = "off"  # node.speculate.MODES (the cluster's default: auto)
    draft_tokens: int = 4  # drafts a step verifies per sequence at most, where speculation is on
    draft_model: str = ""  # speculative "draft": the draft checkpoint (read on rank 0 only)
    overlap: bool = False  # two micro-batches per decode step (node/overlap.py)
    # replicated: every node attends for every stream; by-stream: each stream's owner alone (the
    # request's `owner`); auto: as the request says (the coordinator chooses per stream)
    attention: str = "replicated"
    mtp_experts: str = "auto"  # speculative "mtp": its routed experts at N > 1 (node/mtp.py)


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
    cache: list | None = None  # its own KV cache until it joins a lane's
    todo: list[int] = field(default_factory=list)  # prompt tokens to prefill (all but the last)
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
    allowance: int = 0  # drafts this step may verify (speculate.adapt), from agreed steps only
    cool: int = 0  # steps left without drafts after its guesses kept failing
    rest: int = 0  # the steps it rests after its next failed probe (speculate.adapt)
    tried: int = 0  # guesses its latest step verified (0: a plain step)
    judged: int = 0  # guesses of the step whose tokens this step agrees on
    pending: list[int] = field(default_factory=list)  # emitted last step; the last: next input
    pending_logits: list = field(default_factory=list)  # their rows (record_logits)
    # attention by stream: the rank that alone attends for it and holds its KV (-1: every rank)
    owner: int = -1
    local: bool = True  # this rank attends for it (its owner, or every rank)

    @property
    def figures(self) -> SequenceFigures:
        return self.result.figures


class RunningBatch:
    """The node's continuous batch (see the module docstring). `submit` and `cancel` are thread-safe;
    `step` runs on the one thread that drives MLX.

    Args:
        sharded: the loaded model (node/moe/load.py ShardedModel): its model, collective, MoE
            layers and state.
        check: refuses (UserError) a request this model cannot run, before any MLX work.
        prompt_cache: node/prompt_cache.py's, or None.
        vocab: the embedding's rows (token ids are below it).
    """

    def __init__(
        self,
        sharded,
        limits: BatchLimits = BatchLimits(),
        *,
        check: Callable[[GenerateRequest], None] = lambda req: None,
        prompt_cache=None,
        vocab: int = 0,
    ):
        from mlx_lm.models.cache import make_prompt_cache

        self.model = sharded.model
        self.collective = sharded.collective
        self._state = sharded.state  # its timers: the step's, taken at the end of each step
        self._check = check
        self.prompt_cache = prompt_cache
        mergeable = all(hasattr(type(c), "merge") for c in make_prompt_cache(self.model))
        if not mergeable and limits.max_batch > 1:
            logger.info("this family's caches cannot be batched: one sequence at a time")
            limits = dataclasses.replace(limits, max_batch=1)
        if self.collective.world_size > 1 and vocab >= RIDE_MAX_TOKEN - 1:
            raise UserError(
                f"a vocabulary of {vocab} tokens is past what a step's agreement carries "
                f"({RIDE_MAX_TOKEN - 2})"
            )
        self.limits = limits
        self.kv_per_token = kv_bytes_per_token(self.model)
        self.draft_max, self.speculation_off, self._speculator = speculation(
            limits, self.collective, make_prompt_cache(self.model), vocab, sharded
        )
        # tokens a decoding sequence's vote carries: what it emitted last step, as wide as that
        # step (one token after a plain step: the vote then weighs what it weighs without drafts)
        self.slots = 1
        self.overlap_off = None  # why a node asked to overlap micro-batches cannot, for its status
        self._interleave = None  # node/overlap.py, where the collective is not a graph operation
        lanes = 1
        if limits.overlap:
            self.overlap_off = _why_no_overlap(self.collective, self.draft_max, limits)
            if self.overlap_off:
                logger.warning("two micro-batches per step are off: %s", self.overlap_off)
            else:
                lanes = 2
                if not self.collective.caps.in_graph:
                    from .moe.load import set_combine
                    from .overlap import Interleave

                    self._interleave = Interleave(self.collective, self._state.timers)
                    set_combine(sharded, self._interleave)  # every MoE layer's, once
        self.rank, self._world = self.collective.rank, self.collective.world_size
        self._streams = None  # node/streams.py: where a stream may have one owner
        if limits.attention != "replicated" and self._world > 1:
            if limits.speculative in ("draft", "mtp") and self.draft_max:
                raise UserError(
                    f"speculative: {limits.speculative} drafts are read from the first node for "
                    f"every stream; it cannot run with attention: {limits.attention} "
                    "(prompt-lookup can, or attention: replicated)"
                )
            from .streams import StreamPasses

            assert lanes == 1, "two micro-batches are off with attention by stream"
            self._streams = StreamPasses(sharded, limits.attention)
        self._lock = threading.Lock()
        self._queued: dict[int, Sequence] = {}
        self._active: list[Sequence] = []  # admission order
        self._decoding: list[Sequence] = []  # joined the decode batch, in order (every rank's)
        self._lanes = [Lane() for _ in range(lanes)]  # the rows this rank attends for
        # by stream: the replicated streams' rows (auto's), a lane of their own, the same on every
        # rank: their attention then runs in the same batch everywhere, so its bytes agree
        self._shared = Lane()
        self._steps = 0
        self._auto_seq = 0
        self._shapes: dict[tuple[int, int], int] = {}  # steps run per shape (_shape)
        self._recent_cancels: dict[str, None] = {}  # request ids cancelled before they arrived
        self._tally = Tally()

    # -- from other threads --------------------------------------------------------------------

    def submit(self, req: GenerateRequest, seq: int | None, sink: Sink, result) -> Sequence:
        """`req` joins the queue as admission number `seq` (None: the request's own, else the
        next of this batch's). Refused first (UserError, `check`), before any MLX work: every node
        refuses the same request, and an id past the embedding would end the process."""
        self._check(req)
        seq = seq or req.seq or self.next_seq()
        owner = req.owner if self._streams is not None else -1
        if not -1 <= owner < self._world:
            raise UserError(
                f"request {req.request_id}: owner {owner} is not a rank (world size {self._world})"
            )
        s = Sequence(
            req,
            seq,
            sink,
            result,
            reserve=kv_reserve(req, self.kv_per_token, self.draft_max),
            owner=owner,
        )
        s.local = owner < 0 or owner == self.rank
        with self._lock:
            if req.request_id in self._recent_cancels:
                s.cancel = True
            self._queued[seq] = s
        return s

    def next_seq(self) -> int:
        """The admission number of a request that came without one (run from this process alone,
        as simulate does: every node numbers the same requests the same way)."""
        with self._lock:
            self._auto_seq += 1
            return self._auto_seq

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
            held = self._speculator.mtp_experts
            return f"{self.limits.speculative}, {self.draft_max} drafts" + (
                f", MTP experts {held}" if held else ""
            )
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
    def epoch_id(self) -> str:
        """The running epoch's id (from idle to idle): what an abort names (Collective.abort)."""
        return self.collective.epoch_id

    @property
    def _rows(self) -> list[Sequence]:
        """The decoding sequences this rank attends for, in the order of its passes' rows: the
        replicated lane's (by stream), then lane after lane."""
        return [s for lane in (self._shared, *self._lanes) for s in lane.rows]

    def streams(self) -> tuple[int, int]:
        """(sequences this node attends for, KV bytes reserved for them): what `status` shows."""
        with self._lock:
            mine = [s for s in self._active if s.local]
        return len(mine), sum(s.reserve for s in mine)

    # -- the step ------------------------------------------------------------------------------

    def step(self) -> StepReport:
        """One step of every running sequence, and what it did. A sequence's own failure (its
        sampler, a token the ranks sampled differently) ends that sequence alone; any other error
        fails every sequence (the report lists them as failed)."""
        t0 = time.perf_counter()
        self._tally = Tally()
        times = None
        try:
            times = self._step()
        except BaseException as exc:  # noqa: BLE001 - every sequence gets it, the driver goes on
            with self._lock:
                ids = [s.req.request_id for s in [*self._active, *self._queued.values()]]
            self.fail_all(exc)
            self._tally.finished.extend((rid, "failed") for rid in ids)
            if not isinstance(exc, MoeClusterError):
                raise
        finally:
            if times is None:  # a failed step waited for nothing it can count
                self._state.timers.take()
        return self._tally.report(self._steps, times or StepTimes(), time.perf_counter() - t0)

    def fail_all(self, exc: BaseException) -> None:
        with self._lock:
            everyone = [*self._active, *self._queued.values()]
            self._active = []
            self._decoding = []
            self._lanes = [Lane() for _ in self._lanes]
            self._shared = Lane()
            self._queued.clear()
        for s in everyone:
            s.sink.failed(exc)

    def _step(self):
        c = self.collective
        alone = c.world_size == 1
        self._state.step_begins()
        if not self._active:  # from idle: a new epoch, the same on every node
            c.begin_epoch()
        queue = self.limits.max_batch * (self._world if self._streams is not None else 1)
        with self._lock:
            held = sorted(self._queued)[:queue]
            active = list(self._active)
            cancels = [s.cancel for s in active]
        decoding = list(self._decoding)
        width = self._guessing(decoding)
        guessing = width > 1
        # what this step agrees on: each decoding sequence's tokens of last step (lazy: sampled,
        # not read) or, after a verifying step, those it emitted (read on the host already); a
        # stream another rank owns has none here
        previous = [
            None if not s.local else list(s.pending) if s.pending else s.token for s in decoding
        ]
        # the MTP layer's guesses, made on every rank, ride this step's vote (speculate.py)
        riding = self._speculator.riding(decoding) if guessing and not alone else None
        guesses = self.draft_max if riding is not None else 0
        layout = Layout(queue, len(active), len(decoding), self.slots, guesses)
        self.slots = width  # what the next step's vote carries per sequence
        vote = None if alone else layout.encode(held, cancels, previous, riding)
        if vote is not None:
            c.ride(vote)
        settled: list[Agreed] = []

        def settle() -> Agreed:
            """What every rank voted: the ride came back with the step's first MoE all-reduce
            (else one round trip); read once, by a verifying step before it accepts guesses."""
            if not settled:
                settled.append(
                    layout.read(
                        c.settle() or agree(c, vote),
                        [s.req.request_id for s in decoding],
                        [len(s.fed) for s in decoding],
                        [s.owner for s in decoding],
                    )
                )
            return settled[0]

        # mx.distributed cannot time out: the whole step is watched (MLX may block in async_eval
        # too). The first two steps of a shape may build kernels, and the second waits for the
        # first's graph: on a fresh GPU host the first decode steps of a 94-layer model build
        # theirs for longer than a stall's bound
        joining = [s for s in active if s.state == "prefill"]
        shape = self._shape(joining, decoding, width)
        cold = self._shapes.get(shape, 0) < 2
        with waiting(c, f"batch step {self._steps}", cold), mx.stream(_generation_stream()):
            self._prefill(joining, bool(decoding))
            logits_before = [s.pending_logits if s.pending else [s.prev_logits] for s in decoding]
            if guessing:
                self._verify(decoding, width, settle if riding is not None else None)
            else:
                sampled = self._decode(decoding)
                if sampled is not None:
                    mx.async_eval(sampled)
            agreed = Agreed.alone(held, cancels, previous) if alone else settle()

        for i, exc in agreed.mismatches.items():
            decoding[i].error = exc
        self._steps += 1
        self._shapes[shape] = self._shapes.get(shape, 0) + 1
        times = self._state.timers.take()
        self._state.record_step(times)
        for s in active:
            s.figures.collective_s += times.collective
        self._settle(decoding, agreed.tokens, logits_before)
        for s in decoding:  # a sequence that failed alone leaves alone; the others go on
            if s.error is not None and s in self._active:
                self._finish(s, "failed")
        for s, flag in zip(active, agreed.cancel):
            if flag and s in self._active:
                self._finish(s, "cancelled")
        self._admit(list(agreed.admit))
        return times

    # -- prefill and decode --------------------------------------------------------------------

    def _prefill(self, joining: list[Sequence], others_decode: bool) -> None:
        """The step's prompt chunks (scheduler.prefill_passes), each into its sequence's cache:
        a replicated stream's on every rank, an owned one's on its owner, where the other ranks'
        experts take part in an idle pass."""
        passes = prefill_passes(
            [(s.owner, len(s.todo), self._chunk(s)) for s in joining],
            self.limits.prefill_budget,
            others_decode,
        )
        for chunks in passes:
            at = next((k for k, (i, _) in enumerate(chunks) if joining[i].local), None)
            if self._streams is not None:
                owners = [joining[i].owner for i, _ in chunks]
                if owners == [-1]:  # a replicated stream's chunk, alone in its pass
                    self._streams.replicated()
                else:
                    self._streams.prefill(owners, [n for _, n in chunks])
            if at is None:
                self._streams.idle()
            else:
                (i, n) = chunks[at]
                s = joining[i]
                spec = self._speculator
                if getattr(spec, "mtp", None) is not None and s.seq not in spec.stale:
                    spec.prefill(self.model, s, n)  # the MTP layer reads prompts too
                else:
                    self.model(mx.array(s.todo[:n], dtype=mx.uint32)[None], cache=s.cache)
                mx.eval([x.state for x in s.cache])
            for i, n in chunks:  # every rank follows every stream's prompt
                s = joining[i]
                s.todo = s.todo[n:]
                self._tally.prefilled += n
                if not s.todo:
                    s.state = "decode"  # its last prompt token goes in with the next decode step

    def _shape(
        self, joining: list[Sequence], decoding: list[Sequence], width: int
    ) -> tuple[int, int]:
        """What decides the kernels a step builds: its first prefill chunk's length (rounded up to a
        power of two; 0: none) and the positions it decodes."""
        first = min(self._chunk(joining[0]), len(joining[0].todo)) if joining else 0
        return (1 << (first - 1).bit_length() if first else 0, len(decoding) * width)

    def _chunk(self, s: Sequence) -> int:
        return max(1, min(s.req.prefill_step, self.limits.prefill_budget))

    def _decode(self, decoding: list[Sequence]) -> mx.array | None:
        if not decoding:
            return None
        for s in decoding:
            s.figures.steps += 1

        def inputs(rows: list[Sequence]) -> mx.array:
            return mx.concatenate(
                [
                    mx.array([s.pending[-1]], mx.uint32)  # after a verifying step
                    if s.pending
                    else s.token.reshape(-1)[:1].astype(mx.uint32)
                    if s.token is not None
                    else mx.array([s.first_input], mx.uint32)
                    for s in rows
                ]
            )[:, None]

        self._tally.decoded = self._tally.positions = len(decoding)
        lanes = [lane for lane in self._lanes if lane.rows]
        # `auto` drawing on the MTP layer feeds it at a plain step while the batch is narrow
        # enough to guess again (Speculator.plain); a wider batch leaves it behind (`missed`)
        spec = self._speculator
        feeding = spec is not None and spec.auto_mtp and self._streams is None
        if feeding and not self._each_guesses(len(decoding)):
            spec.missed(decoding)
            feeding = False
        if self._streams is not None:
            outs = self._stream_passes(
                decoding, 1, lambda lane: lane.forward(self.model, inputs(lane.rows))[:, -1, :]
            )
            if not outs:
                return None  # this rank attends for none of them: its experts served the others
            logits = mx.concatenate(outs) if len(outs) > 1 else outs[0]
        elif len(lanes) == 1 and feeding:  # the MTP layer reads this step too
            logits = spec.plain(lanes[0], self.model, inputs(lanes[0].rows))
        elif len(lanes) == 1:
            logits = lanes[0].forward(self.model, inputs(lanes[0].rows))[:, -1, :]
        else:
            logits = mx.concatenate([x[:, -1, :] for x in self._micro_batches(lanes, inputs)])
        rows = self._rows
        sampled = sampling.sample_tokens(rows, logits)
        for i, s in enumerate(rows):
            s.token = sampled[i : i + 1] if len(rows) > 1 else sampled
            s.pending, s.pending_logits = [], []
            if s.req.record_logits:
                s.logits = logits[i]
        if feeding:
            spec.fed(rows, sampled)
        return sampled

    def _guessing(self, decoding: list[Sequence]) -> int:
        """This step's positions per row: > 1 where it verifies guesses, as a sequence may guess
        (an allowance, from agreed steps) and every row's caches can drop what a step that wide
        rejects (speculate.room); 1 where it runs as without speculation, its graph built before
        the last step's tokens are read. A verifying step reads its rows' last tokens first (one
        synchronous step). With `auto` drawing on the MTP layer, the step is only as wide as the
        longest guess a row has (Speculator.candidates: their lengths follow from agreed state)."""
        from .speculate import room

        width = self._width(decoding)
        lanes = [lane for lane in (self._shared, *self._lanes) if lane.rows]
        ok = width > 1 and all(room(lane.cache, width) for lane in lanes)
        for s in decoding:
            if ok and s.local and s.token is not None:  # sampled by a plain step, not read yet
                s.pending = [int(s.token.reshape(-1)[0].item())]
                s.pending_logits = [s.logits] if s.req.record_logits else []
                s.token = None
        tried = [min(s.allowance, width - 1) if ok else 0 for s in decoding]
        if ok and self._speculator is not None and self._speculator.auto_mtp:
            (lane,) = self._lanes  # speculation keeps one lane; auto is off by stream
            found = self._speculator.candidates(lane, decoding)
            tried = [min(t, len(g)) for t, g in zip(tried, found)]
            width = 1 + max(tried, default=0)
        for s, t in zip(decoding, tried):
            s.judged, s.tried = s.tried, t
        return width if ok else 1

    def _width(self, decoding: list[Sequence]) -> int:
        """Positions per row of a verifying step: 1 + the widest allowance. With `auto`, the
        batch's rows share `draft_tokens` guesses a step: every verified position costs compute,
        and the step's all-reduces, the cost guesses save, are already shared by its rows (at
        8 streams and 4 drafts a step guesses nothing)."""
        widest = max((s.allowance for s in decoding), default=0)
        if self.limits.speculative == "auto":
            widest = min(widest, self._each_guesses(len(decoding)))
        return 1 + widest

    def _each_guesses(self, rows: int) -> int:
        """`auto`'s guesses a step for each of `rows` sequences, `draft_tokens` shared out
        (`_width`): 0 where the batch is wider than that."""
        return self.draft_max // max(1, rows)

    def _verify(
        self, decoding: list[Sequence], width: int, settle: Callable[[], Agreed] | None
    ) -> None:
        """A speculative step (Speculator.step) over this rank's rows, every row `width` positions
        wide (`_guessing`: from what the ranks agreed). `settle`: where guesses ride the step's
        vote, what the ranks voted."""
        self._tally.decoded, self._tally.positions = len(decoding), len(decoding) * width

        def verify(lane: Lane) -> None:
            self._speculator.step(lane, self.model, width, self._tally, settle)

        if self._streams is not None:
            self._stream_passes(decoding, width, verify)
        else:
            (lane,) = self._lanes  # speculation keeps one lane (_why_no_overlap)
            verify(lane)
        for s in decoding:
            if not s.local:
                s.figures.steps += 1

    def _stream_passes(self, decoding: list[Sequence], width: int, run) -> list:
        """Attention by stream's decode passes, `run(lane)` each: the replicated streams' (every
        rank's alike, an all-reduce), then the owned streams' (every rank's own rows gathered,
        an idle pass where this rank owns none). -> what `run` gave, in `_rows`' order."""
        out = []
        if self._shared.rows:
            self._streams.replicated()
            out.append(run(self._shared))
        if any(s.owner >= 0 for s in decoding):
            (lane,) = self._lanes  # two micro-batches are off by stream
            if self._streams.decode(decoding, width):
                out.append(run(lane))
            else:
                self._streams.idle()
        return out

    def _micro_batches(self, lanes: list[Lane], inputs) -> list[mx.array]:
        """One forward pass per lane, overlapped (node/overlap.py): each lane's all-reduce of a
        MoE layer is in flight while the other lane computes."""
        calls = [lambda lane=lane: lane.forward(self.model, inputs(lane.rows)) for lane in lanes]
        if self._interleave is None:  # graph collectives: one lazy graph holds both passes
            return [call() for call in calls]
        return self._interleave.run(calls)

    # -- after the step ------------------------------------------------------------------------

    def _settle(self, decoding: list[Sequence], agreed: tuple, rows: list[list]) -> None:
        """Hand out the agreed tokens (`rows`: the logits each was taken from, where recorded);
        sequences that end leave the batch."""
        import numpy as np

        from .speculate import adapt

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
            # the agreed tokens say how many of its guesses held: the next allowance (not with
            # `mtp`, asked for: a model's own MTP layer guesses as well on any text)
            if s.drafts and self._speculator.mode != "mtp":
                s.allowance, s.cool, s.rest = adapt(
                    s.allowance, s.cool, s.judged, len(tokens) - 1, s.drafts, s.rest
                )
            e = emit(
                tokens,
                eos=frozenset(s.req.eos_token_ids),
                stops=s.req.stop_sequences,
                handed=r.tokens,
                max_tokens=s.req.sampling.max_tokens,
            )
            s.fed.extend(tokens[: e.fed])
            if s.req.record_logits and s.local:
                r.logits.extend(
                    np.array(row.astype(mx.float32)).reshape(-1) for row in logits[: e.fed]
                )
            stats.generated += len(e.out)
            stats.tokens.extend(e.out)
            r.tokens.extend(e.out)
            if e.out:
                s.sink.tokens(list(e.out))
                self._tally.handed_out += len(e.out)
            if e.finish:
                stats.finish_reason = e.finish
                self._finish(s, e.finish)
        for s in decoding:
            s.prev_logits = s.logits

    def _finish(self, s: Sequence, reason: str) -> None:
        if self._speculator is not None:
            self._speculator.drop(s.seq)
        s.result.stats.finish_reason = reason
        s.result.cancelled = reason == "cancelled"
        self._tally.finished.append((s.req.request_id, reason))
        for lane in (self._shared, *self._lanes):
            if s in lane.rows:
                s.cache = lane.leave(s)
        if s in self._decoding:
            self._decoding.remove(s)
        with self._lock:
            self._active.remove(s)
            idle = not self._active and not self._queued
        if idle:  # the counters its caller reads are complete (this waits for the step in flight)
            self._state.settle()
        if self.prompt_cache is not None and s.cache is not None and reason != "failed":
            self.prompt_cache.store(list(s.req.prompt) + s.fed, s.cache)
        s.cache = None
        s.result.stats.prompt_tokens = len(s.req.prompt)
        if reason == "failed":
            s.sink.failed(s.error)
        else:
            s.sink.done(s.result)

    def _admit(self, common: list[int]) -> None:
        """The requests every rank holds join (scheduler.admissions), each set up to prefill."""
        from mlx_lm.models.cache import make_prompt_cache

        # prefilled sequences join the decode batch first (their caches merge into a lane's)
        for s in list(self._active):
            if s.state == "decode" and s not in self._decoding:
                self._join(s)
        budget = self.limits.kv_budget_bytes
        with self._lock:  # every rank held them when they rode, and queued ones stay queued
            queued = {n: self._queued[n] for n in common}
            joining = admissions(
                common,
                {n: q.reserve for n, q in queued.items()},
                [(s.owner, s.reserve) for s in self._active],
                self.limits.max_batch,
                budget,
                owner={n: q.owner for n, q in queued.items()},
                world=self._world,
            )
            held = sum(s.reserve for s in self._active if s.local)  # KV this rank holds
            arrivals = [self._queued.pop(n) for n in joining]
            self._active.extend(arrivals)
        pc = self.prompt_cache
        for s, (cache, covered) in zip(arrivals, self._prefixes(arrivals)):
            s.t_start = time.perf_counter()
            self._tally.admitted.append(s.req.request_id)
            s.result.cached_tokens = covered
            if s.local:
                s.cache = cache if cache is not None else make_prompt_cache(self.model)
            if self._speculator is not None and self._speculator.auto_mtp:
                self._speculator.admit(s, covered, wide=not self._each_guesses(len(self._active)))
            wanted = s.req.draft_tokens
            s.drafts = self.draft_max if wanted is None else min(wanted, self.draft_max)
            s.allowance, s.rest = s.drafts, COOL_STEPS
            prompt = list(s.req.prompt)
            s.todo = prompt[covered:-1]
            s.first_input = prompt[-1]
            s.state = "prefill" if s.todo else "decode"
            if not s.req.sampling.greedy:
                seed = s.req.sampling.seed
                key = mx.random.key(
                    seed if seed is not None else zlib.crc32(s.req.request_id.encode())
                )
                s.key = sampling.advance_key(key, s.req.sampling.step)  # resumed: past its draws
            if s.local:
                if budget and pc is not None:
                    pc.make_room(budget - held - s.reserve)
                held += s.reserve
            if s.state == "decode":
                self._join(s)

    def _join(self, s: Sequence) -> None:
        """`s` (prefilled) joins the decode batch; its rows a lane's, where this rank attends."""
        self._decoding.append(s)
        if self._streams is not None and s.owner < 0:
            self._shared.join(s)
        elif s.local:
            shortest(self._lanes).join(s)

    def _prefixes(self, arrivals: list[Sequence]) -> list[tuple[list | None, int]]:
        """(prompt cache entry to continue from, prompt tokens it covers) per arrival. A replicated
        stream's is agreed by every rank (PromptCache.reuse); an owned one's is its owner's
        alone, whose covered count every rank then reads in one explicit agreement (the others
        must know how much of its prompt is left to prefill)."""
        pc = self.prompt_cache
        out = []
        for s in arrivals:
            if pc is None or not s.local:
                out.append((None, 0))
            else:
                out.append(pc.reuse(list(s.req.prompt), agreed=s.owner < 0))
        owned = [i for i, s in enumerate(arrivals) if s.owner >= 0]
        if owned and self._world > 1 and pc is not None:
            votes = [out[i][1] if arrivals[i].local else 0 for i in owned]
            with waiting(self.collective, "the owners' prompt cache hits"):
                rows = agree(self.collective, votes).values
            for k, i in enumerate(owned):
                out[i] = (out[i][0], rows[arrivals[i].owner][k])
        return out


def _why_no_overlap(collective, draft_max: int, limits: BatchLimits) -> str | None:
    """Why a node cannot run two micro-batches per step, or None where it can."""
    if collective.world_size == 1:
        return "one node has no all-reduce to hide"
    if draft_max:
        return "speculative decoding verifies the batch in one pass"
    if limits.max_batch < 2:
        return "max_batch is 1"
    if limits.attention != "replicated":
        return f"attention {limits.attention} gathers every node's rows in one pass"
    return None


def _generation_stream():
    """mlx-lm's own stream for generation: the step runs where stock generate_step runs it (on the
    default stream it measured 0.73x stock at one sequence on this CPU)."""
    from mlx_lm.generate import generation_stream

    return generation_stream

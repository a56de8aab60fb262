"""Speculative decoding in the running batch: one step verifies a sequence's drafted tokens and the
token after them in one forward pass, so one all-reduce per MoE layer carries several positions.

Drafts come from prompt lookup (the tokens that followed the latest earlier occurrence of the
sequence's last n-gram, in its prompt or its output; no second model). Every rank drafts from the
same agreed history, so every rank feeds the same positions.

Verification keeps the model's output exactly: at each verified position the model's own token is
taken (its argmax, or a draw from its distribution with the sequence's key, split once per emitted
token as without speculation), and a draft is accepted while it equals that token. The emitted
tokens are then the tokens decoding one at a time would emit, in value for greedy and in
distribution (with the same keys: in value) for sampling; only rounding differs, a forward pass
over several positions summing in another order than one over a single position.

Rejected positions leave the KV cache before the next step (`rollback`): a lone sequence's cache is
trimmed; in a batch's left-padded cache each row's own rejected tail is rolled into its padding.
A rotating or chunked window rolls back while the dropped positions are still in it (`room`,
per step); a recurrent state cannot, and keeps speculation off.

With `mtp` the guesses are the model's own MTP layer's (node/mtp.py), fed each step with the
verified positions' hidden states; its cache is the last of each sequence's and rolls back with
the model's. With `auto` on a checkpoint that has one, the layer guesses where the prediction and
prompt lookup have nothing (`Speculator.candidates`), fed at every step while the batch is narrow
enough to guess, plain steps included (`plain`, `fed`). Every rank drafts, and its guesses ride
the step's vote: each rank verifies only the prefix on which every rank's guesses agree
(`Speculator.step`), with no round trip of their own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import numpy as np

from ..proto.records import DRAFT_LIMIT, SPECULATIVE_MODES as MODES  # noqa: F401 - re-exported

MAX_NGRAM = 3  # the longest suffix looked up; longer matches are rarer and the drafts no better
# `auto`'s guesses from the MTP layer a step at most: chained past the layer's depth of one they
# hold less (the demo at N = 2 over the envoy, `mtp`: 71% of 2 held, x2.0 `off`; 48% of 4, x1.5)
MTP_DRAFTS = 2


def lookup(
    history: Sequence[int], k: int, max_ngram: int = MAX_NGRAM, min_ngram: int = 1
) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix n-gram of
    `history` (n from `max_ngram` down to `min_ngram`); [] where no suffix occurred before."""
    if k <= 0 or len(history) < 2:
        return []
    a = np.asarray(history, dtype=np.int64)
    for n in range(min(max_ngram, len(a) - 1), min_ngram - 1, -1):
        found = _occurrences(a[:-1], a[len(a) - n :])
        if found.size:
            start = int(found[-1]) + n
            return a[start : start + k].tolist()
    return []


def predicted(
    prediction: Sequence[int], history: Sequence[int], done: int, k: int, max_ngram: int = MAX_NGRAM
) -> list[int]:
    """Up to `k` drafts from a predicted output (OpenAI's `prediction`) after `done` tokens of
    output: where the history's suffix n-gram occurs in the prediction, the tokens after it, taking
    the occurrence nearest where the output would stand if it followed the prediction; the
    prediction's start before any output. [] where nothing matches."""
    if k <= 0 or not prediction:
        return []
    p = np.asarray(prediction, dtype=np.int64)
    if done == 0:
        return p[:k].tolist()
    a = np.asarray(history, dtype=np.int64)
    for n in range(min(max_ngram, len(a), len(p) - 1), 0, -1):
        found = _occurrences(p[:-1], a[len(a) - n :])
        if found.size:
            latest_first = found[::-1]  # argmin takes the first of equals: the latest occurrence
            start = int(latest_first[np.argmin(np.abs(latest_first + n - done))])
            return p[start + n : start + n + k].tolist()
    return []


def _occurrences(a: np.ndarray, gram: np.ndarray) -> np.ndarray:
    """Every start of `gram` in `a` (the callers pass a sequence less its last token, so that a
    token always follows a match)."""
    n = len(gram)
    starts = len(a) - n + 1
    if starts <= 0:
        return np.zeros(0, dtype=np.int64)
    hit = np.ones(starts, dtype=bool)
    for j in range(n):
        hit &= a[j : j + starts] == gram[j]
    return np.flatnonzero(hit)


def _leaves(caches):
    """Every layer's caches, a CacheList's (two attentions in one layer) one by one."""
    from mlx_lm.models.cache import CacheList

    for c in caches:
        yield from _leaves(c.caches) if type(c) is CacheList else (c,)


# caches whose last positions can be dropped: plain KV (which mlx-lm's batched cache merges into),
# and the windowed ones while the dropped positions are still in their window (`room`)
_ROLLS_BACK = {
    "KVCache",
    "BatchKVCache",
    "RotatingKVCache",
    "BatchRotatingKVCache",
    "ChunkedKVCache",
}
# why the others cannot, one line each
_WHY_NOT = {
    "ArraysCache": "a recurrent state is one state, not one per verified position (mlx-lm's "
    "linear-attention and SSM kernels return only the last)",
}


def can_roll_back(cache: list) -> str | None:
    """None where every layer's cache can drop a rejected tail; else why not, naming the cache
    types."""
    others = sorted({type(c).__name__ for c in _leaves(cache)} - _ROLLS_BACK)
    if others:
        why = "; ".join(_WHY_NOT[n] for n in others if n in _WHY_NOT)
        return f"its caches ({', '.join(others)}) cannot drop rejected drafts" + (
            f": {why}" if why else ""
        )
    return None


def room(cache: list, width: int) -> bool:
    """Whether a step `width` positions wide can be rolled back in every layer's cache: a rotating
    window always, for a step no wider than it (`_drop_tail`); a chunked one while the step stays
    in its current chunk. It depends on the step and the chunks' fill only, which every rank of a
    replicated sequence holds alike, so every rank answers alike."""
    for c in _leaves(cache):
        name = type(c).__name__
        if name in ("RotatingKVCache", "BatchRotatingKVCache") and width > c.max_size:
            return False
        if name == "ChunkedKVCache" and c.offset + width > c.start_position + c.chunk_size:
            return False
    return True


def rollback(cache: list, drop: Sequence[int]) -> None:
    """Remove the last `drop[i]` positions of row i from every layer's cache (a lone sequence's
    cache, or a batch's batched one)."""
    if not any(drop):
        return
    common = min(drop)
    extra = [d - common for d in drop]
    for c in _leaves(cache):
        if common and type(c).__name__ in ("RotatingKVCache", "BatchRotatingKVCache"):
            _drop_tail(c, common)
        elif common:
            c.trim(common)
        if any(extra):  # left-padded rows: each row's rejected tail rolls round into its padding
            # the rotating batch cache rolls each row by (its offset - length): length = -extra
            c.prepare(right_padding=extra, lengths=[-e for e in extra])
            c.finalize()


def _drop_tail(c, n: int) -> None:
    """Drop the last `n` positions of a rotating window just fed several (a verifying step). Its
    multi-position update left its keys in temporal order, the window's `max_size - 1` before the
    step and the step's own (mlx-lm's `_update_concat`), so cutting the tail leaves what feeding
    only the kept positions would have left, past the window's first turn too (mlx-lm's `trim`
    only moves the write position, which is right only before the window first turns)."""
    kept = c.keys.shape[2] - n
    c.keys, c.values = c.keys[..., :kept, :], c.values[..., :kept, :]
    c._idx = kept
    if type(c).__name__ == "RotatingKVCache":
        c.offset -= n
    else:
        c._offset -= n
        c.offset = c.offset - n


def _in_order(cache: list) -> None:
    """Put every batched rotating window that has turned into temporal order before a step of
    several positions. mlx-lm's `BatchRotatingKVCache.make_mask` sizes such a step's mask from
    the window's write position, while its update first puts the window in order and trims it
    from its length: on a turned window the mask then hides each left-padded row's oldest key.
    In order, both read the same length (what its update would have done first anyway)."""
    for c in _leaves(cache):
        if type(c).__name__ == "BatchRotatingKVCache" and c.rotated:
            c._temporal_order()


class Speculator:
    """A running batch's speculative steps (`serving.speculative`): each decoding sequence feeds its
    next input and up to its own allowance of guesses; what the model agrees with is emitted, the
    rest rolled back. Guesses come from the request's `prediction` or prompt lookup, or from a
    draft model on rank 0 (`Drafter`), whose guesses every rank reads from one explicit agreement.
    """

    def __init__(
        self,
        mode: str,
        draft_max: int,
        collective,
        drafter: "Drafter | None",
        mtp=None,
        mtp_experts: str = "",
    ):
        self.mode = mode
        self.draft_max = draft_max
        self.collective = collective
        self.drafter = drafter  # rank 0's, in mode "draft"
        self.mtp = mtp  # every rank's, in mode "mtp" (node/mtp.py Drafter)
        self.next: dict[int, list[int]] = {}  # mode "mtp": seq -> its guesses for its next step
        # mode "mtp": where the MTP layer's routed experts live, "whole" (each node drafts alone)
        # or "sharded" (its feed and each chained draft all-reduce); node/mtp.py holding
        self.mtp_experts = mtp_experts
        # `auto` where the checkpoint has an MTP layer: a row's guesses are the request's
        # prediction's, else prompt lookup's, else the MTP layer's (`candidates`)
        self.auto_mtp = mode == "auto" and mtp is not None
        self.found: dict[int, list[int]] = {}  # auto_mtp: seq -> its guesses this step
        # auto_mtp: seq -> the MTP block's output at its last position fed, the next guesses
        # made from it only for a row that has none from the prompt (`candidates`)
        self.last: dict[int, mx.array] = {}
        self.stale: set[int] = set()  # seqs whose MTP cache missed positions (`missed`)
        self._plain = None  # (lane, hidden states) of the plain step under way (`plain`, `fed`)

    def riding(self, decoding: list) -> list[list[int]] | None:
        """The guesses this rank feeds each decoding sequence at its next verifying step, where
        they ride that step's vote (the MTP layer's, at N > 1); None where they are agreed
        otherwise (`_guessed`) or need no agreement (prompt lookup, from agreed tokens)."""
        if self.mtp is None or self.collective.world_size == 1:
            return None
        return [(self.found if self.auto_mtp else self.next).get(s.seq, []) for s in decoding]

    def step(self, lane, model, width: int, tally, settle=None) -> None:
        """One verifying forward pass of the rows of `lane`, each `width` positions wide
        (node/batch.py `_width`: from the allowances), whatever each sequence found to guess: the
        step's shape then depends only on what the ranks agreed, never on a token not yet
        agreed.

        `settle` (where the MTP layer's guesses ride the step's vote, `riding`): each rank feeds
        its own guesses, and reads back, once the forward pass has carried the vote, the prefix on
        which every rank's guesses agree; only that prefix is verified. A position's output
        depends on the inputs up to it alone (causal attention; each routed expert sees each
        position apart), so up to the last position of that prefix every rank computed what it
        would have computed from agreed guesses, and the rest is never accepted and is rolled
        back. Ranks that round alike (every node of one kind) agree on every guess."""
        from . import sampling

        decoding = lane.rows
        histories = [[*s.req.prompt, *s.fed, *s.pending] for s in decoding]
        # no guess past max_tokens: the step's own token is the last one a sequence may still need
        wanted = [
            min(
                s.allowance,
                width - 1,
                max(0, s.req.sampling.max_tokens - len(h) + len(s.req.prompt) - 1),
            )
            for s, h in zip(decoding, histories)
        ]
        drafts = self._drafts(decoding, histories, wanted)
        rows = []
        for s, mine in zip(decoding, drafts):
            first = s.pending[-1] if s.pending else s.first_input
            rows.append([first, *mine] + [first] * (width - 1 - len(mine)))
        inputs = mx.array(rows, dtype=mx.uint32)
        _in_order(lane.cache)
        if self.mtp is None:
            logits = lane.forward(model, inputs)
        else:  # the hidden states too: the MTP layer drafts from them
            hidden = model.model(inputs, cache=lane.cache)
            logits = self.mtp.head(hidden)
        if settle is not None:  # only what every rank fed is verified
            agreed = settle().guesses
            drafts = [mine[: len(every)] for mine, every in zip(drafts, agreed)]
        chosen, keys = sampling.sample_positions(decoding, logits, drafts)
        if self.mtp is not None:
            # position j of each row pairs its hidden state with the model's token there: the
            # accepted ones are the next inputs, the rest is rolled back with the model's rows
            drafted = self.mtp.feed(chosen.astype(mx.uint32), hidden, lane.cache[-1])
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
            tally.drafted += len(drafts[i])
            tally.accepted += v.accepted
            drop.append(width - len(v.tokens))
            if self.drafter is not None:
                self.drafter.keep(s.seq, len(histories[i]) + v.accepted)
        rollback(lane.cache, drop)
        if self.mtp is not None:  # the next step's guesses, from each row's last accepted position
            at = mx.array([width - 1 - d for d in drop])
            h = drafted[mx.arange(len(decoding)), at]
            if self.auto_mtp:
                self._keep(decoding, h)
            else:
                self._remember(decoding, h, lane.cache[-1])

    def prefill(self, model, s, n: int) -> None:
        """Sequence `s`'s next `n` prompt tokens into its cache, the MTP layer's too (each
        position with the prompt token after it); after its last chunk, its first guesses."""
        last = n >= len(s.todo)
        after = s.todo[1 : n + 1] + ([s.first_input] if last else [])
        hidden = model.model(mx.array(s.todo[:n], dtype=mx.uint32)[None], cache=s.cache)
        drafted = self.mtp.feed(mx.array(after, dtype=mx.uint32)[None], hidden, s.cache[-1])
        if last and self.auto_mtp:
            self._keep([s], drafted[:, -1])
        elif last and self.draft_max:
            self._remember([s], drafted[:, -1], s.cache[-1])

    def _keep(self, rows: list, h: mx.array) -> None:
        """auto_mtp: the MTP block's outputs `h` (B, hidden) at each row's last position fed,
        computed with the step (its feed fills the MTP cache); guesses follow where wanted."""
        mx.async_eval(h)
        for i, s in enumerate(rows):
            self.last[s.seq] = h[i]

    def _remember(self, decoding: list, h: mx.array, cache) -> None:
        """Each sequence's next guesses, from block outputs `h` (B, hidden) of the rows of
        `cache`."""
        for s, row in zip(decoding, self._chain(h, cache)):
            self.next[s.seq] = row

    def _chain(self, h: mx.array, cache) -> list[list[int]]:
        """Per row of `cache`, the MTP layer's guesses (`draft_max`; MTP_DRAFTS with `auto`)
        from block outputs `h` (B, hidden)."""
        k = min(self.draft_max, MTP_DRAFTS) if self.auto_mtp else self.draft_max
        chain = self.mtp.chain(self.mtp.guess(h), h, k, cache)
        return np.array(mx.stack(chain, axis=1)).tolist()

    @staticmethod
    def _from_prompt(s, history: list[int], k: int, min_ngram: int = 1) -> list[int]:
        """Up to `k` guesses from the request's prediction, else prompt lookup."""
        done = len(history) - len(s.req.prompt)
        return predicted(s.req.prediction, history, done, k) or lookup(
            history, k, min_ngram=min_ngram
        )

    def candidates(self, lane, decoding: list) -> list[list[int]]:
        """`auto` drawing on the MTP layer: each decoding row's guesses this step (its last token
        read): the request's prediction's, else prompt lookup's from a suffix of 2 tokens or more
        (a lone token's match guesses worse than the model's own layer), else the MTP layer's
        where its cache missed no position. Their lengths follow from agreed tokens and state
        alone, so every rank sizes the step alike; the MTP layer's contents ride the vote."""
        self.found = {
            s.seq: self._from_prompt(s, [*s.req.prompt, *s.fed, *s.pending], self.draft_max, 2)
            for s in decoding
        }
        wanted = {
            s.seq
            for s in decoding
            if not self.found[s.seq] and s.seq not in self.stale and s.seq in self.last
        }
        if wanted:  # the MTP layer's guesses, for these rows only
            outs = [self.last.get(s.seq) if s.seq in wanted else None for s in lane.rows]
            like = next(h for h in outs if h is not None)
            # the chain runs over the lane's whole batched cache, trimmed back after it: the
            # other rows feed zeros, and their guesses are not kept
            h = mx.stack([mx.zeros_like(like) if x is None else x for x in outs])
            for s, row in zip(lane.rows, self._chain(h, lane.cache[-1])):
                if s.seq in wanted:
                    self.found[s.seq] = row
        return [self.found[s.seq] for s in decoding]

    def plain(self, lane, model, inputs: mx.array) -> mx.array:
        """A plain step's logits (B, vocab) for `auto` drawing on the MTP layer: the model's hidden
        states are kept for the layer's feed once the step's tokens are sampled (`fed`)."""
        hidden = model.model(inputs, cache=lane.cache)
        self._plain = (lane, hidden)
        return self.mtp.head(hidden)[:, -1, :]

    def fed(self, rows: list, sampled: mx.array) -> None:
        """Feed a plain step's positions (hidden state, the token sampled after it) into the MTP
        cache, lazily with the step; the next guesses follow from it when a row guesses again."""
        lane, hidden = self._plain
        self._plain = None
        tokens = sampled.reshape(-1, 1).astype(mx.uint32)
        self._keep(rows, self.mtp.feed(tokens, hidden, lane.cache[-1])[:, -1])

    def admit(self, s, covered: int, wide: bool) -> None:
        """auto_mtp: a sequence admitted into a batch too wide to guess (it would miss the
        layer's feed at its first step), or whose cached prefix (`covered` tokens) the MTP cache
        does not hold alike, never drafts with the layer, and its prompt is not fed to it."""
        held = getattr(s.cache[-1], "offset", covered) if s.cache else covered
        if wide or held != covered:
            self.missed([s])

    def missed(self, decoding: list) -> None:
        """A plain step in a batch too wide to guess leaves the MTP layer unfed (its feed would
        cost every step of a busy node): these rows' MTP cache misses a position, and their
        guesses come from the prompt or the prediction alone from now on."""
        for s in decoding:
            self.stale.add(s.seq)
            self.last.pop(s.seq, None)

    def _drafts(self, decoding: list, histories: list[list[int]], wanted: list[int]) -> list:
        if self.auto_mtp:  # found before the step was sized (`candidates`)
            return [self.found.get(s.seq, [])[:k] for s, k in zip(decoding, wanted)]
        if self.mode in ("draft", "mtp"):
            return self._guessed(decoding, histories, wanted)
        return [
            self._from_prompt(s, history, k) if k else []
            for s, history, k in zip(decoding, histories, wanted)
        ]

    def _guessed(
        self, decoding: list, histories: list[list[int]], wanted: list[int]
    ) -> list[list[int]]:
        """The draft model's guesses, `wanted[i]` for sequence i at most: rank 0 makes them, and
        every rank reads rank 0's from one explicit agreement (the others put zeros). The MTP
        layer's are every rank's own: they ride the step's vote instead (`step`)."""
        from .collective.base import agree

        if self.mtp is not None:  # every rank drafted
            guesses = [self.next.get(s.seq, [])[:k] for s, k in zip(decoding, wanted)]
            if self.collective.world_size > 1:  # they ride the step's vote (`riding`, `step`)
                return guesses
        else:
            guesses = [
                self.drafter.guess(s.seq, h, k) if self.drafter is not None and k else []
                for s, h, k in zip(decoding, histories, wanted)
            ]
        c = self.collective
        if c.world_size == 1 or not any(wanted):  # `wanted` is agreed: no rank asks the others
            return guesses
        k = self.draft_max
        values = [g + 1 for mine in guesses for g in (mine + [-1] * (k - len(mine)))]
        row = agree(c, values).values[0]
        return [[t - 1 for t in row[i * k : (i + 1) * k] if t > 0] for i in range(len(decoding))]

    def drop(self, seq: int) -> None:
        """Sequence `seq` ended: the draft forgets it."""
        if self.drafter is not None:
            self.drafter.drop(seq)
        self.next.pop(seq, None)
        self.found.pop(seq, None)
        self.last.pop(seq, None)
        self.stale.discard(seq)


def speculation(limits, collective, cache: list, vocab: int, sharded=None):
    """A running batch's speculation (node/batch.py BatchLimits): (drafts a step verifies at most,
    why speculation is off where it was asked for, the Speculator or None). `auto` is quietly off
    where it cannot run (it is the default): a family whose caches cannot roll back, two
    micro-batches per step, attention by stream; an explicit mode there is off with a warning."""
    import logging

    from ..proto.errors import UserError

    draft_max = limits.draft_tokens if limits.speculative != "off" else 0
    if not draft_max:
        return 0, None, None
    why = can_roll_back(cache)
    mode = limits.speculative
    if mode == "auto" and not why:
        if limits.overlap and collective.world_size > 1 and limits.max_batch > 1:
            why = "overlap: true runs two micro-batches per step, and a verifying step is one pass"
        elif limits.attention != "replicated" and collective.world_size > 1:
            why = (
                f"attention: {limits.attention} (a verifying step is as wide as its widest "
                "stream on every node; prompt-lookup turns it on)"
            )
    chunked = {"ChunkedKVCache"} & {type(c).__name__ for c in _leaves(cache)}
    if not why and chunked and limits.attention != "replicated" and collective.world_size > 1:
        # whether a chunk has room is read from its cache, which by stream only the owner holds:
        # the nodes could not agree on a step's width (a rotating window's room is the step's)
        why = "its caches (ChunkedKVCache) are chunked windows, and by stream only a stream's "
        why += "owner knows how full its chunk is"
    if why:
        log = logging.getLogger(__name__)
        (log.info if mode == "auto" else log.warning)("speculative decoding is off: %s", why)
        return 0, why, None
    drafter = None  # speculative "draft": the draft model, on rank 0
    if mode == "draft" and collective.rank == 0:
        if not limits.draft_model:
            raise UserError("speculative: draft needs a draft model (serving.draft_model)")
        drafter = Drafter(limits.draft_model, vocab)
    mtp, held = None, ""
    from . import mtp as mtp_layer

    if mode == "auto" and sharded is not None:
        try:  # `auto` draws on the checkpoint's own MTP layer where it has one
            if mtp_layer.has_mtp(sharded.config, sharded.path):
                mtp = mtp_layer.load(sharded.model, sharded.config, sharded.path)
        except (UserError, OSError) as e:  # quietly (auto is the default); e.g. a shipped shard
            logging.getLogger(__name__).info("speculative: auto without the MTP layer: %s", e)
    elif mode == "mtp":
        mtp = mtp_layer.load(sharded.model, sharded.config, sharded.path)
    if mtp is not None:
        mtp_layer.carry_cache(sharded.model)
        held, how = mtp_layer.shard_experts(
            mtp, sharded, int(sharded.config["num_hidden_layers"]), limits.mtp_experts
        )
        logging.getLogger(__name__).info("speculative: mtp: the MTP layer holds %s", how)
    return draft_max, None, Speculator(mode, draft_max, collective, drafter, mtp, held)


COOL_STEPS = 8  # steps without guesses after they first failed, before one is tried again
MAX_COOL = 64  # the longest rest: each failed probe doubles it up to this


def adapt(
    allowance: int, cool: int, tried: int, accepted: int, limit: int, rest: int = COOL_STEPS
) -> tuple[int, int, int]:
    """(allowance, cool, rest) for a sequence's next step, from the agreed outcome of an earlier
    step that verified `tried` guesses of which `accepted` held (the agreement comes a step late).

    A step verifies 1 + allowance positions however few guesses hold, and a step that guesses reads
    its tokens before the next is built, so guesses that fail cost: the allowance halves when none
    held; at zero the sequence steps as without speculation for `rest` steps, then one guess
    probes again, and each failed probe doubles the rest (up to MAX_COOL). Once one holds, the
    whole allowance (`limit`) is back. Every rank computes it from the same agreed tokens, so
    every rank gives the step the same width."""
    if accepted:
        return limit, 0, COOL_STEPS
    if tried == 0 or allowance == 0:  # nothing learnt, or resting already: the rest runs out
        if allowance:
            return allowance, 0, rest  # a probe is under way: its outcome comes next step
        return (1, 0, rest) if cool <= 1 else (0, cool - 1, rest)
    allowance //= 2
    if allowance == 0:
        return 0, rest, min(2 * rest, MAX_COOL)
    return allowance, 0, rest


@dataclass
class Verified:
    """One sequence's outcome of a verifying step."""

    tokens: list[int]  # the accepted drafts, then the model's own next token
    accepted: int  # drafts accepted (len(tokens) - 1)


def accept(drafts: Sequence[int], model_tokens: Sequence[int]) -> Verified:
    """The longest prefix of `drafts` the model agrees with, then the model's token after it:
    `model_tokens[j]` is the model's token at the position where `drafts[j]` was fed."""
    a = 0
    while a < len(drafts) and drafts[a] == model_tokens[a]:
        a += 1
    return Verified([*drafts[:a], int(model_tokens[a])], a)


class Drafter:
    """A small model with the main model's tokenizer that guesses each sequence's next tokens
    (`serving.speculative: draft`, as mlx-lm's `draft_model`). It runs on rank 0 only, which hands
    its guesses to the others in one round trip per step: a draft replicated on every node would
    need every node to hold it and to draft bit-identically (mixed Macs round differently), while
    one node drafting costs one round trip per step against the MoE layers' one per layer.

    Each sequence has its own draft KV cache, holding a prefix of its history: what the draft has
    not read yet is fed before it guesses, and after each step the cache is cut back to the tokens
    that were accepted."""

    def __init__(self, path: str, vocab: int):
        from mlx_lm.utils import load_model

        from .checkpoint import Checkpoint
        from .vocab import embedding_rows

        from mlx_lm.models.cache import make_prompt_cache

        from ..proto.errors import UserError

        self.model, _ = load_model(Checkpoint.open(path).path)
        why = can_roll_back(make_prompt_cache(self.model))
        if why:
            raise UserError(f"the draft model {path} cannot be a draft: {why}")
        rows = embedding_rows(self.model)
        if rows > vocab:
            raise UserError(
                f"the draft model {path} has {rows} tokens, more than the model's {vocab}: "
                "it must share the model's tokenizer"
            )
        self.caches: dict[
            int, tuple[list, int]
        ] = {}  # seq -> (draft cache, history tokens it holds)

    def guess(self, seq: int, history: Sequence[int], k: int) -> list[int]:
        """Up to `k` greedy guesses after `history` (the draft reads what it has not yet)."""
        from mlx_lm.models.cache import make_prompt_cache

        cache, held = self.caches.get(seq) or (make_prompt_cache(self.model), 0)
        if held >= len(history):  # never: a history only grows; start over rather than guess wrong
            cache, held = make_prompt_cache(self.model), 0
        logits = self.model(mx.array(history[held:], dtype=mx.uint32)[None], cache=cache)[:, -1]
        out = []
        for j in range(k):
            token = int(mx.argmax(logits, axis=-1).item())
            out.append(token)
            if j + 1 < k:
                logits = self.model(mx.array([[token]], dtype=mx.uint32), cache=cache)[:, -1]
        # the cache holds the history and the first k - 1 guesses; keep(…) cuts it back
        self.caches[seq] = (cache, len(history) + max(k - 1, 0))
        return out

    def keep(self, seq: int, history: int) -> None:
        """After a step: the sequence's first `history` tokens stand; the draft keeps at most those."""
        if seq not in self.caches:
            return
        cache, held = self.caches[seq]
        if held > history:
            for c in cache:
                c.trim(held - history)
            held = history
        self.caches[seq] = (cache, held)

    def drop(self, seq: int) -> None:
        self.caches.pop(seq, None)

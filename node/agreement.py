"""What the ranks agree on at every step of the running batch, and its codec.

Every decision of the running batch (who joins, who is cancelled, which tokens are handed out) is
taken from what every rank voted, so every node runs the same sequences in the same order. A
rank's vote is a short vector of small ints with named parts (`Layout`), which rides on the step's
first MoE all-reduce (collective.base.Rider: no round trip of its own) or takes one explicit round
trip where the step runs no MoE layer:

    queue    the admission numbers of the requests this rank holds queued, smallest first (0: none)
    cancel   per running sequence, 1 where it was cancelled on this rank
    tokens   per decoding sequence, the tokens it emitted last step, each + 1 (0: none), `slots` each
    guesses  per decoding sequence, the guesses this rank feeds this step, each + 1 (0: none),
             `guesses` each: the MTP layer's (node/speculate.py), made on every rank and fed
             before they are agreed; what is read back is the prefix on which every rank's agree

Its shape depends only on what was agreed before (the running and decoding sequences, the batch's
limits, whether the step verifies guesses), so every rank lays it out alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from .collective.base import Agreement, TokenMismatch


@dataclass(frozen=True)
class Layout:
    """One step's vote: how many of each part, the same on every rank."""

    queue: int  # queued admission numbers carried (the batch's max_batch)
    active: int  # running sequences: a cancel flag each
    decoding: int  # decoding sequences: `slots` tokens each
    slots: int  # tokens a decoding sequence emits per step at most (1 + its drafts)
    guesses: int = 0  # guesses a decoding sequence feeds this step at most, where they ride

    @property
    def size(self) -> int:
        return self.queue + self.active + self.decoding * (self.slots + self.guesses)

    def encode(
        self, held: list[int], cancels: list[bool], tokens: list, guesses: list | None = None
    ) -> mx.array:
        """This rank's vote as an int32 vector (lazy where a token is: nothing waits on the host).
        `tokens[i]`: decoding sequence i's emitted tokens (a list, or a lazy array whose first
        element is its one token), or None where it has none yet. `guesses[i]`: the guesses
        sequence i feeds this step on this rank, where the layout has room for them."""
        guesses = guesses if guesses is not None else [[]] * self.decoding
        if (
            len(held) > self.queue
            or len(cancels) != self.active
            or len(tokens) != self.decoding
            or len(guesses) != self.decoding
            or any(len(g) > self.guesses for g in guesses)
        ):
            raise ValueError(
                f"a vote of {len(held)} queued, {len(cancels)} cancel flags, {len(tokens)} "
                f"token rows and guesses {[len(g) for g in guesses]} does not fit {self}"
            )
        head = [*held, *[0] * (self.queue - len(held)), *(int(bool(c)) for c in cancels)]
        parts = [mx.array(head, dtype=mx.int32)]
        for t in tokens:
            if t is None:
                parts.append(mx.zeros((self.slots,), mx.int32))
            elif isinstance(t, mx.array):  # sampled last step, not read yet: one token
                lazy = t.reshape(-1)[:1].astype(mx.int32) + 1
                parts.append(lazy if self.slots == 1 else mx.pad(lazy, (0, self.slots - 1)))
            else:
                if len(t) > self.slots:
                    raise ValueError(f"{len(t)} tokens do not fit {self.slots} slots")
                parts.append(mx.array([v + 1 for v in t] + [0] * (self.slots - len(t)), mx.int32))
        if self.guesses:
            rows = [[v + 1 for v in g] + [0] * (self.guesses - len(g)) for g in guesses]
            parts.append(mx.array([v for row in rows for v in row], mx.int32))
        return mx.concatenate(parts) if len(parts) > 1 else parts[0]

    def read(
        self,
        agreement: Agreement,
        names: list[str],
        fed: list[int],
        owners: list[int] | None = None,
    ) -> "Agreed":
        """What every rank voted, read by part. `names[i]`, `fed[i]`: decoding sequence i's request
        id and tokens fed so far (for a mismatch's message): a token that differs between ranks is
        that sequence's failure (TokenMismatch), never a silent fork. `owners[i]`: the rank that
        alone samples sequence i (attention by stream), whose tokens are read; -1 (or no
        `owners`): every rank samples it, and all must agree."""
        rows = agreement.values
        held = sorted(set.intersection(*(set(r[: self.queue]) for r in rows)) - {0})
        base = self.queue
        cancels = tuple(agreement.any_set(base + i) for i in range(self.active))
        base += self.active
        tokens, mismatches = [], {}
        for i in range(self.decoding):
            at = base + i * self.slots
            owner = owners[i] if owners else -1
            try:
                if owner >= 0:
                    row = rows[owner]
                    got = [row[at + j] - 1 for j in range(self.slots)]
                else:
                    got = [
                        agreement.token(at + j, f"request {names[i]}, step {fed[i] + j}", offset=1)
                        for j in range(self.slots)
                    ]
            except TokenMismatch as exc:  # every rank reads the same votes: all drop it alike
                mismatches[i], got = exc, []
            got = tuple(t for t in got if t >= 0)
            tokens.append(got or None)
        base += self.decoding * self.slots
        guesses = []
        for i in range(self.decoding if self.guesses else 0):
            at = base + i * self.guesses
            common = []  # the guesses up to the first slot where some rank's differ, or none is
            for j in range(self.guesses):
                mine = {row[at + j] for row in rows}
                if len(mine) > 1 or 0 in mine:
                    break
                common.append(mine.pop() - 1)
            guesses.append(tuple(common))
        return Agreed(tuple(held), cancels, tuple(tokens), mismatches, tuple(guesses))


@dataclass(frozen=True)
class Agreed:
    """What the ranks agreed at one step."""

    admit: tuple[int, ...]  # admission numbers every rank holds queued, in order
    cancel: tuple[bool, ...]  # per running sequence: cancelled on some rank
    tokens: tuple[tuple[int, ...] | None, ...]  # per decoding sequence (None: none yet)
    mismatches: dict = field(default_factory=dict)  # decoding index -> TokenMismatch
    # per decoding sequence, where guesses ride: the prefix of its guesses every rank fed
    guesses: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def alone(cls, held: list[int], cancels: list[bool], tokens: list) -> "Agreed":
        """One node: its own vote is the agreement (lazy tokens are read here)."""
        read = []
        for t in tokens:
            if t is None:
                read.append(None)
            elif isinstance(t, mx.array):
                read.append((int(t.reshape(-1)[0].item()),))
            else:
                read.append(tuple(t) or None)
        return cls(tuple(held), tuple(bool(c) for c in cancels), tuple(read))

"""What the running batch reports: each step's record (`StepReport`) and each sequence's own
figures, added up from the steps it ran in (never read off node-wide counters while others run)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .moe.telemetry import StepTimes


@dataclass
class SequenceFigures:
    """What one sequence's decoding cost, counted on its own (not the node's running totals)."""

    steps: int = 0  # decode steps it took part in (each: one all-reduce per MoE layer)
    collective_s: float = 0.0  # waiting on all-reduces in the steps it ran in (each waited)
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
    times: StepTimes = StepTimes()  # its MoE layers' phases and all-reduce waits
    seconds: float = 0.0

    @property
    def collective_s(self) -> float:
        """Seconds the step waited on all-reduces."""
        return self.times.collective


@dataclass
class Tally:
    """A step's figures while it runs (a StepReport once it ends)."""

    prefilled: int = 0
    decoded: int = 0
    positions: int = 0
    handed_out: int = 0
    drafted: int = 0
    accepted: int = 0
    admitted: list = field(default_factory=list)
    finished: list = field(default_factory=list)

    def report(self, step: int, times: StepTimes, seconds: float) -> StepReport:
        return StepReport(
            step,
            self.prefilled,
            self.decoded,
            self.positions,
            self.handed_out,
            self.drafted,
            self.accepted,
            tuple(self.admitted),
            tuple(self.finished),
            times,
            seconds,
        )

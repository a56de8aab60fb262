"""Sampling parameters of every endpoint, checked and normalised once into what every node samples with.

Ranges per endpoint (a value outside is a 400 naming the field; NaN and ±inf are outside every range):

| endpoint                                   | temperature | top_p  | seed          |
|--------------------------------------------|-------------|--------|---------------|
| /v1/completions, /v1/chat/completions      | [0, 2]      | (0, 1] | [0, 2**64-1]  |
| /v1/messages                               | [0, 1]      | (0, 1] | [0, 2**64-1]  |

Inside a range, the numeric edges mean greedy decoding: a temperature below
`proto.records.GREEDY_TEMPERATURE` (1/T overflows float32 near 1e-39 and every token becomes equally
likely) and a top_p below `proto.records.GREEDY_TOP_P` (it keeps the most likely token alone; under
~1e-45 it is 0.0 in float32, where the top-p filter reads past the vocabulary). Such requests reach
the nodes as temperature 0, top_p 1: the nodes never see an edge value from the API.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...proto.records import SEED_MAX, Sampling
from .tools import FieldError, show


@dataclass(frozen=True)
class Range:
    lo: float
    hi: float
    lo_open: bool = False

    def __str__(self) -> str:
        return f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}]"

    def holds(self, v: float) -> bool:  # False for NaN, whose comparisons are all False
        return (self.lo < v if self.lo_open else self.lo <= v) and v <= self.hi


OPENAI_TEMPERATURE = Range(0, 2)
ANTHROPIC_TEMPERATURE = Range(0, 1)
TOP_P = Range(0, 1, lo_open=True)


def json_kind(value: Any) -> str:
    """What a value is in JSON's terms, for an error message: null, a boolean, a number, a string,
    an array, an object (not NoneType)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "an object" if isinstance(value, dict) else f"a {type(value).__name__}"


def number(body: dict, name: str, allowed: Range, default: float) -> float:
    """body[name] as a float in `allowed` (absent or null: `default`); FieldError naming the field."""
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise FieldError(
            f"'{name}' must be a number in {allowed} (got {json_kind(v)}: {show(v)})", name
        )
    if not allowed.holds(v):
        raise FieldError(
            f"'{name}' is out of range ({show(v)}): must be a number in {allowed}", name
        )
    return float(v)


def seed(body: dict) -> int | None:
    v = body.get("seed")
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= SEED_MAX):
        raise FieldError(f"'seed' must be an integer in [0, 2**64-1] (got {show(v)})", "seed")
    return v


def parse(body: dict, max_tokens: int, temperature: Range) -> Sampling:
    """The sampling of a request body, checked against the endpoint's ranges and normalised."""
    return normalise(
        Sampling(
            max_tokens,
            number(body, "temperature", temperature, 0.0),
            number(body, "top_p", TOP_P, 1.0),
            seed(body),
        )
    )


def normalise(s: Sampling) -> Sampling:
    """Edge values as the behaviour they mean: greedy (temperature 0, top_p 1) where the sampler would
    keep one token anyway or where float32 cannot carry the value."""
    if s.greedy:
        return Sampling(s.max_tokens, 0.0, 1.0, s.seed)
    return s

"""Sampling parameters of every endpoint, checked and normalised once into what every node samples
with (mlx-lm's sampler and logits processors: node/sampling.py), and the stop strings.

Ranges (a value outside is a 400 naming the field; NaN and ±inf are outside every range):

| field                                      | range                                             |
|--------------------------------------------|---------------------------------------------------|
| temperature                                | [0, 2] on the OpenAI routes, [0, 1] on /v1/messages |
| top_p                                      | (0, 1]                                            |
| seed                                       | an integer in [0, 2**64-1]                        |
| top_k                                      | an integer in [0, 2**32-1] (0: off)               |
| min_p                                      | [0, 1] (0: off)                                   |
| repetition_penalty                         | [0, 100] (0: off; 1 changes nothing)              |
| presence_penalty, frequency_penalty        | [-2, 2] (0: off)                                  |
| *_context_size (of the three penalties)    | an integer in [0, 2**32-1] (0: every token seen)  |
| logit_bias                                 | up to 1024 token ids ("17") -> [-100, 100]        |

Inside a range, the numeric edges mean greedy decoding: a temperature below
`proto.records.GREEDY_TEMPERATURE` (1/T overflows float32 near 1e-39 and every token becomes equally
likely) and a top_p below `proto.records.GREEDY_TOP_P` (it keeps the most likely token alone; under
~1e-45 it is 0.0 in float32, where the top-p filter reads past the vocabulary). Such requests reach
the nodes as temperature 0, top_p 1 (their logits processors kept): the nodes never see an edge
value from the API.

Stop strings: at most MAX_STOP_CHARS characters each, valid Unicode (no lone surrogates); checked
before anything reads them whole, so a 15 MB stop string is refused in microseconds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from ...proto.records import PENALTY_CONTEXT, SEED_MAX, UINT32_MAX, Sampling
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
MIN_P = Range(0, 1)
REPETITION_PENALTY = Range(0, 100)
PENALTY = Range(-2, 2)  # presence and frequency, OpenAI's range
BIAS = Range(-100, 100)  # a logit_bias value, OpenAI's range
MAX_BIAS = 1024  # token ids one logit_bias may name
MAX_STOP_CHARS = 1024  # characters of one stop string
_TOKEN_ID = re.compile(r"0|[1-9][0-9]{0,9}")  # a logit_bias key: a token id in decimal


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


def integer(body: dict, name: str, hi: int, default: int) -> int:
    """body[name] as an integer in [0, hi] (absent or null: `default`); FieldError naming it."""
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= hi:
        bound = "2**64-1" if hi == SEED_MAX else "2**32-1" if hi == UINT32_MAX else str(hi)
        raise FieldError(f"'{name}' must be an integer in [0, {bound}] (got {show(v)})", name)
    return v


def seed(body: dict) -> int | None:
    return integer(body, "seed", SEED_MAX, None)


def logit_bias(body: dict, vocab: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: {"<token id>": bias}, each id below `vocab` (0: unknown, the wire's
    bound), each bias in BIAS; as (id, bias) pairs by id."""
    v = body.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict) or len(v) > MAX_BIAS:
        raise FieldError(
            f"'logit_bias' must be an object of at most {MAX_BIAS} token ids (strings such as "
            f'"17") to numbers in {BIAS} (got {json_kind(v)}: {show(v)})',
            "logit_bias",
        )
    limit = vocab or UINT32_MAX + 1
    out = {}
    for key, bias in v.items():
        if not _TOKEN_ID.fullmatch(key) or int(key) >= limit:
            raise FieldError(
                f"'logit_bias' keys must be token ids in [0, {limit}) written in decimal "
                f"(got {show(key)})",
                "logit_bias",
            )
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not BIAS.holds(bias):
            raise FieldError(
                f"'logit_bias' values must be numbers in {BIAS} (got {show(bias)} for {key})",
                "logit_bias",
            )
        out[int(key)] = float(bias)
    return tuple(sorted(out.items()))


def parse(body: dict, max_tokens: int, temperature: Range, vocab: int = 0) -> Sampling:
    """The sampling of a request body, checked against the endpoint's ranges and normalised.
    `vocab`: the model's token count (logit_bias ids below it; 0: unknown)."""
    return normalise(
        Sampling(
            max_tokens,
            number(body, "temperature", temperature, 0.0),
            number(body, "top_p", TOP_P, 1.0),
            seed(body),
            top_k=integer(body, "top_k", UINT32_MAX, 0),
            min_p=number(body, "min_p", MIN_P, 0.0),
            repetition_penalty=number(body, "repetition_penalty", REPETITION_PENALTY, 0.0),
            repetition_context_size=integer(
                body, "repetition_context_size", UINT32_MAX, PENALTY_CONTEXT
            ),
            presence_penalty=number(body, "presence_penalty", PENALTY, 0.0),
            presence_context_size=integer(
                body, "presence_context_size", UINT32_MAX, PENALTY_CONTEXT
            ),
            frequency_penalty=number(body, "frequency_penalty", PENALTY, 0.0),
            frequency_context_size=integer(
                body, "frequency_context_size", UINT32_MAX, PENALTY_CONTEXT
            ),
            logit_bias=logit_bias(body, vocab),
        )
    )


def normalise(s: Sampling) -> Sampling:
    """Edge values as the behaviour they mean: greedy (temperature 0, top_p 1, no filter) where the
    sampler would keep one token anyway or where float32 cannot carry the value. The logits
    processors stay: greedy decoding takes the processed logits' best token, as mlx-lm's does."""
    if s.greedy:
        return replace(s, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0)
    return s


def stops(value: Any, name: str, most: int) -> tuple[str, ...]:
    """Stop strings: a string or a list of at most `most` strings (null: none), each at most
    MAX_STOP_CHARS characters of valid Unicode; empty ones dropped. Every check is bounded before
    a string is read whole (its length first), so no stop string can hold the worker or the loop."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or len(items) > most:
        raise FieldError(
            f"'{name}' must be a string or a list of up to {most} strings (got {json_kind(value)}: "
            f"{show(value)})",
            name,
        )
    for i, s in enumerate(items):
        if not isinstance(s, str):
            raise FieldError(f"{name}[{i}] must be a string (got {show(s)})", name)
        if len(s) > MAX_STOP_CHARS:
            raise FieldError(
                f"a stop string in '{name}' has {len(s)} characters: at most {MAX_STOP_CHARS} "
                "are taken",
                name,
            )
        check_text(s, name)
    return tuple(s for s in items if s)


def check_text(text: str, param: str) -> None:
    """JSON may carry lone surrogates ("\\ud800"), which no tokenizer takes (a TypeError deep
    inside)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise FieldError(
            f"'{param}' is not valid Unicode text: a lone surrogate at character {exc.start}",
            param,
        ) from None

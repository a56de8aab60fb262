"""The API's input handling without a server: JSON bodies, token ids, and what a bug's error shows."""

from __future__ import annotations

import json
import random

import pytest

from moe_cluster.coordinator.serve.api_error import INTERNAL_MESSAGE, ApiError
from moe_cluster.coordinator.serve.json_body import BIG_BODY, parse_json
from moe_cluster.proto.errors import InternalError, UserError
from moe_cluster.proto.records import SEED_MAX, Sampling, check_token_ids


def test_a_bug_s_text_never_reaches_the_client():
    for exc in (
        TypeError("seed(): incompatible function arguments"),
        InternalError("node a: ValueError: boom"),
    ):
        e = ApiError.of(exc, "POST /v1/completions")
        assert e.status == 500 and INTERNAL_MESSAGE in e.message
        assert "incompatible" not in e.message and "boom" not in e.message


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"{",
        b"[1]",
        b"null",
        b"\xff\xfe\x00{",
        b"[" * 100_000,
        b'{"max_tokens": ' + b"9" * 5000 + b"}",
        b'{"a": ' * 5000 + b"1" + b"}" * 5000,
    ],
)
def test_bodies_that_are_not_a_json_object_are_400(raw):
    with pytest.raises(ApiError) as info:
        parse_json(raw)
    assert info.value.status == 400


def test_big_bodies_parse_the_same_as_small_ones():
    body = {"prompt": list(range(100)) * 1000, "x": {"y": ["é", 1.5, None, True]}}
    raw = json.dumps(body).encode()
    assert len(raw) > BIG_BODY
    assert (
        parse_json(raw) == body == parse_json(json.dumps(body, ensure_ascii=False).encode("utf-16"))
    )


def test_big_bodies_decode_every_string_as_json_does():
    """The piecewise string scanner against json.loads: escapes, surrogate pairs (whole and lone),
    text across the piece boundaries, several encodings, and each kind of broken string."""
    rng = random.Random(7)
    alphabet = [
        "a",
        "é",
        "😀",
        "\n",
        "\\",
        '"',
        "/",
        "\t",
        "\x01",
        "\ud83d",
        "\ude00",
        "\u2028",
        "x" * 70_000,
    ]
    for _ in range(20):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40)))
        body = {"prompt": text, "k": [text[:5], {"é": text[-3:]}]}
        raws = [json.dumps(body).encode(), json.dumps(body).encode("utf-16")]
        if "\ud83d" not in text and "\ude00" not in text:  # lone surrogates have no UTF-8
            raws.append(json.dumps(body, ensure_ascii=False).encode())
        for raw in raws:
            raw += " ".encode(json.detect_encoding(raw)).removeprefix(b"\xff\xfe") * BIG_BODY
            chunks = [
                raw[i : i + 1000] for i in range(0, len(raw), 1000)
            ]  # as they arrive: cut anywhere
            assert parse_json(chunks) == json.loads(
                raw
            )  # not always body: json pairs adjacent surrogates
    pad = b" " * BIG_BODY
    for broken in (
        b'{"p": "abc',
        b'{"p": "abc\\',
        b'{"p": "a\\q"}',
        b'{"p": "\\u12"}',
        b'{"p": "\\u0x12"}',
        b'{"p": "a\x01"}',
        b'{"p": "\xff"}',
    ):
        with pytest.raises(json.JSONDecodeError if b"\xff" not in broken else UnicodeDecodeError):
            json.loads(broken)
        with pytest.raises(ApiError) as info:
            parse_json([broken + pad])
        assert info.value.status == 400, broken


def test_token_ids_and_seeds_are_checked_against_their_ranges():
    check_token_ids([0, 1023], 1024)
    for ids, needle in (
        ([1024], "prompt[0] is out of range (1024)"),
        ([1, -3], "prompt[1] is out of range (-3)"),
        ([True], "prompt[0] must be an integer"),
        ([1.0], "prompt[0] must be an integer"),
    ):
        with pytest.raises(
            UserError, match=needle.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
        ):
            check_token_ids(ids, 1024)
    Sampling(seed=0).check()
    Sampling(seed=SEED_MAX).check()
    for seed in (-1, SEED_MAX + 1, True, 1.0):
        with pytest.raises(UserError, match="seed"):
            Sampling(seed=seed).check()
    for t in (float("nan"), float("inf"), -0.1):
        with pytest.raises(UserError, match="temperature"):
            Sampling(temperature=t).check()

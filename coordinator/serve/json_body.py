"""Request bodies as JSON objects, parsed on the API's worker; a big body in pieces, so that the
event loop keeps the GIL often enough to answer while it is parsed."""

from __future__ import annotations

import codecs
import json
import json.scanner
import re

from .api_error import INVALID, ApiError
from .sampling import json_kind

# Bodies above this many bytes are read, decoded and parsed in pieces on the API's worker, so that
# no step holds the GIL for more than a millisecond or so and the event loop gets it every switch
# interval (5 ms). Done whole, 13 MB hold it for 60 ms on this VM (decode 9 ms, json's C string
# scanner 35 ms, the body's copy 9 ms), twice that under load. Small bodies take the C parser whole
# (under 2 ms).
BIG_BODY = 256 * 2**10
_PIECE = 2**16  # characters (or bytes) per step of a big body: ~0.1 ms each
_PLAIN = re.compile(r'[^"\\\x00-\x1f]*')  # a JSON string's characters that need no escape
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


def _scanstring_in_pieces(s: str, end: int, strict: bool = True) -> tuple[str, int]:
    """json.decoder's scanstring (same result, same errors) that matches runs of plain characters at
    most _PIECE at a time: the C scanner holds the GIL through a whole 13 MB string (35 ms)."""
    begin, parts = end - 1, []
    while True:
        run = _PLAIN.match(s, end, end + _PIECE)
        parts.append(run.group())
        end = run.end()
        if end >= len(s):
            raise json.JSONDecodeError("Unterminated string starting at", s, begin)
        c = s[end]
        if c == '"':
            return "".join(parts), end + 1
        if c == "\\":
            if end + 1 == len(s):
                raise json.JSONDecodeError("Unterminated string starting at", s, begin)
            char, end = _escape(s, end + 1)
            parts.append(char)
        elif c < " ":  # a control character; otherwise the run stopped at _PIECE
            if strict:
                raise json.JSONDecodeError(f"Invalid control character {c!r} at", s, end)
            parts.append(c)
            end += 1


def _escape(s: str, at: int) -> tuple[str, int]:
    """The character of the escape whose letter is s[at], and where the string goes on, as
    json.decoder.py_scanstring reads it (a surrogate pair is two \\uXXXX escapes)."""
    letter = s[at]
    if letter != "u":
        if letter not in _ESCAPES:
            raise json.JSONDecodeError(f"Invalid \\escape: {letter!r}", s, at)
        return _ESCAPES[letter], at + 1
    uni = _hex4(s, at)
    if 0xD800 <= uni <= 0xDBFF and s[at + 5 : at + 7] == "\\u":
        low = _hex4(s, at + 6)
        if 0xDC00 <= low <= 0xDFFF:
            return chr(0x10000 + (((uni - 0xD800) << 10) | (low - 0xDC00))), at + 11
    return chr(uni), at + 5


def _hex4(s: str, at: int) -> int:
    digits = s[at + 1 : at + 5]
    if len(digits) == 4 and digits[1] not in "xX":
        try:
            return int(digits, 16)
        except ValueError:
            pass
    raise json.JSONDecodeError("Invalid \\uXXXX escape", s, at)


_FAST_JSON = json.JSONDecoder()
_SLOW_JSON = json.JSONDecoder()
_SLOW_JSON.parse_string = _scanstring_in_pieces
_SLOW_JSON.scan_once = json.scanner.py_make_scanner(
    _SLOW_JSON
)  # used only on the API's worker thread


def parse_json(raw: bytes | list[bytes]) -> dict:
    """A request body (whole, or the chunks it arrived in) as a JSON object (UTF-8, -16 or -32, as
    json.loads reads bytes); runs on the API's worker. Whatever the content type says: clients such
    as curl -d send JSON as a form. A big body is decoded and parsed in pieces (see BIG_BODY)."""
    chunks = [raw] if isinstance(raw, bytes) else raw
    try:
        if sum(len(c) for c in chunks) <= BIG_BODY:
            whole = b"".join(chunks)
            body = _FAST_JSON.decode(whole.decode(json.detect_encoding(whole)))
        else:
            body = _SLOW_JSON.decode(_decode_in_pieces(chunks))
    except (
        ValueError,
        RecursionError,
    ) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        where = (
            f" (line {exc.lineno}, column {exc.colno}: {exc.msg})"
            if isinstance(exc, json.JSONDecodeError)
            else ""
        )
        raise ApiError(INVALID, f"request body is not valid JSON{where}") from None
    if not isinstance(body, dict):
        raise ApiError(INVALID, f"request body must be a JSON object (got {json_kind(body)})")
    return body


def _decode_in_pieces(chunks: list[bytes]) -> str:
    """The text of a body's chunks, decoded at most _PIECE bytes at a time."""
    head = b"".join(chunks)[:4] if len(chunks[0]) < 4 else chunks[0]
    decoder = codecs.getincrementaldecoder(json.detect_encoding(head))()
    texts = [
        decoder.decode(view[i : i + _PIECE])
        for view in map(memoryview, chunks)
        for i in range(0, len(view), _PIECE)
    ]
    texts.append(decoder.decode(b"", final=True))
    return "".join(texts)

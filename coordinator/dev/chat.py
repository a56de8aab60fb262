"""`moe-cluster chat --url URL`: an interactive terminal chat with streaming output and history.

Each turn sends the whole conversation to /v1/chat/completions with `stream: true`; the nodes'
prompt cache makes the shared prefix cheap. Ctrl-C during an answer stops it (the cluster cancels
the generation on every node); Ctrl-D or /exit quits; /reset starts over.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from typing import Iterator

from ...proto.errors import MoeClusterError, error_for, kind_from_http
from ..serve.client import ClusterError
from ..serve.remote import _api_key, _url

HELP = "commands: /reset (forget the conversation), /exit (or Ctrl-D); Ctrl-C stops an answer"


def stream_chat(
    url: str,
    messages: list[dict],
    *,
    max_tokens: int,
    temperature: float,
    top_p: float,
    seed: int | None,
    api_key: str | None = None,
    timeout: float = 600,
) -> Iterator[dict]:
    """Yield the parsed SSE events of one streamed chat completion."""
    body = {
        "messages": messages,
        "stream": True,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
    }
    if seed is not None:
        body["seed"] = seed
    req = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "Accept": "text/event-stream"},
    )
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        resp = urllib.request.urlopen(req, timeout=timeout)
    except urllib.error.HTTPError as exc:
        try:
            msg = json.loads(exc.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            msg = exc.reason
        raise error_for(kind_from_http(exc.code), f"HTTP {exc.code}: {msg}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ClusterError(f"cannot reach {url}: {getattr(exc, 'reason', exc)}") from None
    with resp:
        for raw in resp:
            line = raw.decode("utf-8").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            yield json.loads(data)


def _turn(args, url: str, messages: list[dict], out) -> str | None:
    """Stream one answer to `out`; returns its text (None if interrupted before any text)."""
    text = []
    t0 = time.perf_counter()
    first = None
    usage = None
    try:
        for event in stream_chat(
            url,
            messages,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            api_key=_api_key(args),
        ):
            if "error" in event:
                out.write(f"\n[error: {event['error']['message']}]\n")
                return None
            delta = event["choices"][0].get("delta", {}).get("content")
            if delta:
                if first is None:
                    first = time.perf_counter() - t0
                text.append(delta)
                out.write(delta)
                out.flush()
            usage = event.get("usage") or usage
    except KeyboardInterrupt:
        out.write("\n[stopped]\n")
        out.flush()
        return "".join(text) or None
    out.write("\n")
    if usage and args.verbose_stats:
        out.write(f"[{usage['completion_tokens']} tokens, first token after {first or 0:.2f}s]\n")
    out.flush()
    return "".join(text)


def main(args) -> int:
    url = _url(args)
    try:
        import readline  # noqa: F401 - line editing and history when the terminal has it
    except ImportError:
        pass
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    out = sys.stdout
    out.write(f"chatting with {url} — {HELP}\n")
    out.flush()
    while True:
        try:
            line = input("you> ")
        except EOFError:
            out.write("\n")
            return 0
        except KeyboardInterrupt:
            out.write("\n")
            continue
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            messages = messages[:1] if args.system else []
            out.write("[conversation reset]\n")
            continue
        if line.startswith("/"):
            out.write(f"[unknown command {line}; {HELP}]\n")
            continue
        messages.append({"role": "user", "content": line})
        out.write("assistant> ")
        out.flush()
        try:
            answer = _turn(args, url, messages, out)
        except (
            MoeClusterError
        ) as exc:  # the API's answer (bad input, busy, degraded): the chat goes on
            out.write(f"\n[error: {exc}]\n")
            messages.pop()
            continue
        if answer is None:
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": answer})

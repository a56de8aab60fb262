"""Fault injection for the cluster tests: what a fault does, when the cluster saw it, what a client got.

One `Phases` drives a fault through three moments on one cluster (idle, during a request's prefill,
during eight streamed decodes), checking that every request completes with the tokens of the same
request on the cluster without the fault (the coordinator resumes what a lost node cut, and
requests that arrive meanwhile wait for the recovery), and that the cluster is ready again and
serves. Every phase prints one `RELIABILITY |` line (seconds after the fault) and the stall each
stream saw; docs/reliability.md's table comes from them.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Callable

from cluster_fixture import http

from moe_cluster.coordinator.serve.resume import KEEPALIVE_S

COLLECTIVE_S = 3.0  # the yaml's timeouts.collective
HEARTBEAT_S = 0.5  # the yaml's timeouts.heartbeat
MARGIN = 3.0  # a bound is this many times the median measured for its fault kind
# Seconds after the fault (for the link: ready again after it came back), idle / prefill / decode,
# measured for the README's reliability table on 2 vCPUs at load average MEASURED_LOAD:
# (detect, ready again).
MEASURED = {
    "node killed": ((0.21, 0.06, 0.07), (3.80, 2.74, 3.52)),
    "envoy killed": ((0.26, 0.05, 0.06), (1.05, 0.53, 0.96)),
    "node stopped": ((1.51, 1.36, 1.10), (3.77, 3.50, 3.40)),
    "link down": ((1.53, 1.52, 1.21), (1.87, 1.98, 1.55)),
}
MEASURED_LOAD = 2.5


@dataclass(frozen=True)
class Bounds:
    detect: float  # seconds from the fault until /health says not ready
    ready: float  # seconds from the fault (or the restore) until /health says ready again


def bounds(kind: str, load: float = MEASURED_LOAD) -> Bounds:
    """MARGIN times the median measured for `kind`. Detection is at least two heartbeats (a dead
    process seen by no RPC in flight is seen by the next heartbeat, up to HEARTBEAT_S later).
    Recovery is CPU work (a node process started, every node's model loaded again), which a machine
    at load average `load` runs about load / MEASURED_LOAD times slower: the bound stretches by
    that much (measured at load 7-9 beside other suites: node killed 3.2-12.4 s, envoy killed
    1.8-3.1 s, node stopped 7.2-11.2 s, link 3.0-5.7 s after it came back)."""
    detect, ready = MEASURED[kind]
    slower = max(1.0, load / MEASURED_LOAD)
    return Bounds(
        max(MARGIN * statistics.median(detect), 2 * HEARTBEAT_S),
        MARGIN * statistics.median(ready) * slower,
    )


SENTENCE = "To be, or not to be, that is the question: Whether tis nobler in the mind to suffer. "
# With serving.prefill_chunk 16 the demo model prefills ~350 tokens a second on 2 vCPUs: 30 sentences
# (~1000 tokens) keep a prefill running ~3 s, long enough to land a fault inside it.
PREFILL_SENTENCES = 30
PROMPTS = [  # eight streams of different lengths of prompt
    "Beware the ides of March.",
    "Double, double toil and trouble; Fire burn and cauldron bubble.",
    "What's in a name? That which we call a rose",
    "Out, damned spot! out, I say!",
    "The lady doth protest too much, methinks.",
    "Cowards die many times before their deaths; The valiant never taste of death but once.",
    "We are such stuff as dreams are made on,",
    "Uneasy lies the head that wears a crown.",
]
DECODE_TOKENS = 40  # per stream: eight of them decode together for a few seconds
RECOVERY_TOKENS = 8  # greedy tokens of SENTENCE compared before and after each fault
SAMPLED = {
    "prompt": "All that glitters is not gold;",
    "temperature": 0.8,
    "seed": 7,
}  # a ninth stream
# room for the ninth stream beside the eight greedy ones
FAST_YAML = "serving:\n  prefill_chunk: 16\n  max_batch: 9\n"


class HealthWatch:
    """Polls /health every 50 ms: when it first said not ready, and when ready again after that."""

    def __init__(self, url: str, t0: float):
        self.url, self.t0 = url, t0
        self.down: float | None = None
        self.up: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            status = http(self.url, "/health", timeout=5)[0]
            now = time.monotonic() - self.t0
            if status != 200 and self.down is None:
                self.down = now
            elif status == 200 and self.down is not None and self.up is None:
                self.up = now
                return
            time.sleep(0.05)

    def wait_down(self, timeout: float) -> float | None:
        deadline = time.monotonic() + timeout
        while self.down is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.down

    def wait_up(self, timeout: float) -> float | None:
        self._thread.join(timeout)
        self._stop.set()
        return self.up


@dataclass
class Answer:
    """What a client got: the HTTP status, its headers and body, or for a stream the events it read."""

    status: int = 0
    headers: dict | None = None
    body: dict | None = None
    events: list | None = None  # parsed `data:` events of a 200 stream; "[DONE]" as the string
    keepalives: int = 0  # SSE comment lines of a stream (sent while it waits for a recovery)
    first: float = 0.0  # time.monotonic() of a stream's first data event
    sent: float = 0.0  # time.monotonic() when the request went out
    at: float = 0.0  # time.monotonic() when the answer (the error, or the stream's end) arrived

    @property
    def errors(self) -> list:
        return [e for e in self.events or [] if isinstance(e, dict) and "error" in e]

    @property
    def final(self) -> dict:
        """A stream's last chunk (finish_reason, usage, moe_cluster) or a plain answer's body."""
        if self.events is None:
            return self.body or {}
        return next(
            (e for e in reversed(self.events) if isinstance(e, dict) and "moe_cluster" in e), {}
        )

    def tokens(self) -> list[int] | None:
        return self.final.get("moe_cluster", {}).get("tokens")

    def text(self) -> str:
        if self.events is None:
            return (self.body or {}).get("choices", [{}])[0].get("text", "")
        return "".join(
            e["choices"][0].get("text", "")
            for e in self.events
            if isinstance(e, dict) and e.get("choices")
        )


def post(
    url: str, body: dict, answer: Answer, on_event: Callable[[dict | str], None] | None = None
) -> None:
    """POST /v1/completions into `answer` (streams read event by event)."""
    req = urllib.request.Request(
        url + "/v1/completions",
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    answer.sent = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            answer.status, answer.headers = r.status, dict(r.headers)
            if not body.get("stream"):
                answer.body = json.loads(r.read())
            else:
                answer.events = []
                for raw in r:  # one SSE line at a time
                    line = raw.decode().strip()
                    if line.startswith(":"):
                        answer.keepalives += 1
                    if not line.startswith("data: "):
                        continue
                    event = line[6:] if line == "data: [DONE]" else json.loads(line[6:])
                    answer.first = answer.first or time.monotonic()
                    if isinstance(event, dict) and "error" in event and not answer.at:
                        answer.at = time.monotonic()
                    answer.events.append(event)
                    if on_event is not None:
                        on_event(event)
    except urllib.error.HTTPError as exc:
        answer.status, answer.headers, answer.body = (
            exc.code,
            dict(exc.headers),
            json.loads(exc.read()),
        )
    answer.at = answer.at or time.monotonic()


IN_FLIGHT = 3  # chunks a stream may get after the kill without a resume: at most one step ahead


def _chunks(a: Answer) -> int:
    """The completion chunks a stream has read so far (its events with choices)."""
    return sum(1 for e in list(a.events or []) if isinstance(e, dict) and e.get("choices"))


def check_completed(a: Answer, want: list[int] | None = None, what: str = "") -> None:
    """A request that completed as without the fault: 200, no error, [DONE], and the tokens `want`."""
    assert a.status == 200, (what, a.status, a.body)
    if a.events is not None:
        assert not a.errors and a.events[-1] == "[DONE]", (what, a.events[-3:])
        assert a.final.get("choices", [{}])[0].get("finish_reason") in ("length", "stop"), (
            what,
            a.final,
        )
    if want is not None:
        assert a.tokens() == want, (what, a.tokens(), want)
    usage = a.final.get("usage", {})
    assert usage.get("completion_tokens") == len(a.tokens() or []), (what, usage)


def greedy_tokens(url: str) -> list[int]:
    """The cluster's greedy tokens for SENTENCE (RECOVERY_TOKENS of them: never empty)."""
    status, out = http(
        url,
        "/v1/completions",
        {"prompt": SENTENCE, "max_tokens": RECOVERY_TOKENS, "temperature": 0},
        timeout=60,
    )
    assert status == 200, out
    tokens = out["moe_cluster"]["tokens"]
    assert len(tokens) == RECOVERY_TOKENS, out
    return tokens


def recovered(url: str, want: list[int]) -> None:
    """Nothing stuck and nothing changed: every node ready, nothing queued, and the next request
    served with `want`, the greedy tokens the cluster gave before the fault (a rebuilt cluster that
    serves other tokens is not recovered)."""
    got = greedy_tokens(url)
    assert got == want, f"after the fault the cluster serves {got}, before it {want}"
    s = http(url, "/v1/cluster/status")[1]
    assert (
        s["state"] == "ready"
        and all(n["state"] == "ready" for n in s["nodes"])
        and s["queue_depth"] == 0
    ), s


def report(scenario: str, detect: float | None, answer: str, recovery: float | None) -> None:
    fmt = lambda v: "-" if v is None else f"{v:.2f} s"  # noqa: E731
    print(
        f"\nRELIABILITY | {scenario} | detect {fmt(detect)} | client {answer} | recovery {fmt(recovery)}"
    )


def run_together(
    url: str, bodies: list[dict], on_event: Callable[[int, dict | str], None] | None = None
) -> tuple[list[Answer], list[threading.Thread]]:
    """Start one client thread per body; returns their answers (filled in as they go) and threads."""
    answers = [Answer() for _ in bodies]
    threads = [
        threading.Thread(
            target=post,
            args=(url, b, a, (lambda e, i=i: on_event(i, e)) if on_event else None),
            daemon=True,
        )
        for i, (b, a) in enumerate(zip(bodies, answers))
    ]
    for t in threads:
        t.start()
    return answers, threads


def stalls(answers: list[Answer]) -> list[float]:
    """Each stream's stalls (seconds without a token at a resume), as the coordinator reports them."""
    return [s for a in answers for s in a.final.get("moe_cluster", {}).get("stalls_s", [])]


def late_stop(text: str) -> str:
    """A stop string (4 to 12 characters, not blank) whose first occurrence in `text` begins in its
    last half, the latest from three quarters in; "" where every such window occurs earlier."""
    half = len(text) // 2
    for start in [*range(len(text) * 3 // 4, half, -1), *range(len(text) * 3 // 4 + 1, len(text))]:
        for n in range(4, 13):
            window = text[start : start + n]
            if len(window) == n and window.strip() and text.index(window) == start:
                return window
    return ""


class Phases:
    """Runs one fault idle, during prefill and during decode on one cluster.

    `inject()` makes the fault (and returns nothing); `restore()` undoes what can be undone (SIGCONT,
    link up; nothing for a kill); `victim` is the lost node's name; `kind` (a key of MEASURED) gives
    the bounds on detection and recovery. `recover_from`: "fault" (ready again within the bound after
    the fault: a local node restarted) or "restore" (within it after restore(): a remote node that
    came back). `restore_after`: "detect" (once /health said not ready) or
    "ready" (once the cluster is ready again: it must not need the restore, as with a stalled
    process that may never continue). The requests in flight wait meanwhile, so none of them is
    waited for before the restore.
    """

    def __init__(
        self,
        url: str,
        name: str,
        victim: str,
        kind: str,
        inject: Callable[[], None],
        restore: Callable[[], None] = lambda: None,
        recover_from: str = "fault",
        restore_after: str = "detect",
        log: list[str] | None = None,
    ):
        assert recover_from == "fault" or restore_after == "detect", (
            "recovery from a restore needs the restore first"
        )
        self.url, self.name, self.victim, self.kind = url, name, victim, kind
        self.inject, self.restore, self.recover_from, self.restore_after = (
            inject,
            restore,
            recover_from,
            restore_after,
        )
        self.log = (
            log if log is not None else []
        )  # the coordinator's output lines, shown when recovery fails
        self.want = greedy_tokens(url)  # before any fault: what every recovery must serve again

    def _log_tail(self) -> str:
        return "\n".join(
            [
                line
                for line in self.log
                if "serve.cluster" in line or "serve.requests" in line or "launcher" in line
            ][-12:]
        )

    def _recover(self, phase: str, t0: float, watch: HealthWatch) -> tuple[float, float]:
        """(detect, ready again) in seconds after the fault, restoring on the way."""
        load = os.getloadavg()[0]  # the last minute's: the machine the recovery runs on
        b = bounds(self.kind, load)
        detect = watch.wait_down(b.detect + 1)
        assert detect is not None and detect <= b.detect, (
            f"{phase}: not detected within {b.detect:.2f} s: {detect}"
        )
        if self.restore_after == "detect":
            self.restore()  # idempotent: run() calls it again at the end
        t_restore = time.monotonic() - t0
        up = watch.wait_up(b.ready + t_restore + 5)
        if self.restore_after == "ready":
            self.restore()
        base = t_restore if self.recover_from == "restore" else 0.0
        if up is not None and self.recover_from == "restore":
            print(
                f"RELIABILITY-RESTORE | {self.name}, {phase} | ready {up - t_restore:.2f} s after restore"
            )
        assert up is not None and up - base <= b.ready, (
            f"{phase}: not ready again within {b.ready:.2f} s (load {load:.1f}): {up}\n{self._log_tail()}"
        )
        return detect, up

    def _join(self, phase: str, threads: list[threading.Thread], t0: float) -> None:
        for t in threads:
            t.join(
                max(0.1, t0 + bounds(self.kind, os.getloadavg()[0]).ready + 60 - time.monotonic())
            )
        assert not any(t.is_alive() for t in threads), f"{phase}: a client is still waiting"

    def idle(self) -> None:
        """The fault while idle, then a plain and a streamed request 0.2 s later (before a heartbeat
        can have seen it): both wait for the recovery and complete (the stream with keep-alives)
        with the tokens they get without the fault."""
        self.inject()
        t0 = time.monotonic()
        watch = HealthWatch(self.url, t0)
        time.sleep(0.2)
        body = {"prompt": SENTENCE, "max_tokens": 4}
        answers, threads = run_together(self.url, [body, {**body, "stream": True}])
        phase = "idle, requests 0.2 s later"
        detect, up = self._recover(phase, t0, watch)
        self._join(phase, threads, t0)
        for a in answers:  # greedy: the first 4 of the 8 tokens the cluster gave before the fault
            check_completed(a, self.want[:4], phase)
        plain, streamed = answers
        # owed a keep-alive: it was out for more than an interval of the cluster's recovery (from
        # detection, or from when it went out if later, to ready again), with 0.5 s for the beat's
        # phase and the request's way in on a loaded machine
        waited = up - max(detect, streamed.sent - t0)
        if waited > KEEPALIVE_S + 0.5:
            assert streamed.keepalives >= 1, (
                f"{phase}: a stream that waited {waited:.2f} s of the recovery got no keep-alive"
            )
        report(
            f"{self.name}, {phase}",
            detect,
            f"200 at {plain.at - t0:.2f} s, stream's first token at "
            f"{streamed.first - t0:.2f} s ({streamed.keepalives} keep-alives)",
            up,
        )
        recovered(self.url, self.want)

    def prefill(self) -> None:
        """The fault while a long prompt is being prefilled: the stream completes with the tokens of
        stock mlx-lm (the same request without the fault)."""
        from cluster_fixture import stock_tokens
        from moe_cluster.node.demo import MODEL_DIR

        prompt = f"{time.time_ns()} " + SENTENCE * PREFILL_SENTENCES
        body = {"prompt": prompt, "max_tokens": 8, "stream": True}
        (a,), threads = run_together(self.url, [body])
        deadline = time.monotonic() + 10
        while (
            http(self.url, "/v1/cluster/status")[1]["queue_depth"] == 0
            and time.monotonic() < deadline
        ):
            time.sleep(0.02)
        time.sleep(0.3)  # tokenized and sent, into its first chunks
        assert not a.first, "the prompt was prefilled before the fault"
        self.inject()
        t0 = time.monotonic()
        watch = HealthWatch(self.url, t0)
        phase = "during prefill"
        detect, up = self._recover(phase, t0, watch)
        self._join(phase, threads, t0)
        check_completed(a, stock_tokens(MODEL_DIR, prompt, 8), phase)
        report(
            f"{self.name}, {phase}",
            detect,
            f"first token at {a.first - t0:.2f} s, stall {stalls([a])} s",
            up,
        )
        recovered(self.url, self.want)

    def decode(self) -> None:
        """The fault while eight greedy streams decode together: all eight complete with exactly the
        tokens and text the same requests got just before on the unfaulted cluster, none gets an
        error. One has a stop string that its text reaches only after the fault: it ends there. A
        ninth, sampled with a seed, goes on drawing what it drew without the fault."""
        bodies = [{"prompt": p, "max_tokens": DECODE_TOKENS, "stream": True} for p in PROMPTS]
        bodies.append({**SAMPLED, "max_tokens": DECODE_TOKENS, "stream": True})
        # the stream with a stop string: the first whose answer has one that first occurs late
        # in it, after the fault lands (the demo repeats what it read, so an answer may loop)
        for k, body in enumerate(bodies[: len(PROMPTS)]):
            status, whole = http(self.url, "/v1/completions", {**body, "stream": False})
            assert status == 200, whole
            text = whole["choices"][0]["text"]
            stop = late_stop(text)
            if stop:
                break
        assert stop, "no prompt's answer has a stop string that first occurs late in it"
        bodies[k] = {**bodies[k], "stop": [stop]}
        before, threads = run_together(self.url, bodies)
        self._join("before the fault", threads, time.monotonic())
        for b, a in zip(bodies, before):
            check_completed(a, what=f"without the fault: {b['prompt']}")
            if "stop" not in b:
                assert len(a.tokens()) == DECODE_TOKENS, (
                    f"{b['prompt']!r} ends early: pick another prompt"
                )
        assert before[k].text() == text[: text.index(stop)], (before[k].text(), stop)
        seen = [0] * len(bodies)
        going = threading.Event()

        def on_event(i: int, event) -> None:
            if isinstance(event, dict) and event.get("choices") and event["choices"][0].get("text"):
                seen[i] += 1
                if min(seen) >= 3:
                    going.set()

        answers, threads = run_together(self.url, bodies, on_event)
        assert going.wait(60), f"the streams did not all start: {seen}"
        at_fault = [_chunks(a) for a in answers]  # each stream's chunks when the fault lands
        self.inject()
        t0 = time.monotonic()
        watch = HealthWatch(self.url, t0)
        phase = "during decode (8 greedy streams and a sampled one)"
        detect, up = self._recover(phase, t0, watch)
        self._join(phase, threads, t0)
        for b, a, want in zip(bodies, answers, before):
            check_completed(a, want.tokens(), f"{phase}: {b['prompt']}")
            assert a.text() == want.text(), (phase, b, a.text(), want.text())
        assert answers[k].final["choices"][0]["finish_reason"] == "stop", answers[k].final
        cut = stalls(answers)
        # A stream with tokens still to come when the node died waits for the recovery and resumes;
        # one within IN_FLIGHT chunks of its end may have had them computed (or its stop string
        # found by the coordinator) before the kill, and ends without a resume.
        decoding = [i for i, a in enumerate(answers) if _chunks(a) - at_fault[i] > IN_FLIGHT]
        assert len(decoding) >= len(answers) - 2, (
            f"{phase}: the fault landed as {len(answers) - len(decoding)} streams were ending "
            f"(chunks at the fault {at_fault}, at the end {[_chunks(a) for a in answers]})"
        )
        not_resumed = [i for i in decoding if not stalls([answers[i]])]
        assert not not_resumed, f"{phase}: streams {not_resumed} decoding at the fault not resumed"
        report(
            f"{self.name}, {phase}",
            detect,
            f"all {len(answers)} complete, tokens as without the "
            f"fault, last at "
            f"{max(a.at for a in answers) - t0:.2f} s",
            up,
        )
        print(
            f"RELIABILITY-STALLS | {self.name}, {phase} | {len(cut)} resumed | stalls "
            f"{', '.join(f'{s:.2f}' for s in sorted(cut))} s"
        )
        recovered(self.url, self.want)

    def run(self) -> None:
        try:
            self.idle()
            self.prefill()
            self.decode()
        finally:
            self.restore()  # a phase that failed before its restore leaves no stopped process or link down

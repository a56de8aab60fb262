"""Fault injection for the cluster tests: what a fault does, when the cluster saw it, what a client got.

One `Phases` drives a fault through three moments on one cluster (idle, during a request's prefill,
during a streamed decode), checking after each that the cluster is ready again and serves. Every
phase prints one `RELIABILITY |` line (seconds after the fault); docs/reliability.md's table comes
from them.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Callable

from cluster_fixture import http

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
    return Bounds(max(MARGIN * statistics.median(detect), 2 * HEARTBEAT_S),
                  MARGIN * statistics.median(ready) * slower)


SENTENCE = "To be, or not to be, that is the question: Whether tis nobler in the mind to suffer. "
# With serving.prefill_chunk 16 the demo model prefills ~350 tokens a second on 2 vCPUs: 30 sentences
# (~1000 tokens) keep a prefill running ~3 s, long enough to land a fault inside it.
PREFILL_SENTENCES = 30
DECODE_TOKENS = 1000  # ~50 tokens a second: the stream runs ~20 s unless the fault ends it
FAST_YAML = "serving:\n  prefill_chunk: 16\n"
RECOVERY_TOKENS = 8  # greedy tokens of SENTENCE compared before and after each fault


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
    at: float = 0.0  # time.monotonic() when the answer (the error, or the stream's end) arrived


def post(url: str, body: dict, answer: Answer, on_event: Callable[[dict | str], None] | None = None) -> None:
    """POST /v1/completions into `answer` (streams read event by event)."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            answer.status, answer.headers = r.status, dict(r.headers)
            if not body.get("stream"):
                answer.body = json.loads(r.read())
            else:
                answer.events = []
                for raw in r:  # one SSE line at a time
                    line = raw.decode().strip()
                    if not line.startswith("data: "):
                        continue
                    event = line[6:] if line == "data: [DONE]" else json.loads(line[6:])
                    if isinstance(event, dict) and "error" in event and not answer.at:
                        answer.at = time.monotonic()
                    answer.events.append(event)
                    if on_event is not None:
                        on_event(event)
    except urllib.error.HTTPError as exc:
        answer.status, answer.headers, answer.body = exc.code, dict(exc.headers), json.loads(exc.read())
    answer.at = answer.at or time.monotonic()


def check_refused(a: Answer, victim: str) -> None:
    """A 503 of a lost node: its code, a Retry-After and the node's name in the reason."""
    assert a.status == 503, (a.status, a.body, a.events)
    assert a.body["error"]["code"] == "cluster_degraded", a.body
    assert int(a.headers.get("Retry-After", 0)) > 0, (a.headers, a.body)
    assert victim in a.body["error"]["message"], a.body


def greedy_tokens(url: str) -> list[int]:
    """The cluster's greedy tokens for SENTENCE (RECOVERY_TOKENS of them: never empty)."""
    status, out = http(url, "/v1/completions", {"prompt": SENTENCE, "max_tokens": RECOVERY_TOKENS,
                                                "temperature": 0}, timeout=60)
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
    assert s["state"] == "ready" and all(n["state"] == "ready" for n in s["nodes"]) and s["queue_depth"] == 0, s


def report(scenario: str, detect: float | None, answer: str, recovery: float | None) -> None:
    fmt = lambda v: "-" if v is None else f"{v:.2f} s"  # noqa: E731
    print(f"\nRELIABILITY | {scenario} | detect {fmt(detect)} | client {answer} | recovery {fmt(recovery)}")


class Phases:
    """Runs one fault idle, during prefill and during decode on one cluster.

    `inject()` makes the fault (and returns nothing); `restore()` undoes what can be undone (SIGCONT,
    link up; nothing for a kill) once the client has its answer; `victim` is the lost node's name;
    `kind` (a key of MEASURED) gives the bounds on detection and recovery.
    `recover_from`: "fault" (ready again within the bound after the fault: a local node restarted)
    or "restore" (after restore(): a remote node that came back). `restore_after`: "answer"
    (once the client has its answer) or "ready" (once the cluster is ready again: it must not need
    the restore, as with a stalled process that may never continue).
    """

    def __init__(self, url: str, name: str, victim: str, kind: str, inject: Callable[[], None],
                 restore: Callable[[], None] = lambda: None, recover_from: str = "fault", restore_after: str = "answer",
                 log: list[str] | None = None):
        assert recover_from == "fault" or restore_after == "answer", "recovery from a restore needs the restore first"
        self.url, self.name, self.victim, self.kind = url, name, victim, kind
        self.inject, self.restore, self.recover_from, self.restore_after = inject, restore, recover_from, restore_after
        self.log = log if log is not None else []  # the coordinator's output lines, shown when recovery fails
        self.want = greedy_tokens(url)  # before any fault: what every recovery must serve again

    def _log_tail(self) -> str:
        return "\n".join([line for line in self.log if "serve.cluster" in line or "launcher" in line][-12:])

    def _finish(self, phase: str, t0: float, watch: HealthWatch, answer: str, answered_at: float) -> None:
        load = os.getloadavg()[0]  # the last minute's: the machine the recovery runs on
        b = bounds(self.kind, load)
        detect = watch.wait_down(b.detect + 1)
        assert detect is not None and detect <= b.detect, f"{phase}: not detected within {b.detect:.2f} s: {detect}"
        assert answered_at - t0 <= COLLECTIVE_S, f"{phase}: the client waited {answered_at - t0:.2f} s"
        if self.restore_after == "answer":
            self.restore()  # idempotent: run() calls it again at the end
        t_restore = time.monotonic() - t0
        up = watch.wait_up(b.ready + t_restore + 5)
        if self.restore_after == "ready":
            self.restore()
        base = t_restore if self.recover_from == "restore" else 0.0
        extra = f" ({up - t_restore:.2f} s after restore)" if up is not None and self.recover_from == "restore" else ""
        report(f"{self.name}, {phase}", detect, f"{answer} at {answered_at - t0:.2f} s", up)
        if extra:
            print(f"RELIABILITY-RESTORE | {self.name}, {phase} | ready{extra}")
        assert up is not None and up - base <= b.ready, \
            f"{phase}: not ready again within {b.ready:.2f} s (load {load:.1f}): {up}\n{self._log_tail()}"
        recovered(self.url, self.want)

    def idle(self) -> None:
        """The fault while idle, then a request 0.2 s later (before a heartbeat can have seen it)."""
        self.inject()
        t0 = time.monotonic()
        watch = HealthWatch(self.url, t0)
        time.sleep(0.2)
        a = Answer()
        post(self.url, {"prompt": SENTENCE, "max_tokens": 4}, a)
        check_refused(a, self.victim)
        self._finish("idle, a request 0.2 s later", t0, watch, "503", a.at)

    def prefill(self) -> None:
        """The fault while a long prompt is being prefilled (streamed: a 503 proves no token came)."""
        a = Answer()
        body = {"prompt": f"{time.time_ns()} " + SENTENCE * PREFILL_SENTENCES, "max_tokens": 4, "stream": True}
        client = threading.Thread(target=post, args=(self.url, body, a), daemon=True)
        client.start()
        deadline = time.monotonic() + 10
        while http(self.url, "/v1/cluster/status")[1]["queue_depth"] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.3)  # tokenized and sent, into its first chunks
        assert not a.status, f"the prompt was prefilled before the fault ({a.status})"
        self.inject()
        t0 = time.monotonic()
        watch = HealthWatch(self.url, t0)
        client.join(COLLECTIVE_S + 5)
        assert not client.is_alive(), "the client is still waiting"
        check_refused(a, self.victim)
        self._finish("during prefill", t0, watch, "503", a.at)

    def decode(self) -> None:
        """The fault mid-generation of a stream: the client gets an error event, then [DONE]."""
        a = Answer()
        tokens = threading.Event()
        seen = [0]

        def on_event(event):
            if isinstance(event, dict) and event.get("choices") and event["choices"][0].get("text"):
                seen[0] += 1
                if seen[0] >= 3:
                    tokens.set()

        body = {"prompt": f"{time.time_ns()} The king said", "max_tokens": DECODE_TOKENS, "stream": True}
        client = threading.Thread(target=post, args=(self.url, body, a, on_event), daemon=True)
        client.start()
        assert tokens.wait(20), f"no tokens streamed: {a}"
        self.inject()
        t0 = time.monotonic()
        watch = HealthWatch(self.url, t0)
        client.join(COLLECTIVE_S + 5)
        assert not client.is_alive(), "the stream is still open"
        assert a.status == 200 and a.events[-1] == "[DONE]", a
        errors = [e for e in a.events if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and a.events[-2] is errors[0], a.events[-3:]
        assert errors[0]["error"]["code"] == "cluster_degraded" and self.victim in errors[0]["error"]["message"], errors
        assert not any(isinstance(e, dict) and e.get("choices") and e["choices"][0].get("finish_reason")
                       for e in a.events), "the stream finished before the fault"
        self._finish("during decode (stream)", t0, watch, "error event + [DONE]", a.at)

    def run(self) -> None:
        try:
            self.idle()
            self.prefill()
            self.decode()
        finally:
            self.restore()  # a phase that failed before its restore leaves no stopped process or link down

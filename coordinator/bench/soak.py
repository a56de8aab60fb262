"""`moe-cluster bench soak`: a local cluster serves a stream of requests while a node is killed every
so often; no request may fail or hang past its timeout, and the cluster must end ready.

It starts `moe-cluster up` on a temporary local cluster (product defaults: heartbeat 1 s, collective
timeout 5 s), sends requests back to back (plain and streamed, in turn) from one client, and
SIGKILLs one node process every --kill-every seconds (the nodes in turn), timing from each kill
until /health says not ready (detect) and until it says ready again (recovery). The next kill waits
for the recovery. At the end it waits for the cluster to be ready and sends one more request.
Requests cut by a kill resume once the cluster is ready again and those sent meanwhile wait for it
(serving.recovery_wait), so every answer should be whole: the report counts the failed ones (a 503,
an error event, anything but a complete answer) and gives the stalls the resumed ones saw.

With `--kill coordinator` the coordinator dies instead: node agents run on loopback on their own
(bench/loopback.py, `launch: remote`, as under their services) and `up` runs under `moe-cluster
supervise`, the product's restart loop, which holds the API's socket; every --kill-every seconds
`up` is SIGKILLed, and the next one adopts the nodes. The requests are greedy and their tokens are
checked against the first answer's. A request in flight when `up` dies is lost with it (its
connection closes: `cut`), and the client sends it again, as a client of the API must; any other
request must complete with the right tokens or get a 503 that carries Retry-After, and none may
hang. The cluster must end ready with the node processes it started with.
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from ...proto.errors import UserError
from .loopback import Coordinator, loopback
from .prompt_cache import local_cluster

PROMPT = "To be, or not to be, that is the question:"
POLL_S = 0.05  # seconds between /health polls
DETECT_WAIT_S = 10.0  # a kill not seen by /health within this long is reported as undetected
RECOVER_WAIT_S = 60.0  # a cluster not ready again within this long after a kill fails the soak
FINAL_WAIT_S = 60.0
RETRY_S = 1.0  # seconds the client waits after a 503 (a busy loop of 503s would slow the recovery on few cores)


@dataclass
class Kill:
    at_s: float  # seconds since the soak started
    node: str  # the node killed, or "coordinator"
    pid: int
    detect_s: float | None = None  # seconds after the kill; None: /health never said not ready
    recovery_s: float | None = (
        None  # seconds after the kill; None: not ready again in RECOVER_WAIT_S
    )


@dataclass
class Tally:
    ok: int = 0
    unavailable: int = 0  # 503: the cluster said it is degraded or recovering
    other: int = (
        0  # any other answer (a 500, a stream that ended without an error event or its end)
    )
    hung: int = 0  # no answer within the request timeout
    cut: int = 0  # in flight when the coordinator died: its connection closed (the client retries)
    wrong: int = 0  # completed with tokens other than the first answer's (greedy requests)
    no_retry_after: int = 0  # 503s without a Retry-After header
    max_latency_s: float = 0.0
    stalls: list[float] = field(default_factory=list)  # seconds without a token, per resume
    latencies: list[float] = field(default_factory=list)
    other_errors: list[str] = field(default_factory=list)  # the first few, for the report

    def add(self, outcome: str, latency: float, detail: str = "", stalls: list[float] = ()) -> None:
        setattr(self, outcome, getattr(self, outcome) + 1)
        self.stalls.extend(stalls)
        self.latencies.append(latency)
        self.max_latency_s = max(self.max_latency_s, latency)
        if outcome != "ok" and len(self.other_errors) < 10:
            self.other_errors.append(f"{outcome}: {detail}"[:300])


def _get(url: str, path: str, timeout: float = 5.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url + path, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
    except (OSError, ValueError):
        return 0, {}


def _one_request(
    url: str, stream: bool, timeout_s: float, expect: list | None = None, greedy: bool = False
) -> tuple[str, str, list[float]]:
    """(outcome, detail, stalls) of one completion: ok | unavailable | other | hung | cut | wrong,
    and the seconds without a token at each of its resumes (the coordinator's
    moe_cluster.stalls_s). `greedy`: temperature 0, and with `expect` its tokens must be those;
    a connection that closes mid-answer is `cut` (only a dying coordinator closes one)."""
    fields = {"prompt": PROMPT, "max_tokens": 32, "stream": stream}
    if greedy:
        fields["temperature"] = 0
    body = json.dumps(fields).encode()
    req = urllib.request.Request(
        url + "/v1/completions",
        data=body,
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            if not stream:
                out = json.loads(r.read())
                stalls = out.get("moe_cluster", {}).get("stalls_s", [])
                if not out.get("choices"):
                    return "other", f"no choices: {out}", stalls
                return _checked(out, expect, stalls)
            events = [
                line[6:].strip()
                for line in (raw.decode() for raw in r)
                if line.startswith("data: ")
            ]
    except urllib.error.HTTPError as exc:
        if exc.code == 503 and not exc.headers.get("Retry-After"):
            return "no_retry_after", f"HTTP 503 without Retry-After: {exc.read()[:200]!r}", []
        outcome = "unavailable" if exc.code == 503 else "other"
        return outcome, f"HTTP {exc.code}: {exc.read()[:200]!r}", []
    except (
        http.client.IncompleteRead,
        ConnectionResetError,
        http.client.RemoteDisconnected,
    ) as exc:
        if expect is not None:  # a coordinator soak: only its death closes a connection
            return "cut", f"{type(exc).__name__}: {exc}", []
        return "other", f"{type(exc).__name__}: {exc}", []
    except TimeoutError:
        return "hung", f"no answer within {timeout_s:g} s", []
    except (OSError, ValueError) as exc:  # a connection dropped, a body that is not JSON
        if "timed out" in str(exc):
            return "hung", f"no answer within {timeout_s:g} s", []
        return "other", f"{type(exc).__name__}: {exc}", []
    if not events or events[-1] != "[DONE]":
        if expect is not None:  # the coordinator died mid-stream: the connection just ended
            return "cut", f"stream ended without [DONE]: {events[-2:]}", []
        return "other", f"stream ended without [DONE]: {events[-2:]}", []
    errors = [json.loads(e)["error"] for e in events[:-1] if e.startswith("{") and '"error"' in e]
    if errors:  # the cluster did not come back in time: an error event, then [DONE]
        return (
            ("unavailable" if errors[0].get("code") == "cluster_degraded" else "other"),
            errors[0].get("message", ""),
            [],
        )
    final = json.loads(events[-2]) if len(events) > 1 and events[-2].startswith("{") else {}
    return _checked(final, expect, final.get("moe_cluster", {}).get("stalls_s", []))


def _checked(out: dict, expect: list | None, stalls: list[float]) -> tuple[str, str, list[float]]:
    """ok, or wrong where the answer's tokens are not `expect` (None: not checked)."""
    got = out.get("moe_cluster", {}).get("tokens")
    if expect is not None and got != expect:
        return "wrong", f"tokens {got} are not {expect}", stalls
    return "ok", "", stalls


def _client(
    url: str, stop: threading.Event, timeout_s: float, tally: Tally, expect: list | None = None
) -> None:
    stream = False
    while not stop.is_set():
        t0 = time.monotonic()
        outcome, detail, stalls = _one_request(url, stream, timeout_s, expect, expect is not None)
        tally.add(outcome, time.monotonic() - t0, detail, stalls)
        if outcome == "cut":
            continue  # sent again, as it was (a client retries what a dead coordinator lost)
        stream = not stream
        if outcome == "unavailable":
            stop.wait(
                RETRY_S
            )  # as a client honouring Retry-After (2 s) would, but keeping up the pressure


def _watch_kill(url: str, kill: Kill, t_kill: float) -> None:
    """Fill in detect and recovery by polling /health."""
    deadline = t_kill + DETECT_WAIT_S
    while time.monotonic() < deadline:
        if _get(url, "/health")[0] != 200:
            kill.detect_s = time.monotonic() - t_kill
            break
        time.sleep(POLL_S)
    deadline = t_kill + RECOVER_WAIT_S
    while time.monotonic() < deadline:
        if _get(url, "/health")[0] == 200:
            kill.recovery_s = time.monotonic() - t_kill
            return
        time.sleep(POLL_S)


def _wait_ready(url: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _get(url, "/health")[0] == 200:
            return True
        time.sleep(POLL_S)
    return False


@dataclass(frozen=True)
class Soak:
    """One soak: its cluster, how long it lasts, how often it kills, and each request's timeout."""

    nodes: int
    model: str
    minutes: float
    kill_every_s: float
    request_timeout_s: float
    log_dir: str | None = None  # the cluster's logs; None: a temporary folder


def _kill_every(
    url: str, soak: Soak, t0: float, victim: Callable[[], tuple[str, int] | None], kills: list
) -> None:
    """Until the soak's time is up, SIGKILL the process `victim()` names (name, pid; None: none
    now) every kill_every_s; each kill's detection and recovery are timed before the next."""
    duration = 60.0 * soak.minutes
    next_kill = t0 + soak.kill_every_s
    while next_kill < t0 + duration:
        time.sleep(max(0.0, next_kill - time.monotonic()))
        who = victim()
        if who is None:
            next_kill = time.monotonic() + soak.kill_every_s
            continue
        kill = Kill(round(time.monotonic() - t0, 2), *who)
        t_kill = time.monotonic()
        try:
            os.kill(kill.pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        kills.append(kill)
        _watch_kill(url, kill, t_kill)  # the next kill comes after the recovery
        next_kill = max(t_kill + soak.kill_every_s, time.monotonic())
    time.sleep(max(0.0, t0 + duration - time.monotonic()))


def run(soak: Soak) -> dict:
    """The soak with a node SIGKILLed every `kill_every_s`, the nodes in turn (see the module)."""
    kills: list[Kill] = []
    tally = Tally()
    log_dir = Path(soak.log_dir) if soak.log_dir else None
    with local_cluster(soak.nodes, soak.model, "256MB", log_dir=log_dir) as url:
        stop = threading.Event()
        client = threading.Thread(
            target=_client, args=(url, stop, soak.request_timeout_s, tally), daemon=True
        )
        turn = itertools.count()

        def node() -> tuple[str, int] | None:
            members = _get(url, "/v1/cluster/status")[1].get("nodes", [])
            i = next(turn)
            victim = members[i % len(members)] if members else None
            if not victim or not victim.get("pid"):
                return None
            return victim["name"], victim["pid"]

        t0 = time.monotonic()
        client.start()
        try:
            _kill_every(url, soak, t0, node, kills)
        finally:
            stop.set()
            client.join(soak.request_timeout_s + 5)
        ready = _wait_ready(url, FINAL_WAIT_S)
        last = _one_request(url, False, soak.request_timeout_s)[0] if ready else "unavailable"
        state = _get(url, "/v1/cluster/status")[1]
    out = _report(soak, tally, kills)
    out["kill"] = "node"
    out["final"] = {
        "ready": ready,
        "request": last,
        "state": state.get("state"),
        "nodes": {n["name"]: n["state"] for n in state.get("nodes", [])},
    }
    return out


def run_coordinator(soak: Soak) -> dict:
    """The soak with `up` SIGKILLed every `kill_every_s` under `supervise` (see the module)."""
    import tempfile

    kills: list[Kill] = []
    tally = Tally()
    timeout_s = soak.request_timeout_s
    with tempfile.TemporaryDirectory(prefix="moe-soak-") as tmp:
        workdir = Path(soak.log_dir) if soak.log_dir else Path(tmp)
        with loopback(workdir, soak.nodes, soak.model) as lb:
            sup = Coordinator(lb, command="supervise", log_name="supervise.log")
            try:
                sup.wait_ready(600)
                pids = [a.proc.pid for a in lb.agents]
                expect = _tokens(lb.url, timeout_s)
                stop = threading.Event()
                client = threading.Thread(
                    target=_client,
                    args=(lb.url, stop, timeout_s, tally, expect),
                    daemon=True,
                )

                def coordinator() -> tuple[str, int] | None:
                    pid = lb.state().get("pid")
                    return ("coordinator", pid) if pid else None

                t0 = time.monotonic()
                client.start()
                try:
                    _kill_every(lb.url, soak, t0, coordinator, kills)
                finally:
                    stop.set()
                    client.join(timeout_s + 5)
                ready = _wait_ready(lb.url, FINAL_WAIT_S)
                last = (
                    _one_request(lb.url, False, timeout_s, expect, greedy=True)[0]
                    if ready
                    else "unavailable"
                )
                state = _get(lb.url, "/v1/cluster/status")[1]
                same_nodes = [a.proc.pid for a in lb.agents if a.proc.poll() is None] == pids
                restarts = sum("moe-cluster supervise: up died" in line for line in sup.lines)
                adopted = sum("adopted" in line and "ready" in line for line in sup.lines)
            finally:
                sup.stop()
    out = _report(soak, tally, kills)
    out["kill"] = "coordinator"
    out["requests"]["failed"] = (
        tally.other + tally.hung + tally.wrong + tally.no_retry_after
    )  # a 503 with Retry-After is an answer; a cut request was sent again
    out["final"] = {
        "ready": ready,
        "request": last,
        "state": state.get("state"),
        "nodes": {n["name"]: n["state"] for n in state.get("nodes", [])},
        "node_processes_unchanged": same_nodes,
        "coordinator_restarts": restarts,
        "ready_lines_adopted": adopted,
    }
    return out


def _tokens(url: str, timeout_s: float) -> list | None:
    """The greedy answer's tokens every later answer must repeat."""
    body = json.dumps({"prompt": PROMPT, "max_tokens": 32, "temperature": 0}).encode()
    req = urllib.request.Request(
        url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())["moe_cluster"]["tokens"]


def _report(soak: Soak, tally: Tally, kills: list[Kill]) -> dict:
    lat = sorted(tally.latencies)
    detects = [k.detect_s for k in kills if k.detect_s is not None]
    recoveries = [k.recovery_s for k in kills if k.recovery_s is not None]
    stalls = sorted(tally.stalls)
    return {
        "nodes": soak.nodes,
        "model": soak.model,
        "minutes": soak.minutes,
        "kill_every_s": soak.kill_every_s,
        "request_timeout_s": soak.request_timeout_s,
        "requests": {
            "total": len(lat),
            "ok": tally.ok,
            "503": tally.unavailable,
            "other": tally.other,
            "hung": tally.hung,
            "cut": tally.cut,
            "wrong": tally.wrong,
            "503_without_retry_after": tally.no_retry_after,
            "failed": len(lat) - tally.ok,
            "resumed": len(stalls),
        },
        # seconds without a token at each resume, from the last token before the kill to the next
        "stall_s": {
            "count": len(stalls),
            "min": stalls[0] if stalls else None,
            "p50": _quantile(stalls, 0.5),
            "p90": _quantile(stalls, 0.9),
            "max": stalls[-1] if stalls else None,
        },
        "latency_s": {
            "max": round(tally.max_latency_s, 3),
            "p50": round(lat[len(lat) // 2], 3) if lat else None,
            "p99": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3) if lat else None,
        },
        "kills": [asdict(k) for k in kills],
        "detect_s_max": round(max(detects), 3) if detects else None,
        "recovery_s_max": round(max(recoveries), 3) if recoveries else None,
        "undetected": sum(k.detect_s is None for k in kills),
        "unrecovered": sum(k.recovery_s is None for k in kills),
        "other_errors": tally.other_errors,
    }


def _quantile(values: list[float], q: float) -> float | None:
    """The q-quantile of sorted `values` (nearest rank), rounded to ms; None when there are none."""
    return round(values[min(len(values) - 1, int(q * len(values)))], 3) if values else None


def passed(out: dict) -> bool:
    """The soak's verdict: no request failed or hung, every kill recovered, and the cluster ends
    ready and serving."""
    return (
        out["requests"]["failed"] == 0
        and out["unrecovered"] == 0
        and out["final"]["ready"]
        and out["final"]["request"] == "ok"
        and out["final"].get("node_processes_unchanged", True)
    )


def main(args) -> int:
    if args.kill_every > 60.0 * args.minutes:
        raise UserError(
            f"--kill-every {args.kill_every:g} s is longer than the soak (--minutes {args.minutes:g}): "
            "nothing would be killed"
        )
    soak = Soak(
        args.nodes, args.model, args.minutes, args.kill_every, args.request_timeout, args.log_dir
    )
    out = (run_coordinator if args.kill == "coordinator" else run)(soak)
    for k in out["kills"]:
        k.update({key: round(v, 3) for key, v in k.items() if isinstance(v, float)})
    if args.json:
        print(json.dumps(out))
    else:
        r = out["requests"]
        st = out["stall_s"]
        print(
            f"{r['total']} requests in {out['minutes']:g} min, {len(out['kills'])} "
            f"{out['kill']}s killed: {r['ok']} ok, {r['failed']} failed ({r['503']} 503, "
            f"{r['other']} other, {r['hung']} hung, {r['wrong']} wrong tokens, {r['cut']} cut "
            f"and sent again), {r['resumed']} resumes (stall p50 {st['p50']} s, "
            f"p90 {st['p90']} s, max {st['max']} s); "
            f"max latency {out['latency_s']['max']:.2f} s; detect ≤ {out['detect_s_max']} s, "
            f"recovery ≤ {out['recovery_s_max']} s; final: {out['final']['state']}"
        )
    return 0 if passed(out) else 1

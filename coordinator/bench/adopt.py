"""`moe-cluster bench adopt`: the coordinator dies while streams decode, and a new one adopts the
loaded nodes.

Node agents run on loopback on their own (bench/loopback.py: `launch: remote`, as under their
services), and `up` on them:
1. `up` loads the nodes afresh: the full load, from its start to its ready line (and the load
   alone, as `up` says it);
2. the reference: `--streams` greedy requests at once, their tokens;
3. the same prompts streamed at once with more tokens; once each has `--cut` tokens, `kill -9` of
   `up` (or SIGSTOP with `--fault stop`: a hung coordinator, whose streams stay open); each node's
   Status is polled until nothing runs there: the seconds the nodes took to drop the orphans;
4. a new `up` on the same file: seconds from its start to its ready line, whether it adopted,
   each node's pid (the same: no node restarted) and the bytes each read meanwhile (/proc's rchar:
   a shard is read with readinto, so a load reads at least its shard; sockets count too), what a
   client polling the API got meanwhile (503 with Retry-After, then 200);
5. the reference requests again: the same tokens.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import tempfile
import threading
import time
from pathlib import Path

from ...proto.errors import UserError
from .loopback import SECRET, Coordinator, Loopback, loopback, read_bytes

PROMPTS = [
    "To be, or not to be, that is the question:",
    "Friends, Romans, countrymen, lend me your ears;",
    "Now is the winter of our discontent",
    "All the world's a stage,",
    "If music be the food of love, play on;",
    "O Romeo, Romeo! wherefore art thou Romeo?",
    "The quality of mercy is not strained;",
    "Once more unto the breach, dear friends, once more;",
]
POLL_S = 0.02  # seconds between Status polls of the nodes
DROP_WAIT_S = 30.0
STREAM_TOKENS = 400  # each cut stream's max_tokens: decoding still when `up` dies (demo: 2048 ctx)  # orphans not dropped within this long are reported as not dropped
READY_WAIT_S = 600.0


def add_arguments(b) -> None:
    b.add_argument("--model", default="demo", help="a checkpoint folder or 'demo'")
    b.add_argument("--nodes", type=int, default=2)
    b.add_argument("--streams", type=int, default=8, help="greedy streams at once")
    b.add_argument("--tokens", type=int, default=16, help="tokens of each reference")
    b.add_argument("--cut", type=int, default=3, help="tokens each stream has when up is killed")
    b.add_argument(
        "--fault",
        choices=("kill", "stop"),
        default="kill",
        help="kill -9 of up (its streams close), or SIGSTOP (a hung up: timeouts.coordinator)",
    )
    b.add_argument(
        "--coordinator-timeout",
        default="10s",
        help="cluster.yaml timeouts.coordinator (what --fault stop waits out)",
    )
    b.add_argument("--workdir", default=None, help="keep the logs and the cluster.yaml here")
    b.add_argument("--json", action="store_true")


def _completion(url: str, prompt: str, max_tokens: int, timeout_s: float = 600.0) -> list[int]:
    """A greedy completion's token ids (the API's moe_cluster.tokens)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        out = json.loads(r.read())
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {out}")
        return list(out["moe_cluster"]["tokens"])
    finally:
        conn.close()


def _together(url: str, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """The prompts' greedy tokens, all sent at once (they decode in one batch)."""
    out: list = [None] * len(prompts)

    def one(i: int) -> None:
        try:
            out[i] = _completion(url, prompts[i], max_tokens)
        except Exception as exc:  # noqa: BLE001 - reported in the result
            out[i] = f"{type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


class _Stream(threading.Thread):
    """A streamed completion, counting its token events until the connection ends."""

    def __init__(self, url: str, prompt: str, max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.prompt, self.max_tokens = url, prompt, max_tokens
        self.events = 0
        self.ended = ""  # how it ended: done | closed | error text

    def run(self) -> None:
        host, port = self.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=120)
        try:
            body = json.dumps(
                {"prompt": self.prompt, "max_tokens": self.max_tokens, "stream": True}
            )
            conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            r = conn.getresponse()
            for raw in r:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    self.ended = "done"
                    return
                if line.startswith("data: {") and '"choices"' in line:
                    self.events += 1
            self.ended = "closed"
        except (OSError, http.client.HTTPException) as exc:
            self.ended = f"closed ({type(exc).__name__})"
        finally:
            conn.close()


def _running(lb: Loopback) -> list[tuple[int, int]]:
    """(requests running or queued, streams attended) on each node, from its Status."""
    import grpc

    from ...common.auth import call_metadata
    from ...proto import convert
    from ...proto import node_pb2_grpc as npb_grpc

    out = []
    for a in lb.agents:
        with grpc.insecure_channel(a.address) as ch:
            s = convert.status_from_proto(
                npb_grpc.NodeStub(ch).Status(
                    convert.status_request_to_proto(), timeout=5, metadata=call_metadata(SECRET)
                )
            )
        out.append((s.queue_depth, s.streams))
    return out


class _Poller(threading.Thread):
    """A client sending a one-token completion every `every_s` while `up` restarts: what it got
    (connection refused, 503 and its Retry-After, 200), until the first 200."""

    def __init__(self, url: str, every_s: float = 0.2):
        super().__init__(daemon=True)
        self.url, self.every_s = url, every_s
        self.t0 = time.monotonic()
        self.seen: list[tuple[float, str]] = []  # (seconds, what)
        self.stop = threading.Event()

    def run(self) -> None:
        host, port = self.url.removeprefix("http://").split(":")
        while not self.stop.is_set():
            t = time.monotonic() - self.t0
            conn = http.client.HTTPConnection(host, int(port), timeout=30)
            try:
                body = json.dumps({"prompt": "Hello", "max_tokens": 1})
                conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
                r = conn.getresponse()
                r.read()
                what = f"{r.status}" + (
                    f" Retry-After {r.getheader('Retry-After')}"
                    if r.getheader("Retry-After")
                    else ""
                )
            except OSError as exc:
                what = type(exc).__name__
            finally:
                conn.close()
            self.seen.append((round(t, 2), what))
            if what == "200":
                return
            self.stop.wait(self.every_s)

    def summary(self) -> dict:
        kinds: dict[str, int] = {}
        for _, w in self.seen:
            kinds[w] = kinds.get(w, 0) + 1
        first = next((t for t, w in self.seen if w == "200"), None)
        return {"answers": kinds, "first_200_s": first}


def run(
    model: str,
    nodes: int,
    streams: int,
    tokens: int,
    cut: int,
    fault: str,
    coordinator_timeout: str,
    workdir: Path,
) -> dict:
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(streams)]
    extra = f"timeouts:\n  coordinator: {coordinator_timeout}\n"
    with loopback(workdir, nodes, model, extra) as lb:
        pids = [a.proc.pid for a in lb.agents]
        fresh = [read_bytes(p) for p in pids]
        first = Coordinator(lb, log_name="up-1.log")
        try:
            full_s = first.wait_ready(READY_WAIT_S)
            full_read = _read_since(pids, fresh)
            loaded = _said(first.lines, "loaded in ")
            reference = _together(lb.url, prompts, tokens)
            # the streams, cut once each has `cut` tokens
            live = [_Stream(lb.url, p, STREAM_TOKENS) for p in prompts]
            for s in live:
                s.start()
            deadline = time.monotonic() + 120
            while not all(s.events >= cut for s in live) and time.monotonic() < deadline:
                time.sleep(0.01)
            on_nodes = _running(lb)
            t_fault = time.monotonic()
            os.kill(first.proc.pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
            drop_s: list[float | None] = [None] * nodes
            while time.monotonic() - t_fault < DROP_WAIT_S and None in drop_s:
                for i, (queued, attended) in enumerate(_running(lb)):
                    if drop_s[i] is None and queued == 0 and attended == 0:
                        drop_s[i] = round(time.monotonic() - t_fault, 3)
                time.sleep(POLL_S)
            if fault == "stop":
                os.kill(first.proc.pid, signal.SIGKILL)  # ends a stopped process too
            first.proc.wait(timeout=30)
            for s in live:
                s.join(timeout=30)
        finally:
            first.stop()
        before = [read_bytes(p) for p in pids]
        poller = _Poller(lb.url)
        second = Coordinator(lb, log_name="up-2.log")
        poller.start()
        try:
            again_s = second.wait_ready(READY_WAIT_S)
            read = _read_since(pids, before)
            poller.join(timeout=60)
            adopted = _said(second.lines, "adopted in ")
            repeat = _together(lb.url, prompts, tokens)
        finally:
            poller.stop.set()
            second.stop()
        still = [a.proc.pid for a in lb.agents if a.proc.poll() is None]
    return {
        "model": model,
        "nodes": nodes,
        "streams": streams,
        "fault": fault,
        "coordinator_timeout": coordinator_timeout,
        "full_load": {
            "start_to_ready_s": round(full_s, 2),
            "load_s": loaded,
            "node_bytes_read": full_read,
        },
        "streams_on_nodes_at_fault": on_nodes,
        "stream_tokens_at_fault": [s.events for s in live],
        "streams_ended": sorted({s.ended for s in live}),
        "orphans_dropped_s": drop_s,
        "restart": {
            "start_to_ready_s": round(again_s, 2),
            "adopted": adopted is not None,
            "adopt_s": adopted,
            "ready_vs_full": round(again_s / full_s, 3) if full_s else None,
            "node_pids_unchanged": sorted(still) == sorted(pids),
            "node_bytes_read": read,
            "client_while_restarting": poller.summary(),
        },
        "same_tokens": reference == repeat,
        "reference": reference,
        "after": repeat,
        "lines": {"first": _load_lines(first.lines), "second": _load_lines(second.lines)},
    }


def _read_since(pids: list[int], before: list[int | None]) -> list[int | None]:
    """Bytes each process read since `before` (read_bytes), None where unknown."""
    now = [read_bytes(p) for p in pids]
    return [b - a if a is not None and b is not None else None for a, b in zip(before, now)]


def _said(lines: list[str], what: str) -> float | None:
    """The seconds in `up`'s ready line after `what` ("loaded in ", "adopted in ")."""
    for line in lines:
        if "moe-cluster ready" in line and what in line:
            return float(line.split(what)[1].split("s")[0])
    return None


def _load_lines(lines: list[str]) -> list[str]:
    keep = ("adopted", "adopt", "loaded", "load check", "moe-cluster ready", "shipped")
    return [line for line in lines if any(k in line for k in keep)][:10]


def passed(out: dict) -> bool:
    return (
        out["restart"]["adopted"]
        and out["restart"]["node_pids_unchanged"]
        and out["same_tokens"]
        and None not in out["orphans_dropped_s"]
    )


def main(args) -> int:
    if not 1 <= args.cut < STREAM_TOKENS:
        raise UserError(f"--cut {args.cut} must be 1 to {STREAM_TOKENS - 1}")
    with tempfile.TemporaryDirectory(prefix="moe-bench-adopt-") as tmp:
        workdir = Path(args.workdir).expanduser() if args.workdir else Path(tmp)
        out = run(
            args.model,
            args.nodes,
            args.streams,
            args.tokens,
            args.cut,
            args.fault,
            args.coordinator_timeout,
            workdir,
        )
    if args.json:
        print(json.dumps(out))
    else:
        r = out["restart"]
        print(
            f"{out['model']}: full load ready in {out['full_load']['start_to_ready_s']} s "
            f"(load {out['full_load']['load_s']} s); {out['fault']} of up with "
            f"{out['streams']} streams decoding: orphans dropped after {out['orphans_dropped_s']} s; "
            f"new up ready in {r['start_to_ready_s']} s ({'adopted' if r['adopted'] else 'LOADED'}"
            f", {r['ready_vs_full']:.0%} of the full load), node bytes read {r['node_bytes_read']}, "
            f"same nodes {r['node_pids_unchanged']}, same tokens {out['same_tokens']}; "
            f"meanwhile a client got {r['client_while_restarting']}"
        )
    return 0 if passed(out) else 1

"""Start `moe-cluster up` as a user would, wait for its ready line, and stop it cleanly."""

from __future__ import annotations

import json
import functools
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

READY = re.compile(r"moe-cluster ready: (http://\S+)")


def http(
    url: str, path: str, body: dict | None = None, timeout: float = 120, headers: dict | None = None
):
    """(status, parsed JSON) of one request; errors come back as their status and body."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        url + path,
        data=data,
        method="POST" if body is not None else "GET",
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            return r.status, json.loads(raw) if raw.startswith((b"{", b"[")) else raw.decode()
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw)
        except ValueError:
            return exc.code, raw.decode()


def health_during(
    url: str, sender, limit_s: float, pause_s: float, join_s: float
) -> tuple[list[float], float]:
    """Start thread `sender` and time GET /health on one warm connection until it ends (`limit_s` at
    most): (seconds of each /health, seconds until the sender ended). Every /health must be 200."""
    import urllib.parse
    from http.client import HTTPConnection

    u = urllib.parse.urlsplit(url)
    conn = HTTPConnection(u.hostname, u.port, timeout=10)
    conn.request("GET", "/health")  # connected and warm before the sender starts
    conn.getresponse().read()
    t0 = time.monotonic()
    sender.start()
    latencies = []
    try:
        while sender.is_alive() and time.monotonic() - t0 < limit_s:
            t = time.perf_counter()
            conn.request("GET", "/health")
            r = conn.getresponse()
            r.read()
            latencies.append(time.perf_counter() - t)
            assert r.status == 200
            time.sleep(pause_s)
    finally:
        conn.close()
        sender.join(join_s)
    return latencies, time.monotonic() - t0


def stock_tokens(path, prompt: str, max_tokens: int) -> list[int]:
    """Stock mlx-lm's greedy tokens as the cluster returns them: at most max_tokens, no EOS.
    Never empty, so a comparison with it cannot pass on an empty reply. Asked again, the same
    answer without loading the model again."""
    return list(_stock_tokens(str(path), prompt, max_tokens))


@functools.cache
def _stock_tokens(path: str, prompt: str, max_tokens: int) -> tuple[int, ...]:
    from mlx_lm import load, stream_generate

    model, tok = load(str(path))
    out = list(stream_generate(model, tok, prompt, max_tokens=max_tokens))
    # the last response carries the last token when max_tokens ran out, the EOS token otherwise
    tokens = [r.token for r in out[:-1]] + (
        [out[-1].token] if out[-1].finish_reason == "length" else []
    )
    assert tokens, f"stock mlx-lm stops at once on {prompt!r}: pick a prompt it continues"
    return tuple(tokens)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


@contextmanager
def cluster(
    tmp_path: Path,
    yaml_text: str,
    *args: str,
    env: dict | None = None,
    timeout: float = 180,
    netns: str | None = None,
    api_key: str | None = None,
    on_line=None,
):
    """Run `moe-cluster up` on a cluster.yaml; yields (url, process, output lines).

    `api_key`: the key the cluster.yaml configures, sent on the fixture's own calls (status, shutdown).
    `on_line`: called with each line of `up`'s output as it comes (on the reader's thread).
    """
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else None
    cfg = tmp_path / "cluster.yaml"
    cfg.write_text(yaml_text)
    cmd = [
        sys.executable,
        "-m",
        "moe_cluster.coordinator.cli",
        "up",
        str(cfg),
        "--api-port",
        "0",
        "--log-dir",
        str(tmp_path / "logs"),
        *args,
    ]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", XDG_RUNTIME_DIR=str(tmp_path), **(env or {}))
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full_env,
        start_new_session=True,
    )
    lines: list[str] = []
    url = None
    found = threading.Event()

    def read():
        nonlocal url
        for line in proc.stdout:
            lines.append(line.rstrip())
            if on_line is not None:
                on_line(line.rstrip())
            m = READY.search(line)
            if m and url is None:
                url = m.group(1)
                found.set()
        found.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    pids: list[int] = []
    try:
        found.wait(timeout)
        if url is None:
            raise AssertionError("cluster did not become ready:\n" + "\n".join(lines[-40:]))
        status = http(url, "/v1/cluster/status", headers=auth)[1]
        pids = [n["pid"] for n in status["nodes"] if n.get("pid")]  # only nodes `up` launched
        yield url, proc, lines
    finally:
        if proc.poll() is None:
            if url:
                try:
                    http(url, "/v1/cluster/shutdown", {}, timeout=10, headers=auth)
                except OSError:
                    pass  # a coordinator that does not answer is killed below, never left running
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        reader.join(timeout=5)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        leftover = [p for p in pids if _alive(p)]
        for p in leftover:
            os.kill(p, signal.SIGKILL)
        assert not leftover, f"node processes left behind: {leftover}"


def yaml_for(nodes: int, model: str = "demo", extra: str = "", launch: str = "local") -> str:
    names = "\n".join(f"  - name: node-{i}" for i in range(nodes))
    return f"""name: test-cluster
model: {model}
launch: {launch}
nodes:
{names}
timeouts:
  collective: 3s
  heartbeat: 0.5s
{extra}"""


def keyed_yaml(nodes: int, model: str = "demo", key_env: str = "MOE_TEST_API_KEY") -> str:
    """yaml_for with an API key read from `key_env`, and heartbeats every 2 s: on a loaded 2-core
    machine with Chromium running, 0.5 s can call a busy node dead."""
    yaml = yaml_for(nodes, model=model, extra=f"api:\n  api_key_env: {key_env}\n")
    return yaml.replace("heartbeat: 0.5s", "heartbeat: 2s")

"""`moe-cluster supervise`: `up` restarted whenever it dies, the API's socket held meanwhile, so a
client is never refused: it gets the 503 with Retry-After of `up`'s starting page, or waits in the
socket's backlog for the next `up`. Here `up` dies on each start (its one node does not answer),
and the supervisor starts it again; SIGTERM then ends the supervisor."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time

from moe_cluster.common.ports import free_ports


def test_up_restarted_and_no_client_refused(tmp_path):
    api, dead = free_ports(2)  # nothing listens on `dead`: up cannot meet its node
    secret = tmp_path / "secret"
    secret.write_text("supervise-test-secret")
    yaml = tmp_path / "cluster.yaml"
    yaml.write_text(
        f"name: sup\nmodel: demo\nlaunch: remote\nnodes:\n  - name: n0\n"
        f"    address: 127.0.0.1:{dead}\nsecret:\n  file: {secret}\napi:\n  port: {api}\n"
    )
    env = dict(os.environ, PYTHONUNBUFFERED="1", XDG_RUNTIME_DIR=str(tmp_path))
    log = tmp_path / "supervise.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "moe_cluster.coordinator.cli", "supervise", str(yaml)],
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    answers = []
    try:
        deadline = time.monotonic() + 60
        while "holding" not in log.read_text():  # the socket is bound: from now on, no refusal
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        after = 0  # answers sent once the first `up` had died: the next one's, or the backlog's
        while not after and time.monotonic() < deadline:
            after += "up died" in log.read_text()
            conn = http.client.HTTPConnection("127.0.0.1", api, timeout=30)
            try:
                conn.request("POST", "/v1/completions", json.dumps({"prompt": "Hi"}))
                r = conn.getresponse()
                answers.append((r.status, r.getheader("Retry-After"), json.loads(r.read())))
            finally:
                conn.close()
            time.sleep(0.3)
        text = log.read_text()
        assert "up died (status 1)" in text and "restart 1" in text, text
        assert f"holding 127.0.0.1:{api}" in text and after, text
        for status, retry_after, body in answers:  # never refused: the socket outlives each up
            assert status == 503 and int(retry_after) >= 1, (status, retry_after, body)
            assert body["error"]["code"] == "not_ready", body
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

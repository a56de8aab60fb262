"""A small Hugging Face hub on loopback, for the real `huggingface_hub` client (HF_ENDPOINT).

It answers the calls huggingface_hub 2.x makes to fetch a snapshot (read from its source):
`GET /api/models/{repo}/revision/{rev}` (the commit), `GET /api/models/{repo}/tree/{rev}` (the
files with sizes), `HEAD` and `GET /{repo}/resolve/{rev}/{file}` with `X-Repo-Commit`, `ETag` and
`Content-Length`, and `Range: bytes=N-` (206) for a resumed file. Errors carry the headers the
client reads (`X-Error-Code`: RepoNotFound, RevisionNotFound, GatedRepo; `X-Error-Message` for a
refused token). Every request is logged, so tests count what was fetched, and faults can be set
per file: cut the body once after half its bytes, answer 500 once, hold the body until an event,
or send it slowly.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

GOOD_TOKEN = "hf_test_good"  # the one token the hub accepts (for a gated repo)


@dataclass
class Repo:
    files: dict[str, bytes]
    gated: bool = False
    commit: str = ""

    def __post_init__(self):
        if not self.commit:
            digest = hashlib.sha1()
            for name in sorted(self.files):
                digest.update(name.encode() + hashlib.sha1(self.files[name]).digest())
            self.commit = digest.hexdigest()

    def etag(self, name: str) -> str:
        return hashlib.sha256(self.files[name]).hexdigest()


@dataclass
class Faults:
    cut_once: set[str] = field(default_factory=set)  # files whose first GET stops halfway
    fail_once: set[str] = field(default_factory=set)  # files whose first GET answers 500
    hold: dict[str, threading.Event] = field(default_factory=dict)  # GET waits for the event
    claimed_size: dict[str, int] = field(default_factory=dict)  # sizes the hub lies about
    slow: set[str] = field(default_factory=set)  # files sent at about 3 MB/s


class Hub:
    """`with Hub({...}) as hub:` serves the repos on http://127.0.0.1:PORT (hub.url)."""

    def __init__(self, repos: dict[str, Repo]):
        self.repos = repos
        self.faults = Faults()
        self.log: list[tuple[str, str, str]] = []  # (method, path, Range header)
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "Hub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        for event in self.faults.hold.values():
            event.set()
        self.server.shutdown()
        self.server.server_close()

    def reset(self) -> None:
        with self.lock:
            self.log.clear()
        self.faults = Faults()

    def gets(self, repo: str | None = None) -> list[str]:
        """Files whose bytes were requested (GET of resolve), in order, repeats kept."""
        out = []
        for method, path, _ in list(self.log):
            m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/[^/]+/(.+)", path)
            if method == "GET" and m and (repo is None or m[1] == repo):
                out.append(m[2])
        return out

    def ranges(self) -> list[tuple[str, str]]:
        """(path, Range) of the requests that asked for part of a file."""
        return [(p, r) for _, p, r in list(self.log) if r]


def _handler(hub: Hub):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet: the hub's log is `hub.log`
            pass

        def _json(self, status: int, body, headers: dict | None = None) -> None:
            raw = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(raw)

        def _refuse(self, repo_name: str) -> tuple[Repo | None, bool]:
            """(the repo, True) where the request may read it; else answers and (None, False)."""
            token = self.headers.get("Authorization", "")[len("Bearer ") :]
            if token and token != GOOD_TOKEN:
                self._json(
                    401,
                    {"error": "Invalid credentials in Authorization header"},
                    {"X-Error-Message": "Invalid credentials in Authorization header"},
                )
                return None, False
            repo = hub.repos.get(repo_name)
            if repo is None:
                self._json(
                    404,
                    {"error": "Repository not found"},
                    {"X-Error-Code": "RepoNotFound", "X-Error-Message": "Repository not found"},
                )
                return None, False
            if repo.gated and token != GOOD_TOKEN:
                self._json(
                    403,
                    {"error": "Access to this model is restricted"},
                    {"X-Error-Code": "GatedRepo", "X-Error-Message": "Access restricted"},
                )
                return None, False
            return repo, True

        def _revision(self, repo: Repo, rev: str) -> bool:
            if rev in ("main", repo.commit):
                return True
            self._json(
                404,
                {"error": f"Invalid rev id: {rev}"},
                {"X-Error-Code": "RevisionNotFound", "X-Error-Message": "Invalid rev id"},
            )
            return False

        def do_HEAD(self):
            self._serve()

        def do_GET(self):
            self._serve()

        def _serve(self):
            path = urlsplit(self.path).path
            with hub.lock:
                hub.log.append((self.command, unquote(path), self.headers.get("Range", "")))
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/(revision|tree)/([^/]+)", path)
            if m:
                repo, ok = self._refuse(m[1])
                if not ok or not self._revision(repo, unquote(m[3])):
                    return
                if m[2] == "revision":
                    siblings = [{"rfilename": n} for n in sorted(repo.files)]
                    body = {"id": m[1], "sha": repo.commit, "siblings": siblings, "private": False}
                    return self._json(200, {**body, "gated": "auto" if repo.gated else False})
                entries = []
                for name in sorted(repo.files):
                    size = hub.faults.claimed_size.get(name, len(repo.files[name]))
                    oid = hashlib.sha1(repo.files[name]).hexdigest()
                    entry = {"type": "file", "oid": oid, "size": size, "path": name}
                    if name.endswith(".safetensors"):
                        lfs = {"oid": repo.etag(name), "size": size, "pointerSize": 134}
                        entry["lfs"] = lfs
                    entries.append(entry)
                return self._json(200, entries)
            m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
            if not m:
                return self._json(404, {"error": "no such endpoint"})
            repo, ok = self._refuse(m[1])
            if not ok or not self._revision(repo, unquote(m[2])):
                return
            name = unquote(m[3])
            if name not in repo.files:
                return self._json(
                    404,
                    {"error": "Entry not found"},
                    {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": repo.commit},
                )
            self._file(repo, name)

        def _file(self, repo: Repo, name: str) -> None:
            data = repo.files[name]
            faults = hub.faults
            if self.command == "GET" and name in faults.fail_once:
                faults.fail_once.discard(name)
                return self._json(500, {"error": "the hub failed"})
            start = 0
            rng = self.headers.get("Range")
            if rng:
                start = int(re.fullmatch(r"bytes=(\d+)-", rng)[1])
            body = data[start:]
            self.send_response(206 if rng else 200)
            self.send_header("X-Repo-Commit", repo.commit)
            self.send_header("ETag", f'"{repo.etag(name)}"')
            self.send_header("Accept-Ranges", "bytes")
            size = faults.claimed_size.get(name)
            self.send_header("Content-Length", str(size if size else len(body)))
            if rng:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if self.command == "HEAD":
                return
            if name in faults.hold:
                faults.hold[name].wait(60)
            if name in faults.cut_once:
                faults.cut_once.discard(name)
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                self.close_connection = True
                return
            if name in faults.slow:
                for i in range(0, len(body), 64 << 10):
                    self.wfile.write(body[i : i + (64 << 10)])
                    time.sleep(0.02)
                return
            self.wfile.write(body)

    return Handler


def demo_repo(tmp: Path, shard_bytes: int = 4 << 20) -> Repo:
    """The embedded demo model as a repo: its weights in shards with an index, its tokenizer, and
    files a checkpoint does not need (a README, a PyTorch copy) that must never be fetched."""
    import mlx.core as mx

    from moe_cluster.node.checkpoint import write_checkpoint
    from moe_cluster.node.demo import MODEL_DIR

    out = tmp / "demo-repo"
    config = json.loads((MODEL_DIR / "config.json").read_text())
    write_checkpoint(
        out, mx.load(str(MODEL_DIR / "model.safetensors")), config, max_shard_bytes=shard_bytes
    )
    files = {p.name: p.read_bytes() for p in out.iterdir()}
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        files[name] = (MODEL_DIR / name).read_bytes()
    files["README.md"] = b"# demo-moe\n"
    files["pytorch_model.bin"] = b"\0" * 4096
    return Repo(files)


def dense_repo() -> Repo:
    """A dense model (llama, no experts): its config, and weights that must never be fetched."""
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": 256,
    }
    return Repo({"config.json": json.dumps(config).encode(), "model.safetensors": b"\0" * 4096})

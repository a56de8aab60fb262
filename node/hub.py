"""Models by name: a Hugging Face repo id (`org/name`, `org/name@revision`) fetched into the
Hugging Face cache with `huggingface_hub`, as mlx-lm and exo resolve them.

Only the files a caller names are fetched (node/checkpoint.py says which a checkpoint needs). A
file that finished stays in the cache, so a second run fetches only what is missing; a connection
that drops within a file is resumed by the client with a Range request. Offline (HF_HUB_OFFLINE,
or no network) the cache answers alone. Every failure is one line naming the repo, and the cache
where it applies.
"""

from __future__ import annotations

import errno
import re
import shutil
import sys
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

from ..proto.errors import CancelledError, UnavailableError, UserError
from ..proto.records import fmt_bytes


# owner/name as the hub spells them, then an optional @revision (a branch, tag or commit)
_REPO_ID = re.compile(r"([A-Za-z0-9][\w.-]*)/([\w.-]+)(?:@([\w./-]+))?")


class HubError(UserError):
    """A repo that cannot be had as asked: missing, gated, refused, uncached offline, no disk."""


class DownloadStopped(UnavailableError):
    """A download that began and did not finish (the network, the hub); a second run resumes it."""


class DownloadInterrupted(CancelledError):
    """A download the user stopped (Ctrl-C, SIGTERM); a second run resumes it."""


@dataclass(frozen=True)
class RepoId:
    name: str  # owner/name
    revision: str | None = None  # None: the repo's default branch

    def __str__(self) -> str:
        return f"{self.name}@{self.revision}" if self.revision else self.name


def parse_repo_id(spec: str) -> RepoId | None:
    """The repo id `spec` names, or None when it is not one (a path: absolute, ~, ./, a/b/c).
    A folder that exists wins over a repo of the same name: the caller asks the disk first."""
    m = _REPO_ID.fullmatch(str(spec))
    if m is None or ".." in m[0] or "--" in m[2]:
        return None
    return RepoId(f"{m[1]}/{m[2]}", m[3])


@dataclass(frozen=True)
class Transfer:
    """A download as it stands: what the hub said to fetch, and what has arrived."""

    repo: str
    cache: Path  # the Hugging Face cache it goes into
    files: int
    total_bytes: int
    done_bytes: int = 0
    elapsed_s: float = 0.0

    def line(self) -> str:
        """One line for a log or a status: bytes, share, rate and time left."""
        share = self.done_bytes / self.total_bytes if self.total_bytes else 1.0
        rate = self.done_bytes / self.elapsed_s if self.elapsed_s > 0 else 0.0
        tail = (
            f", {fmt_bytes(rate)}/s, ETA {(self.total_bytes - self.done_bytes) / rate:.0f} s"
            if rate and self.done_bytes < self.total_bytes
            else ""
        )
        return (
            f"downloading {self.repo}: {fmt_bytes(self.done_bytes)} of "
            f"{fmt_bytes(self.total_bytes)} ({100 * share:.0f}%){tail}"
        )


Report = Callable[[Transfer], None]


class LogLines:
    """A download's progress on stderr: a line when it starts, then (off a terminal, where the
    hub's own bars are not drawn) a line per quarter."""

    def __init__(self, stream=None, note: str = ""):
        self.stream = stream or sys.stderr
        self.note = note  # said after the first line's figures
        self.quarter = -1
        self.lock = threading.Lock()

    def __call__(self, t: Transfer) -> None:
        with self.lock:
            if self.quarter < 0:
                self.quarter = 0
                print(
                    f"downloading {t.repo}: {t.files} files, {fmt_bytes(t.total_bytes)} into "
                    f"{t.cache}{self.note}",
                    file=self.stream,
                    flush=True,
                )
                return
            q = int(4 * t.done_bytes / t.total_bytes) if t.total_bytes else 4
            if q > self.quarter and not self.stream.isatty():
                self.quarter = q
                print(t.line(), file=self.stream, flush=True)


def cache_dir() -> Path:
    """Where the Hugging Face cache is (HF_HUB_CACHE, HF_HOME/hub, ~/.cache/huggingface/hub)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def repo_cache(repo: RepoId) -> Path:
    """The repo's folder in the cache (models--owner--name)."""
    return cache_dir() / ("models--" + repo.name.replace("/", "--"))


class _Stop(BaseException):
    """Raised from a progress callback to end a download thread (the user stopped it). A
    BaseException, so that no `except Exception` on the way swallows it."""


def fetch(
    repo: RepoId,
    patterns: Sequence[str],
    *,
    report: Report | None = None,
    cancel: threading.Event | None = None,
) -> Path:
    """The repo's files that match `patterns`, in the cache: the snapshot folder holding them.

    Args:
        repo: the repo and revision.
        patterns: glob patterns of the files to fetch (others in the repo are never fetched).
        report: called with the download's progress (from the hub's worker threads), first when it
            starts; not called when nothing needs fetching. Default: lines on stderr.
        cancel: set from elsewhere to stop the download (it raises DownloadInterrupted).
    """
    from huggingface_hub import constants

    kw = dict(repo_id=repo.name, allow_patterns=list(patterns))
    report = report if report is not None else LogLines()
    try:
        if constants.is_offline_mode():
            return Path(_snapshot(**kw, revision=repo.revision, local_files_only=True))
        todo, commit, refused = _plan(repo, kw)
        if commit is None:  # the hub cannot be reached or refused: the cache answers, or says why
            try:
                return Path(_snapshot(**kw, revision=repo.revision, local_files_only=True))
            except Exception as exc:  # noqa: BLE001 - told with the reason the hub gave
                raise explain(exc, repo, refused) from exc
        if todo:
            need = sum(f.file_size or 0 for f in todo)
            _check_disk(repo, need)
            path = _download(repo, kw, commit, todo, need, report, cancel or threading.Event())
        else:
            path = Path(_snapshot(**kw, revision=commit))  # all cached: no request
        _record_ref(repo, commit)
        return path
    except (HubError, DownloadStopped, DownloadInterrupted):
        raise
    except Exception as exc:  # noqa: BLE001 - the hub client's errors, each told as one line
        raise explain(exc, repo) from exc


def _record_ref(repo: RepoId, commit: str) -> None:
    """Record in the cache's refs/ which commit the revision asked for (a branch or tag; none: the
    default branch) named, as the hub client does when it downloads by that name, so that an
    offline run finds the snapshot by it. We download by commit, and huggingface_hub 2.5 no longer
    records it on the dry run that resolved it (2.4 did)."""
    from huggingface_hub import constants

    name = repo.revision or constants.DEFAULT_REVISION
    if name == commit:
        return
    ref = repo_cache(repo) / "refs" / name
    if ref.is_file() and ref.read_text() == commit:
        return
    ref.parent.mkdir(parents=True, exist_ok=True)
    part = ref.with_name(ref.name + ".part")
    part.write_text(commit)
    part.replace(ref)  # at once: a reader never sees half a hash


def _snapshot(*, on_bytes: Callable[[int], None] | None = None, cancel=None, **kw) -> str:
    """snapshot_download with the hub's bars where a person watches (a terminal) and none in a log,
    `on_bytes` told of every chunk that arrives, and `cancel` checked at each."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import tqdm as hf_tqdm

    class Bar(hf_tqdm):
        def __init__(self, *args, **kwargs):
            # the files bar and the two bytes bars: the bytes that arrived feed `on_bytes` once
            self.counts = kwargs.get("name") == "huggingface_hub.snapshot_download"
            if not sys.stderr.isatty():
                kwargs["disable"] = True
            super().__init__(*args, **kwargs)

        def update(self, n=1):
            if cancel is not None and cancel.is_set():
                raise _Stop()
            if self.counts and n and on_bytes is not None:
                on_bytes(int(n))
            return super().update(n)

    return snapshot_download(**kw, tqdm_class=Bar)


def _plan(repo: RepoId, kw: dict):
    """(files to fetch, commit, None) from a dry run: the client lists the repo at the revision
    and checks each matching file against the cache. (None, None, why) where the hub could not
    be asked: unreachable, or it refused (gated, missing, a bad token), told if the cache has
    nothing."""
    from huggingface_hub.errors import DryRunError

    try:
        files = _snapshot(**kw, revision=repo.revision, dry_run=True)
    except DryRunError as exc:
        return None, None, exc.__cause__ or exc
    if not files:
        raise HubError(
            f"{repo} has none of the files a checkpoint needs ({', '.join(kw['allow_patterns'])})"
        )
    return [f for f in files if f.will_download], files[0].commit_hash, None


def _check_disk(repo: RepoId, need: int) -> None:
    """Refuse before fetching what the cache's disk cannot hold."""
    where = cache_dir()
    probe = where
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if need > free:
        raise HubError(
            f"{repo} needs {fmt_bytes(need)} more in the Hugging Face cache ({where}), and its "
            f"disk has {fmt_bytes(free)} free: free some space or set HF_HUB_CACHE to a larger disk"
        )


def _download(repo, kw, commit, todo, need, report: Report, cancel: threading.Event) -> Path:
    """Fetch `todo` on a thread of its own while this one waits, so that Ctrl-C (here) or `cancel`
    (from elsewhere) stops it between two chunks; what finished stays in the cache."""
    state = Transfer(str(repo), cache_dir(), len(todo), need)
    t0 = time.monotonic()
    lock = threading.Lock()
    report(state)

    ended = threading.Event()  # set under `lock` once this thread tells the outcome

    def on_bytes(n: int) -> None:  # on the hub's worker threads
        nonlocal state
        # reported under the lock: a worker still finishing a chunk after the stop must not print
        # a progress line after the line that ends the download
        with lock:
            if ended.is_set():
                return
            state = replace(state, done_bytes=state.done_bytes + n, elapsed_s=time.monotonic() - t0)
            report(state)

    out: dict = {}

    def work():
        try:
            out["path"] = _snapshot(**kw, revision=commit, on_bytes=on_bytes, cancel=cancel)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            out["error"] = exc

    thread = threading.Thread(target=work, name=f"download {repo}", daemon=True)
    thread.start()
    try:
        while thread.is_alive() and not cancel.is_set():
            thread.join(0.2)
    except KeyboardInterrupt:
        cancel.set()
    if cancel.is_set():
        # each file stops at its next chunk; one whose connection stalls only when the client's
        # read times out (HF_HUB_DOWNLOAD_TIMEOUT): this line does not wait for it
        thread.join(5)
    with lock:
        ended.set()
    error = out.get("error")
    if "path" in out:
        return Path(out["path"])
    done = sum(Path(f.local_path).exists() for f in todo)
    so_far = (
        f"{fmt_bytes(state.done_bytes)} of {fmt_bytes(need)}, {done} of {len(todo)} files; "
        f"run again to resume (finished files stay in {repo_cache(repo)})"
    )
    if cancel.is_set() or isinstance(error, (_Stop, KeyboardInterrupt)):
        raise DownloadInterrupted(f"downloading {repo} interrupted after {so_far}")
    told = explain(error, repo)
    if isinstance(told, HubError):  # gated, refused, no disk: not a transient stop
        raise told from error
    why = _reason(error)
    raise DownloadStopped(f"downloading {repo} stopped ({why}) after {so_far}") from error


def _reason(exc: BaseException) -> str:
    """The first line of an error, with its type where the text alone is vague."""
    text = str(exc).strip().splitlines()
    first = next((line for line in text if line.strip()), "")
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if status:
        return f"HTTP {status}" + (f": {first}" if first and str(status) not in first else "")
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def explain(
    exc: BaseException, repo: RepoId, refused: BaseException | None = None
) -> HubError | DownloadStopped:
    """The one line to tell for a failure of the hub client (or of the disk under the cache);
    `refused`: why the hub could not be asked, where the cache was asked instead."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        IncompleteSnapshotError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    endpoint = constants.ENDPOINT
    where = repo_cache(repo)
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return HubError(
            f"the disk of the Hugging Face cache ({cache_dir()}) is full while downloading {repo}: "
            "free some space or set HF_HUB_CACHE to a larger disk, then run again to resume"
        )
    if isinstance(exc, IncompleteSnapshotError):
        return HubError(
            f"{repo} is only partly in the Hugging Face cache ({where}) and the hub cannot be "
            "asked for the rest: run again online to finish the download"
        )
    if isinstance(exc, LocalEntryNotFoundError):
        cause = refused or exc.__cause__
        if constants.is_offline_mode():
            why = "HF_HUB_OFFLINE is set"
        elif isinstance(cause, (RepositoryNotFoundError, RevisionNotFoundError)) or (
            isinstance(cause, HfHubHTTPError) and cause.response.status_code in (401, 403)
        ):
            return explain(cause, repo)
        else:
            why = f"{endpoint} cannot be reached ({_reason(cause) if cause else 'no network'})"
        return HubError(f"{repo} is not in the Hugging Face cache ({where}) and {why}")
    if isinstance(exc, RevisionNotFoundError):
        return HubError(f"{repo.name} has no revision {repo.revision!r} on {endpoint}")
    if isinstance(exc, GatedRepoError):
        return HubError(
            f"{repo.name} is gated: accept its terms at {endpoint}/{repo.name} while logged in, "
            "then give this machine your token (`hf auth login` or HF_TOKEN)"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return HubError(
            f"{repo.name} is neither a folder on this machine nor a model repository on "
            f"{endpoint} (a private one needs a token: `hf auth login` or HF_TOKEN)"
        )
    if isinstance(exc, HfHubHTTPError) and exc.response.status_code == 401:
        return HubError(
            f"{endpoint} refused the token sent for {repo.name} (HTTP 401): check HF_TOKEN or "
            "`hf auth login`"
        )
    if isinstance(exc, HfHubHTTPError) and exc.response.status_code == 403:
        return HubError(
            f"{endpoint} refused {repo.name} to the token sent (HTTP 403): it needs read access"
        )
    return DownloadStopped(f"cannot fetch {repo} from {endpoint}: {_reason(exc)}")

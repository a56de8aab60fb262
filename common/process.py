"""Process plumbing: gRPC's event loop as every process of the project runs it, and a child that
dies with its parent."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import sys
from typing import Any, Callable, Coroutine, TypeVar

from . import GRPC_EXPERIMENTS

logger = logging.getLogger(__name__)
T = TypeVar("T")

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, name: str = "envoy") -> None:
    """On Linux, have the kernel SIGTERM this process when its parent (the node) exits; then make
    sure the parent did not exit before that took effect. (macOS relies on the watchdog and link
    EOF.) An envoy run by hand (no parent pid) is left alone."""
    if not parent_pid:
        return
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        except (OSError, AttributeError) as exc:
            logger.debug("prctl(PR_SET_PDEATHSIG) unavailable: %s", exc)
    if os.getppid() != parent_pid:
        sys.exit(f"{name}: parent {parent_pid} already exited")


def run_grpc_loop(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run `main()` as the envoy runs: grpc on its older poller (set before `main` imports grpc;
    a caller's own GRPC_EXPERIMENTS wins), on uvloop where it is installed."""
    os.environ.setdefault("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS)
    try:
        import uvloop  # optional: a faster event loop
    except ImportError:
        return asyncio.run(main())
    return uvloop.run(main())

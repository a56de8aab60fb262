"""Start node processes forked from a server that has imported their heavy dependencies once.

`simulate` and the benches start node processes again and again in one run (every family, path,
node count), and each started from nothing spent most of its start importing transformers for
mlx-lm (node/preimport.py). On Linux they are forked instead from multiprocessing's fork server,
which imported that once: a node process then starts in a fraction of the time (the family
commands' tests: 56 s -> 24 s on 2 vCPUs). The server imports no MLX: a process forked after MLX
or CUDA started is not safe. macOS keeps `spawn`: its system frameworks are not safe to fork.

A forked process inherits the server's environment, which is the caller's when the server started,
not when the process did: `process` hands the caller's environment to the child, which takes it
before the target's module is imported (CUDA_VISIBLE_DEVICES must be set before MLX starts).
"""

from __future__ import annotations

import gc
import importlib
import multiprocessing as mp
import os
import sys

from ..common import importcache

PRELOAD = "moe_cluster.node.preimport"


def context():
    """The multiprocessing context node processes start in: the fork server on Linux, else spawn."""
    if sys.platform != "linux":
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([PRELOAD])  # read when the server starts (once per process)
    return ctx


def process(ctx, target: str, args: tuple, **kwargs):
    """`ctx.Process` running `target` ("module:function") with `args`, in this process's
    environment as it is now."""
    return ctx.Process(target=_enter, args=(dict(os.environ), target, *args), **kwargs)


def _enter(env: dict[str, str], target: str, *args) -> None:
    # What the server imported lives as long as the child: its cycle collections (a full one at
    # each model swap, node/device.py's release_memory) need not walk those objects, nor touch
    # their pages, which a fork shares until they are written.
    gc.freeze()
    os.environ.clear()
    os.environ.update(env)
    importcache.install()  # a spawned child (macOS) imports transformers afresh; a forked one has it
    module, _, name = target.partition(":")
    getattr(importlib.import_module(module), name)(*args)

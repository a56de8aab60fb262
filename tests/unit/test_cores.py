"""node/cores.py: each of N co-located node processes gets a disjoint, even share of the cores, or
none where there are fewer cores than nodes; pin() moves every thread of a real process."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading

import pytest

from moe_cluster.node.cores import pin, shares, usable


def test_shares_are_even_disjoint_and_in_rank_order():
    assert shares(2, [3, 1, 0, 2]) == [(0, 1), (2, 3)]
    assert shares(2, [0, 1, 2]) == [(0,), (1,)]  # the odd core left to the OS's other work
    assert shares(4, [0, 1, 2, 3, 4, 5, 6, 7]) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert shares(3, [0, 1]) is None
    assert shares(2, []) is None


def _pinned_threads(cores, out) -> None:
    started = threading.Thread(target=threading.Event().wait, args=(5,), daemon=True)
    started.start()  # a thread running before pin(): it is moved too
    pin(cores)
    later = []
    t = threading.Thread(target=lambda: later.append(sorted(os.sched_getaffinity(0))))
    t.start()
    t.join()
    tids = os.listdir("/proc/self/task")
    out.put(([sorted(os.sched_getaffinity(int(tid))) for tid in tids], later[0]))


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this OS")
def test_pin_moves_every_thread_of_a_process():
    cores = (usable()[-1],)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_pinned_threads, args=(cores, out))
    p.start()
    threads, later = out.get(timeout=60)
    p.join(timeout=30)
    assert len(threads) >= 2 and all(t == list(cores) for t in threads), threads
    assert later == list(cores)  # a thread started after pin() inherits it

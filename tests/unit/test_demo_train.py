"""The demo model's training batches: the `repeat` share holds a passage written twice, after a
context unlike the first copy's, at varied lengths and distances, so the model learns to copy."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np
from conftest import cli

from moe_cluster.node.demo.train import TrainConfig, batch_windows, repeat_window

# A corpus of distinct tokens: every window's tokens say where in it they were taken.
CORPUS = np.arange(100_000, dtype=np.int32)


def _runs(w: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of the window's maximal runs of consecutive corpus tokens."""
    cuts = [0, *(int(i) + 1 for i in np.flatnonzero(np.diff(w) != 1)), len(w)]
    return list(zip(cuts, cuts[1:]))


def test_repeat_window_is_context_passage_gap_passage():
    rng = np.random.default_rng(0)
    n = 129
    lengths, distances, gaps = set(), set(), set()
    for _ in range(300):
        w, copy = repeat_window(CORPUS, rng, n)
        length = n - copy
        assert len(w) == n and w.dtype == CORPUS.dtype
        assert 8 <= length <= n // 2
        runs = _runs(w)
        # natural text ending in the passage, then the gap's span (maybe none), then the passage
        head_end = runs[0][1]
        assert w[:head_end].tolist() == CORPUS[w[0] : w[0] + head_end].tolist()
        assert w[copy:].tolist() == w[head_end - length : head_end].tolist()
        assert runs[-1][0] == copy, "the second copy is one run that starts the copy"
        gap = copy - head_end
        assert gap >= 0 and len(runs) == (3 if gap else 2)
        lengths.add(length)
        gaps.add(gap)
        distances.add(copy - (head_end - length))
    # varied, not one fixed layout
    assert len(lengths) > 30 and len(distances) > 50
    assert 0 in gaps and max(gaps) > n // 2


def test_batch_windows_repeat_share():
    rng = np.random.default_rng(1)
    tc = TrainConfig()
    for repeat, copies_expected in ((0.0, 0), (0.25, 4), (0.5, 8), (1.0, 16)):
        rows, copies = batch_windows(CORPUS, rng, tc.batch, tc.seq, repeat)
        assert rows.shape == (tc.batch, tc.seq + 1)
        repeated = [c < tc.seq + 1 for c in copies]
        assert sum(repeated) == copies_expected
        for row, c, rep in zip(rows, copies, repeated):
            if rep:
                assert row[c:].tolist() in [
                    row[i : i + len(row) - c].tolist() for i in range(c - (len(row) - c) + 1)
                ]
            else:
                assert _runs(row) == [(0, tc.seq + 1)], "a plain window is one corpus span"


def test_shipped_default_is_recorded():
    """train-demo writes its config, `repeat` included, into training.json; the defaults are the
    shipped model's, so `train-demo --out node/demo/model` retrains it."""
    import json

    from moe_cluster.node.demo import MODEL_DIR

    recorded = json.loads((MODEL_DIR / "training.json").read_text())["config"]
    assert recorded == asdict(TrainConfig())
    assert recorded["repeat"] > 0


def test_train_demo_rejects_a_share_out_of_range():
    out = cli("train-demo", "--out", "/nonexistent", "--repeat", "1.5", timeout=60)
    assert out.returncode == 2
    assert "--repeat: expected a share from 0 to 1, got 1.5" in out.stderr
    assert "Traceback" not in out.stderr

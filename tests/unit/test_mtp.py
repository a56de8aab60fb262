"""node/mtp.py's choice of the MTP draft (what `auto` asks), and a lane whose rows hold a cache
never fed (an MTP layer's before its first feed): the row leaves with an empty cache."""

from __future__ import annotations

import json

from moe_cluster.node.lanes import Lane
from moe_cluster.node.mtp import has_mtp


class _Row:
    def __init__(self, cache):
        self.cache = cache


def test_a_row_leaves_a_lane_whose_cache_was_never_fed():
    from mlx_lm.models.cache import KVCache

    a, b, c = (_Row([KVCache()]) for _ in range(3))
    lane = Lane()
    for row in (a, b, c):
        lane.join(row)
    (left,) = lane.leave(b)
    assert type(left) is KVCache and left.keys is None
    assert lane.rows == [a, c]


def test_mtp_is_chosen_where_the_checkpoint_has_mtp_layers(tmp_path):
    from moe_cluster.node.demo import MODEL_DIR

    declared = {"model_type": "deepseek_v3", "num_nextn_predict_layers": 1}
    assert has_mtp(declared)
    assert not has_mtp({**declared, "num_nextn_predict_layers": 0})
    assert not has_mtp({**declared, "model_type": "mixtral"})  # no MTP block built for it
    config = json.loads((MODEL_DIR / "config.json").read_text())
    assert has_mtp(config, MODEL_DIR)  # the demo's trained head, in mtp.safetensors
    (tmp_path / "config.json").write_text(json.dumps(config))
    for f in ("model.safetensors",):
        (tmp_path / f).write_bytes((MODEL_DIR / f).read_bytes())
    assert not has_mtp(config, tmp_path)  # declared, but its weights are not there

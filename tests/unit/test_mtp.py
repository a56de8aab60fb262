"""node/mtp.py's choice of the MTP draft (what `auto` asks) and of where its routed experts live,
and a lane whose rows hold a cache never fed (an MTP layer's before its first feed): the row leaves
with an empty cache."""

from __future__ import annotations

import json

from moe_cluster.node.lanes import Lane
from moe_cluster.node.mtp import SMALL_BANK, has_mtp, holding


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


def test_auto_keeps_the_mtp_experts_whole_where_they_are_small_beside_the_nodes():
    mib = 1 << 20
    # DeepSeek-V3-sized: one layer's bank against a node's share of 58 such layers
    bank = 11 * 1024 * mib
    assert holding("auto", bank, 58 * bank // 2) == "whole"  # N = 2
    assert holding("auto", bank, 58 * bank // 14) == "whole"  # N = 14: a quarter at most
    assert holding("auto", bank, 58 * bank // 16) == "sharded"
    # a small bank stays whole whatever its share (the demo's: 2 MB beside 4 MB at N = 2)
    assert holding("auto", 2 * mib, 4 * mib) == "whole"
    assert holding("auto", SMALL_BANK, 0) == "whole"
    assert holding("auto", SMALL_BANK + 1, 4 * SMALL_BANK) == "sharded"
    # what is asked is what is done
    assert holding("sharded", 2 * mib, 58 * bank) == "sharded"
    assert holding("whole", bank, 0) == "whole"

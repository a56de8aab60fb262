"""`placement.expert_cache: auto` sized from the node's memory: on Metal from MLX's device info
(the recommended working set less the replicated weights and the KV/prompt reserve), elsewhere from
the budget given (proto.expert_cache.auto_budget), then whole experts per layer."""

from __future__ import annotations

from moe_cluster.proto.expert_cache import ExpertCacheSpec, auto_budget

GB = 10**9
# what mx.device_info() answers on an M4 Pro Mac mini with 64 GB (the keys MLX reports)
M4_PRO_64 = {
    "device_name": "Apple M4 Pro",
    "architecture": "applegpu_g16s",
    "memory_size": 64 * 2**30,
    "max_recommended_working_set_size": 51_539_607_552,
    "max_buffer_length": 38_654_705_664,
}


def test_on_metal_the_working_set_bounds_the_experts_after_weights_and_caches():
    ws = M4_PRO_64["max_recommended_working_set_size"]
    assert auto_budget(10 * GB, 2 * GB, metal=M4_PRO_64) == ws - 12 * GB
    assert (
        auto_budget(10 * GB, 2 * GB, metal=M4_PRO_64, given_bytes=20 * GB) == 20 * GB
    )  # the smaller bound
    assert auto_budget(10 * GB, 2 * GB, metal=M4_PRO_64, given_bytes=100 * GB) == ws - 12 * GB
    assert (
        auto_budget(60 * GB, 2 * GB, metal=M4_PRO_64) == 0
    )  # not even the weights fit: no room for experts


def test_off_metal_the_budget_given_or_no_bound():
    for metal in (
        None,
        {},
        {"device_name": "Intel(R) Xeon(R) Processor", "architecture": "x86_64"},
    ):
        assert auto_budget(10 * GB, 2 * GB, metal=metal, given_bytes=5 * GB) == 5 * GB
        assert auto_budget(10 * GB, 2 * GB, metal=metal) is None


def test_auto_budget_becomes_whole_experts_per_layer():
    auto = ExpertCacheSpec.parse("auto")
    local, per_expert = {0: 8, 1: 8}, {0: 1 * GB, 1: 1 * GB}
    metal = {"max_recommended_working_set_size": 20 * GB}
    budget = auto_budget(10 * GB, 2 * GB, metal=metal)  # 8 GB: half of the 16 GB of experts
    assert auto.capacities(local, per_expert, budget) == {0: 4, 1: 4}
    assert (
        auto.capacities(local, per_expert, auto_budget(10 * GB, 2 * GB, metal=None)) == local
    )  # everything
    assert auto.capacities(local, per_expert, auto_budget(30 * GB, 2 * GB, metal=metal)) == {
        0: 1,
        1: 1,
    }  # floor
    roomy = {"max_recommended_working_set_size": 40 * GB}
    assert (
        auto.capacities(local, per_expert, auto_budget(10 * GB, 2 * GB, metal=roomy)) == local
    )  # all fit: off

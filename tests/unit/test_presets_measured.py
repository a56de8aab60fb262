"""The link presets charge this product's own stack: the newest all-reduce measurement under
docs/bench/ and the presets' figure agree within 2x.

The newest measurement: of the files docs/bench/allreduce-<host>-<YYYY-MM-DD>.json (a
measurement is committed under the date it was taken), the latest date; its case of 2 nodes and
1 token (`envoy_p50_us`, `mlx_ring_p50_us`). Files without a date in their name are older runs."""

from __future__ import annotations

import json
import re
from pathlib import Path

from moe_cluster.coordinator.plan import presets

BENCH = Path(__file__).resolve().parents[2] / "docs" / "bench"
DATED = re.compile(r"^allreduce-.+-(\d{4}-\d{2}-\d{2})\.json$")


def newest(folder: Path = BENCH) -> tuple[Path, dict]:
    """The newest dated all-reduce measurement in `folder`, and its 2-node 1-token case."""
    dated = [(m[1], p) for p in folder.glob("allreduce-*.json") if (m := DATED.match(p.name))]
    assert dated, f"no dated all-reduce measurement (allreduce-<host>-<date>.json) in {folder}"
    _, path = max(dated)
    case = next(
        c for c in json.loads(path.read_text())["cases"] if (c["nodes"], c["tokens"]) == (2, 1)
    )
    return path, case


def test_the_rule_takes_the_latest_date(tmp_path):
    for name, us in (
        ("allreduce-2vcpu-2026-01-02.json", 100.0),
        ("allreduce-32cores-2025-12-31.json", 50.0),
        ("allreduce-2vcpu-quiet.json", 10.0),
    ):
        case = {"nodes": 2, "tokens": 1, "envoy_p50_us": us}
        (tmp_path / name).write_text(json.dumps({"cases": [case]}))
    path, case = newest(tmp_path)
    assert path.name == "allreduce-2vcpu-2026-01-02.json" and case["envoy_p50_us"] == 100.0


def test_the_presets_stack_is_the_newest_measurement_within_2x():
    path, case = newest()
    for mine, theirs, what in (
        (presets.STACK.envoy_s, case["envoy_p50_us"] * 1e-6, "envoy"),
        (presets.STACK.mlx_s, case["mlx_ring_p50_us"] * 1e-6, "mx.distributed's ring"),
    ):
        assert 0.5 <= mine / theirs <= 2.0, (
            f"presets.STACK says {mine * 1e6:.0f} us for the {what}, {path.name} measured "
            f"{theirs * 1e6:.0f} us: measure again, or update presets.STACK"
        )


def test_every_tcp_link_preset_charges_the_measured_stack():
    for name in ("10gbe", "tb5", "tb5-rdma", "loopback"):
        net = presets.network_preset(name)
        assert net.stack("envoy") == presets.STACK.envoy_s
        assert presets.STACK.date in net.note and presets.STACK.file in net.note
    assert presets.network_preset("10gbe").stack("mlx") == presets.STACK.mlx_s
    assert (BENCH / presets.STACK.file).is_file()

"""What `transport: mlx` writes for each mx.distributed backend before `mx.distributed.init`, and
the token agreement's encodings; no group is formed (NCCL needs MLX's CUDA build and GPUs)."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from moe_cluster.node.collective.base import (
    Agreement,
    CollectiveError,
    TokenMismatch,
    rank_order_sum,
    rank_order_sum_rows,
    read_slots,
    ride_slots,
)
from moe_cluster.node.collective.mlx import GraphOnly, MlxCollective, write_hostfile
from moe_cluster.node.collective.specs import MlxSpec
from moe_cluster.proto.errors import UserError


def test_ring_writes_the_hostfile(tmp_path):
    spec = MlxSpec((("10.0.0.1:5000",), ("10.0.0.2:5000",)))
    env = write_hostfile(spec, tmp_path)
    assert json.loads(open(env["MLX_HOSTFILE"]).read()) == [["10.0.0.1:5000"], ["10.0.0.2:5000"]]


def test_nccl_meets_at_rank_0s_address(tmp_path):
    spec = MlxSpec((("10.0.0.1:29500",), ("10.0.0.2:29500",), ("10.0.0.3:29500",)), backend="nccl")
    env = write_hostfile(spec, tmp_path)
    assert env == {"MLX_WORLD_SIZE": "3", "NCCL_HOST_IP": "10.0.0.1", "NCCL_PORT": "29500"}
    assert (
        list(tmp_path.iterdir()) == []
    )  # nothing to write: the GPU is the launcher's (CUDA_VISIBLE_DEVICES)


def test_nccl_needs_rank_0s_host_and_port():
    with pytest.raises(UserError, match="nccl backend needs rank 0's address as host:port"):
        MlxSpec(((), ("10.0.0.2:29500",)), backend="nccl")
    with pytest.raises(UserError, match="mlx backend must be one of ring, jaccl, nccl"):
        MlxSpec((("a:1",),), backend="gloo")


@pytest.mark.skipif(mx.distributed.is_available("nccl"), reason="this MLX build has NCCL")
def test_a_backend_missing_from_this_build_is_a_clear_error():
    spec = MlxSpec((("127.0.0.1:1",), ("127.0.0.1:2",)), backend="nccl")
    with pytest.raises(CollectiveError, match="backend 'nccl' is not available in this MLX build"):
        MlxCollective(spec, 0)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_summed_ride_slots_carry_every_ranks_token_exactly(dtype):
    tokens, cancel = (151_935, 0, 255, 16_777_215), (False, True, False, False)
    total = rank_order_sum(
        [
            ride_slots(r, 4, mx.array([t, c], dtype=mx.int32), dtype)
            for r, (t, c) in enumerate(zip(tokens, cancel))
        ]
    )
    agreement = read_slots(total.astype(mx.float32).tolist(), 4)
    assert agreement.values == tuple((t, int(c)) for t, c in zip(tokens, cancel))


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_summed_ride_slots_carry_a_batchs_vector_exactly(dtype):
    """A running batch rides its queue, cancel flags and tokens: any length, every value exact."""
    rows = [[r * 1000 + i * 65_537 % (1 << 24) for i in range(19)] for r in range(3)]
    total = rank_order_sum(
        [ride_slots(r, 3, mx.array(v, dtype=mx.int32), dtype) for r, v in enumerate(rows)]
    )
    assert read_slots(total.astype(mx.float32).tolist(), 3) == Agreement(
        tuple(tuple(v) for v in rows)
    )


def test_an_agreement_names_the_step_and_both_tokens():
    assert Agreement(((7, 0), (7, 1))).any_set(1) is True
    assert Agreement(((7, 0), (7, 0))).any_set(1) is False
    assert Agreement(((8, 0), (8, 0))).token(0, "step 4", offset=1) == 7
    with pytest.raises(TokenMismatch, match="step 4: rank 1 sampled token 8, rank 0 sampled 7"):
        Agreement(((7, 0), (8, 0))).token(0, "step 4")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_the_in_graph_sum_is_the_envoys_bytes(dtype, ranks):
    """`transport: mlx` sums in the graph what the envoy transport's Reducer sums on the host: same
    bytes."""
    import numpy as np

    from moe_cluster.node.collective.reduce import Reducer, to_float32
    from moe_cluster.node.collective.base import to_wire

    rng = np.random.default_rng(ranks)
    parts = []
    for r in range(ranks):
        x = rng.standard_normal(4096).astype(np.float32) * 10.0 ** rng.integers(-6, 6, 4096)
        x[:8] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 65504.0, 3.4e38, -3.4e38][:8]
        parts.append(mx.array(np.roll(x, r)).astype(getattr(mx, dtype)))
    got, _ = to_wire(rank_order_sum(parts))
    # MlxCollective sums the all-gather's rows, cast once: the same bytes as the list's sum
    rows, _ = to_wire(rank_order_sum_rows(mx.stack(parts))[0])
    assert rows.tobytes() == got.tobytes()
    with np.errstate(invalid="ignore"):
        want = Reducer()([to_wire(p)[0] for p in parts], dtype)
    # inf + -inf in float32: numpy on x86 makes 0xFFC00000, MLX 0x7FC00000. Only such a NaN's sign
    # differs (the Reducer keeps the sign into float16 as MLX's cast would); every other value is equal.
    nan = np.isnan(to_float32(got, dtype)) & np.isnan(to_float32(want, dtype))
    assert got[~nan].tobytes() == want[~nan].tobytes()


def test_mlx_lms_tensor_parallel_falls_back_to_the_ring_where_nccl_fails(monkeypatch):
    """mlx-lm's sharded_load ends with an all_sum on the CPU stream that MLX's NCCL backend refuses
    (MLX 0.32.4 on CUDA); the peer is then measured over the ring, and says so with NCCL's error."""
    from types import SimpleNamespace

    from moe_cluster.coordinator.bench import tensor_parallel as tp

    tried = []

    def fake(model_path, nodes, ids, max_tokens, rounds, timeout_s, gpus, backend, **peer):
        tried.append(backend)
        entry = {"name": "mlx_lm_tensor_parallel", "nodes": nodes, "backend": backend}
        if backend == "nccl":
            return {
                **entry,
                "error": "rank 0: RuntimeError: There is no Stream(gpu, 1) in current thread.",
                "where": "utils.py:812 sharded_load",
            }
        return {**entry, "tps": 9.9, "tokens": [1, 2]}

    monkeypatch.setattr(tp, "supports", lambda path, mode="tensor": None)
    monkeypatch.setattr(tp, "_measure", fake)
    monkeypatch.setattr(mx, "cuda", SimpleNamespace(is_available=lambda: True), raising=False)
    monkeypatch.setattr(mx.distributed, "is_available", lambda backend=None: True)
    r = tp.measure("m", 2, [1], 2, 1, gpus=True)
    assert tried == ["nccl", "ring"]
    assert r["backend"] == "ring" and r["tps"] == 9.9 and "no Stream" in r["nccl_error"], r
    assert r["nccl_where"] == "utils.py:812 sharded_load"
    tried.clear()
    assert tp.measure("m", 2, [1], 2, 1, backend="ring")["backend"] == "ring" and tried == ["ring"]


def test_up_joins_local_gpu_nodes_over_nccl_where_mlx_has_it(monkeypatch):
    """`transport: mlx` with every node of a local cluster on its own GPU (`gpu:`) takes NCCL where
    MLX's CUDA build offers it; otherwise, and on this CPU build, the ring."""
    from types import SimpleNamespace

    from moe_cluster.coordinator.serve.config import parse_config
    from moe_cluster.coordinator.serve.up import _transport

    def spec(text):
        c = parse_config("transport: mlx\nlaunch: local\nnodes:\n" + text)
        return _transport(c, ["127.0.0.1", "127.0.0.1"], [7001, 7002], False)(0)

    on_gpus = "  - name: a\n    gpu: 0\n  - name: b\n    gpu: 1\n"
    assert spec(on_gpus).backend == ("nccl" if mx.distributed.is_available("nccl") else "ring")
    monkeypatch.setattr(mx, "cuda", SimpleNamespace(is_available=lambda: True), raising=False)
    monkeypatch.setattr(mx.distributed, "is_available", lambda backend=None: True)
    s = spec(on_gpus)
    assert s.backend == "nccl" and s.hosts[0] == ("127.0.0.1:7001",)
    assert (
        spec("  - name: a\n    gpu: 0\n  - name: b\n").backend == "ring"
    )  # one node without a GPU of its own


def test_the_ring_can_be_forced_where_nccl_would_be_picked(monkeypatch):
    """cluster.yaml's `mlx_backend: ring`: the host-mediated ring on GPU nodes, to compare the envoy
    with it; a bad value, or the key without `transport: mlx`, is refused by name."""
    from types import SimpleNamespace

    from moe_cluster.coordinator.serve.config import ConfigError, parse_config
    from moe_cluster.coordinator.serve.up import _transport
    from moe_cluster.node.collective.mlx import mlx_backend

    monkeypatch.setattr(mx, "cuda", SimpleNamespace(is_available=lambda: True), raising=False)
    monkeypatch.setattr(mx.distributed, "is_available", lambda backend=None: True)
    assert mlx_backend(gpus=True) == "nccl"
    assert mlx_backend(gpus=True, choice="ring") == "ring"
    with pytest.raises(UserError, match="mlx_backend must be one of auto, ring \\(got 'mpi'\\)"):
        mlx_backend(gpus=True, choice="mpi")
    nodes = "nodes:\n  - name: a\n    gpu: 0\n  - name: b\n    gpu: 1\n"
    c = parse_config("transport: mlx\nmlx_backend: ring\n" + nodes)
    assert _transport(c, ["127.0.0.1"] * 2, [7001, 7002], False)(0).backend == "ring"
    with pytest.raises(ConfigError, match="mlx_backend: must be one of"):
        parse_config("transport: mlx\nmlx_backend: mpi\n" + nodes)
    with pytest.raises(ConfigError, match="mlx_backend: applies only with transport: mlx"):
        parse_config("mlx_backend: ring\n" + nodes)


class _Exchange(GraphOnly):
    """One rank of a world whose collectives are played twice: the first time each rank notes
    what it hands the backend (the answer is zeros of the right shape), the second time the
    backend's answer is made from every rank's noted input, as the ring or NCCL would give it."""

    def __init__(self, rank: int, world: int, scatters: bool, noted: dict):
        super().__init__(rank, world)
        self._scatters = scatters
        self.noted = noted  # call number -> {rank: what that rank handed the backend}
        self.calls = 0

    def _answer(self, x: mx.array, make) -> mx.array:
        self._last = None  # each call here stands alone: no order to keep between them
        every = self.noted.setdefault(self.calls, {})
        every.setdefault(self.rank, x)
        self.calls += 1
        if len(every) < self.world_size:
            return mx.zeros_like(make([x] * self.world_size))
        return make([every[r] for r in range(self.world_size)])

    def _all_gather(self, x):
        return self._answer(x, mx.concatenate)

    def _sum_scatter(self, x):
        block = x.shape[0] // self.world_size
        return self._answer(
            x, lambda every: rank_order_sum(every)[self.rank * block : (self.rank + 1) * block]
        )


@pytest.mark.parametrize("scatters", [False, True], ids=["ring", "nccl"])
@pytest.mark.parametrize("counts", [(8, 8), (8, 6), (0, 3), (3, 5, 4), (4, 4, 4)])
def test_by_streams_gather_and_scatter_give_every_rank_its_rows(counts, scatters):
    """Attention by stream's two collectives on every rank, the backend's answer made from what
    every rank handed it: the gather is every rank's rows in rank order, the scatter each rank's
    rows of the summed partials; without padding (every rank brings as many rows) the gather is a
    view of the backend's answer, no copy."""
    import numpy as np

    from moe_cluster.node.moe.opcount import kernels, primitives

    world, width, total = len(counts), 16, sum(counts)
    rng = np.random.default_rng(sum(counts))
    rows = [mx.array(rng.standard_normal((n, width)).astype(np.float32)) for n in counts]
    partials = [mx.array(rng.standard_normal((total, width)).astype(np.float32)) for _ in counts]
    noted: dict = {}
    ranks = [_Exchange(r, world, scatters, noted) for r in range(world)]
    for c in ranks:  # the first play notes every rank's input
        c.all_gather(rows[c.rank], counts, 0), c.reduce_scatter(partials[c.rank], counts, 0)
    want_rows = np.concatenate([np.array(x) for x in rows])
    summed = np.array(rank_order_sum(partials))
    for c in ranks:
        c.calls = 0
        gathered = c.all_gather(rows[c.rank], counts, 0)
        if len(set(counts)) == 1:
            assert kernels(primitives(gathered)) == 1  # the backend's gather alone
        assert np.array_equal(np.array(gathered), want_rows)
        start = sum(counts[: c.rank])
        mine = c.reduce_scatter(partials[c.rank], counts, 0)
        np.testing.assert_allclose(
            np.array(mine), summed[start : start + counts[c.rank]], rtol=0, atol=1e-6
        )

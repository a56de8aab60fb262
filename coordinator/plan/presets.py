"""Published figures for `moe-cluster plan`: models, Macs and networks.

Every number names its source. Prices are US list prices of the configuration named (launch
prices; check the current ones and pass `--price-per-node`). GPU FLOP/s follow Table 1's
convention for the M2 Ultra (54e12 = 2 × the FP32 rate: cores × 128 ALUs × 2 × clock × 2); decode
is bound by memory bandwidth, so they rarely matter.
"""

from __future__ import annotations

from dataclasses import dataclass

from .perfmodel import CacheSpec, HardwareSpec, ModelSpec, NetworkSpec, PlanError

GiB = 1 << 30

# --- models ---------------------------------------------------------------------------------


def _dbrx() -> ModelSpec:
    """DBRX Instruct exactly as Table 1 of Chen et al. (RACS '24).

    P_SA (7e9 bytes) and FLOPs_SA (14e9) are taken as stated. P_expert and the comm data are
    Table 1's footnotes (d) and (a) evaluated with its D_embed, D_ffn, layers and precision
    (15.85e9 and 1.97e6; the table prints them rounded to 16e9 and 2e6). Footnote (b) would give
    13.3e9 bytes for P_SA (it drops the precision factor), so the stated value is what Table 6 used.
    """
    layers, d_embed, d_ffn, precision = 40, 6144, 10752, 2
    expert_layer = (
        d_embed * d_ffn * 3 * precision
    )  # bytes, one expert one layer: footnote (d) / layers
    expert_layer_flops = 2 * d_embed * d_ffn * 3  # footnote (e) / layers
    num_experts = 16
    published_params = 132e9  # Databricks: 132B total parameters
    kv_heads, head_dim = 8, 128
    return ModelSpec(
        name="dbrx",
        num_experts=num_experts,
        top_k=4,
        layers=layers,
        moe_layer_ids=tuple(range(layers)),
        hidden=d_embed,
        act_bytes=precision,
        replicated_bytes=int(published_params * precision) - num_experts * expert_layer * layers,
        replicated_read_bytes=int(7e9),
        replicated_flops=14e9,
        expert_layer_bytes=(expert_layer,) * layers,
        expert_layer_flops=(float(expert_layer_flops),) * layers,
        caches=(CacheSpec(per_token_bytes=2 * kv_heads * head_dim * precision),) * layers,
        weights="bf16",
        source="Table 1 of Chen et al., RACS '24; resident size from the published 132B parameters",
    )


def _published(
    name: str,
    *,
    total_params: float,
    active_params: float,
    num_experts: int,
    top_k: int,
    layers: int,
    moe_layer_ids: tuple[int, ...],
    hidden: int,
    vocab: int,
    expert_ffn: int,
    shared_ffn: int = 0,
    caches: tuple[CacheSpec, ...],
    source: str,
) -> ModelSpec:
    """A bf16 model from its published total/active parameter counts and architecture.

    One routed expert is a SwiGLU of 3 × hidden × expert_ffn parameters; what the total leaves
    is replicated. Read per token: the active parameters less the k routed experts, the shared
    experts (computed by their owner) and all but one row of the (untied) embedding table.
    """
    precision = 2
    moe = len(moe_layer_ids)
    expert = 3 * hidden * expert_ffn  # parameters, one expert one layer
    shared = 3 * hidden * shared_ffn
    replicated = total_params - num_experts * expert * moe
    read = active_params - top_k * expert * moe - shared * moe - (vocab - 1) * hidden
    if replicated <= 0 or read <= 0:
        raise AssertionError(f"inconsistent published figures for {name}")
    return ModelSpec(
        name=name,
        num_experts=num_experts,
        top_k=top_k,
        layers=layers,
        moe_layer_ids=moe_layer_ids,
        hidden=hidden,
        act_bytes=precision,
        replicated_bytes=int(replicated * precision),
        replicated_read_bytes=int(read * precision),
        replicated_flops=2.0 * read,
        expert_layer_bytes=(expert * precision,) * moe,
        expert_layer_flops=(2.0 * expert,) * moe,
        shared_layer_bytes=(shared * precision,) * moe if shared else (),
        shared_layer_flops=(2.0 * shared,) * moe if shared else (),
        caches=caches,
        weights="bf16",
        source=source,
    )


def _gqa(layers: int, kv_heads: int, head_dim: int, precision: int = 2) -> tuple[CacheSpec, ...]:
    return (CacheSpec(per_token_bytes=2 * kv_heads * head_dim * precision),) * layers


def _mixtral_8x7b() -> ModelSpec:
    return _published(
        "mixtral-8x7b",
        total_params=46.7e9,
        active_params=12.9e9,
        num_experts=8,
        top_k=2,
        layers=32,
        moe_layer_ids=tuple(range(32)),
        hidden=4096,
        vocab=32000,
        expert_ffn=14336,
        caches=_gqa(32, 8, 128),
        source="Mistral AI: 46.7B total, 12.9B active; config.json of Mixtral-8x7B-v0.1",
    )


def _mixtral_8x22b() -> ModelSpec:
    return _published(
        "mixtral-8x22b",
        total_params=141e9,
        active_params=39e9,
        num_experts=8,
        top_k=2,
        layers=56,
        moe_layer_ids=tuple(range(56)),
        hidden=6144,
        vocab=32768,
        expert_ffn=16384,
        caches=_gqa(56, 8, 128),
        source="Mistral AI: 141B total, 39B active; config.json of Mixtral-8x22B-v0.1",
    )


def _qwen3_235b() -> ModelSpec:
    return _published(
        "qwen3-235b-a22b",
        total_params=235e9,
        active_params=22e9,
        num_experts=128,
        top_k=8,
        layers=94,
        moe_layer_ids=tuple(range(94)),
        hidden=4096,
        vocab=151936,
        expert_ffn=1536,
        caches=_gqa(94, 4, 128),
        source="Qwen3 technical report: 235B total, 22B active, 128 experts, top-8; config.json of Qwen3-235B-A22B",
    )


def _deepseek_v3() -> ModelSpec:
    # Multi-head latent attention: mlx-lm caches the 512-wide latent and the 64-wide rope key.
    mla = CacheSpec(per_token_bytes=(512 + 64) * 2)
    return _published(
        "deepseek-v3",
        total_params=671e9,
        active_params=37e9,
        num_experts=256,
        top_k=8,
        layers=61,
        moe_layer_ids=tuple(range(3, 61)),
        hidden=7168,
        vocab=129280,
        expert_ffn=2048,
        shared_ffn=2048,
        caches=(mla,) * 61,
        source="DeepSeek-V3 technical report: 671B total, 37B active, 256 routed + 1 shared expert, "
        "top-8, first 3 layers dense (MTP module not counted); published weights are fp8, "
        "mlx-lm holds them in bf16 unless quantized (--bits)",
    )


def _qwen3_coder_next() -> ModelSpec:
    # 12 × (3 × Gated DeltaNet + 1 × gated attention). Attention: 2 KV heads of 256. DeltaNet
    # state per layer: conv (3 × 8192 bf16) + recurrent (32 heads × 128 × 128, float32).
    attn = CacheSpec(per_token_bytes=2 * 2 * 256 * 2)
    delta = CacheSpec(per_token_bytes=0, fixed_bytes=3 * 8192 * 2 + 32 * 128 * 128 * 4)
    caches = tuple(attn if i % 4 == 3 else delta for i in range(48))
    return _published(
        "qwen3-coder-next",
        total_params=80e9,
        active_params=3e9,
        num_experts=512,
        top_k=10,
        layers=48,
        moe_layer_ids=tuple(range(48)),
        hidden=2048,
        vocab=151936,
        expert_ffn=512,
        shared_ffn=512,
        caches=caches,
        source="Qwen3-Coder-Next model card: 80B total, 3B active, 512 experts, 10 active + 1 shared, "
        "48 layers (Qwen3-Next architecture)",
    )


MODELS = {
    "dbrx": _dbrx,
    "mixtral-8x7b": _mixtral_8x7b,
    "mixtral-8x22b": _mixtral_8x22b,
    "qwen3-235b-a22b": _qwen3_235b,
    "deepseek-v3": _deepseek_v3,
    "qwen3-coder-next": _qwen3_coder_next,
}

# --- Macs -----------------------------------------------------------------------------------

# ssd_read_Bps: the internal SSD's sequential read as disk-speed reviews report it for the storage size
# named (approximate: it varies with capacity and fill; pass --ssd-bandwidth, or calibrate on the Mac).


def _gpu_flops(cores: int, ghz: float) -> float:
    return cores * 128 * 2 * ghz * 1e9 * 2


HARDWARE = {
    h.name: h
    for h in (
        HardwareSpec(
            "m2-ultra-192",
            192 * GiB,
            800e9,
            54e12,
            6599,
            "Mac Studio M2 Ultra 24-core CPU, 76-core GPU, 192 GB, 1 TB: Tables 1, 2 and 5 of the paper",
            ssd_read_Bps=6e9,
        ),
        HardwareSpec(
            "m3-ultra-256",
            256 * GiB,
            819e9,
            _gpu_flops(60, 1.4),
            5599,
            "Mac Studio M3 Ultra 28-core CPU, 60-core GPU, 256 GB, 1 TB (2025); Thunderbolt 5",
            ssd_read_Bps=6e9,
        ),
        HardwareSpec(
            "m3-ultra-512",
            512 * GiB,
            819e9,
            _gpu_flops(80, 1.4),
            9499,
            "Mac Studio M3 Ultra 32-core CPU, 80-core GPU, 512 GB, 1 TB (2025); Thunderbolt 5",
            ssd_read_Bps=6e9,
        ),
        HardwareSpec(
            "m4-max-128",
            128 * GiB,
            546e9,
            _gpu_flops(40, 1.578),
            3499,
            "Mac Studio M4 Max 16-core CPU, 40-core GPU, 128 GB, 512 GB (2025); Thunderbolt 5",
            ssd_read_Bps=5e9,
        ),
        HardwareSpec(
            "m4-pro-64",
            64 * GiB,
            273e9,
            _gpu_flops(20, 1.578),
            2199,
            "Mac mini M4 Pro 14-core CPU, 20-core GPU, 64 GB, 512 GB (2024); Thunderbolt 5",
            ssd_read_Bps=4e9,
        ),
        # Not a Mac: the GPU host docs/performance.md's accelerator figures were measured on.
        HardwareSpec(
            "h200",
            141 * 10**9,
            4.8e12,
            989e12,
            32000,
            "NVIDIA H200 SXM: 141 GB HBM3e at 4.8 TB/s, 989 TFLOP/s dense bf16 (datasheet); "
            "price an estimate for one GPU's share of a server",
            ssd_read_Bps=7e9,
        ),
    )
}

# --- networks -------------------------------------------------------------------------------


@dataclass(frozen=True)
class StackMeasurement:
    """This product's own all-reduce as `moe-cluster bench allreduce` measured it over TCP loopback
    (2 nodes, 1 token of hidden 6144 in bfloat16, p50): the software stack each link preset adds to
    its wire, per transport. Loopback has no wire, so the figure is the stack alone: the node's and
    the envoy's (or mx.distributed's) work and the kernel's TCP on both ends. `file` is under
    docs/bench/; tests/unit/test_presets_measured.py fails when the newest measurement there
    differs from these figures by more than 2x."""

    file: str
    host: str  # the host class it was measured on
    date: str  # ISO date of the measurement
    envoy_s: (
        float  # seconds, `transport: envoy` (the node's own exchange over the envoy's channels)
    )
    mlx_s: float  # seconds, `transport: mlx` on its ring backend (mx.distributed over TCP)

    def says(self) -> str:
        return (
            f"this product's all-reduce (2 nodes, 1 token) measured by `bench allreduce` on a "
            f"{self.host}, {self.date}: envoy {self.envoy_s * 1e6:.0f} us, mx.distributed's ring "
            f"{self.mlx_s * 1e6:.0f} us (docs/bench/{self.file})"
        )


STACK = StackMeasurement(
    file="allreduce-2vcpu-2026-12-06.json",
    host="2-vCPU x86-64 VM shared with other test runs",
    date="2026-12-06",
    envoy_s=86.2e-6,
    mlx_s=165.3e-6,
)

# JACCL (mx.distributed's RDMA backend over Thunderbolt 5, macOS 26.2+): "under 50 us" an
# all-reduce as reported with Apple TN3205; not measured here (no Mac).
JACCL_S = 49e-6

NETWORKS = {
    n.name: n
    for n in (
        NetworkSpec(
            "10gbe",
            5e-6,
            10e9 / 8,
            STACK.envoy_s,
            0.0,
            "built-in 10 Gigabit Ethernet through a switch: wire ~5 us (10GBASE-T PHYs and a "
            "switch, published), 10 Gb/s; stack: " + STACK.says(),
            mlx_stack_s=STACK.mlx_s,
        ),
        NetworkSpec(
            "tb5",
            1e-6,
            80e9 / 8,
            STACK.envoy_s,
            0.0,
            "TCP/IP over a Thunderbolt 5 cable (80 Gb/s, ~1 us, published); stack: " + STACK.says(),
            mlx_stack_s=STACK.mlx_s,
        ),
        NetworkSpec(
            "tb5-rdma",
            1e-6,
            80e9 / 8,
            STACK.envoy_s,
            0.0,
            "Thunderbolt 5: mx.distributed's JACCL RDMA (macOS 26.2+) 49 us an all-reduce, wire "
            "included, as reported with Apple TN3205 (not measured here); the envoy runs TCP over "
            "the same cable: " + STACK.says(),
            mlx_stack_s=JACCL_S - 1e-6,
        ),
        NetworkSpec(
            "paper-10gbe",
            5e-6,
            10e9 / 8,
            1e-3 - 5e-6,
            0.0,
            "10 Gigabit Ethernet as Chen et al. measured it: 1 ms per layer (their gRPC over TCP) "
            "less the wire; Table 6 of the paper comes out of it",
        ),
        NetworkSpec(
            "rocev2",
            750e-9,
            25e9 / 8,
            0.0,
            339.0,
            "RoCEv2 NIC: 750 ns, 25 Gb/s, 339 USD per NIC (paper footnote 7); kernel bypass, no stack cost",
        ),
        NetworkSpec(
            "infiniband",
            600e-9,
            200e9 / 8,
            0.0,
            1267.0,
            "InfiniBand NIC: 600 ns, 200 Gb/s, 1,267 USD per NIC (paper footnote 7); no stack cost",
        ),
        NetworkSpec(
            "loopback",
            0.0,
            10e9,
            STACK.envoy_s,
            0.0,
            "nodes on one host over TCP loopback (no wire); stack: " + STACK.says(),
            mlx_stack_s=STACK.mlx_s,
        ),
    )
}


def _lookup(table: dict, kind: str, name: str):
    try:
        return table[name]
    except KeyError:
        raise PlanError(f"unknown {kind} preset {name!r}; choose from {', '.join(table)}") from None


def model_preset(name: str) -> ModelSpec:
    return _lookup(MODELS, "model", name)()


def hardware_preset(name: str) -> HardwareSpec:
    return _lookup(HARDWARE, "hardware", name)


def network_preset(name: str) -> NetworkSpec:
    return _lookup(NETWORKS, "network", name)

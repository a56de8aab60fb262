"""Serving metrics in the Prometheus text format (GET /metrics)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from ...proto.records import AllreduceHistogram

# Seconds.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self):
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.n += 1

    def quantile(self, q: float) -> float | None:
        """The upper bound of the bucket holding the q-quantile (the last bound if it lies past every
        bound; None with no observations), as Prometheus' histogram_quantile reads buckets."""
        if not self.n:
            return None
        cum = 0
        for bound, c in zip(self.buckets, self.counts):
            cum += c
            if cum >= q * self.n:
                return bound
        return self.buckets[-1] if self.buckets else None

    def lines(self, name: str, labels: str = "") -> list[str]:
        out, cum = [], 0
        sep = "," if labels else ""
        for le, c in zip(list(self.buckets) + ["+Inf"], self.counts):
            cum += c
            out.append(f'{name}_bucket{{{labels}{sep}le="{le}"}} {cum}')
        lab = f"{{{labels}}}" if labels else ""
        out.append(f"{name}_sum{lab} {self.total:.9g}")
        out.append(f"{name}_count{lab} {self.n}")
        return out


def allreduce_histogram(h: AllreduceHistogram | None) -> Histogram | None:
    """A node's all-reduce histogram from its Status (None if it reports none: no model loaded)."""
    if h is None:
        return None
    return Histogram(tuple(h.bounds), list(h.counts), h.sum_s, sum(h.counts))


_CACHE_SERIES = (
    ("capacity", "gauge", "Expert slots resident on the node, per MoE layer."),
    ("hits_total", "counter", "Selected experts found resident."),
    ("misses_total", "counter", "Selected experts read from disk."),
    ("bytes_read_total", "counter", "Expert bytes read from disk on misses."),
    ("read_seconds_total", "counter", "Seconds spent reading missed experts."),
    (
        "prefetched_total",
        "counter",
        "Expert reads started ahead of the layer's routing (routing profile).",
    ),
    ("prefetch_hits_total", "counter", "Misses whose bytes a prefetch had already read."),
    ("prefetch_bytes_total", "counter", "Bytes read by prefetches, used or not."),
)


def expert_cache_lines(nodes: list[dict]) -> list[str]:
    """/metrics lines of the nodes' expert caches, per node and MoE layer (none without a cache)."""
    rows = [(n["name"], c) for n in nodes for c in n.get("expert_cache", ())]
    if not rows:
        return []
    lines = []
    for series, kind, text in _CACHE_SERIES:
        key = series.removesuffix("_total")
        lines += [
            f"# HELP moe_cluster_expert_cache_{series} {text}",
            f"# TYPE moe_cluster_expert_cache_{series} {kind}",
        ]
        lines += [
            f'moe_cluster_expert_cache_{series}{{node="{node}",layer="{c["layer"]}"}} {c[key]}'
            for node, c in rows
        ]
    return lines


def route_lines(nodes: list[dict]) -> list[str]:
    """/metrics lines of each node's decode route (node/moe/route.py): the one it chose, and the
    seconds per call of one MoE layer it measured on each route at load (none where nothing was timed)."""
    chosen = [(n["name"], n["route"]) for n in nodes if n.get("route")]
    times = [(n["name"], r, us) for n in nodes for r, us in sorted(n.get("route_us", {}).items())]
    lines = []
    if chosen:
        lines += [
            "# HELP moe_cluster_node_route The decode route the node chose at load (skip, device or host).",
            "# TYPE moe_cluster_node_route gauge",
        ]
        lines += [f'moe_cluster_node_route{{node="{node}",route="{r}"}} 1' for node, r in chosen]
    if times:
        lines += [
            "# HELP moe_cluster_node_route_seconds One MoE layer's decode call per route, timed at load.",
            "# TYPE moe_cluster_node_route_seconds gauge",
        ]
        lines += [
            f'moe_cluster_node_route_seconds{{node="{node}",route="{r}"}} {us * 1e-6:.9g}'
            for node, r, us in times
        ]
    return lines


def prompt_tps(done) -> float:
    """Prompt tokens prefilled per second (a GenerateDone's): a prompt-cache hit prefills only the rest."""
    if done is None or not done.timings.prompt_s:
        return 0.0
    return (done.prompt_tokens - done.cached_tokens) / done.timings.prompt_s


class Metrics:
    def __init__(self):
        self.requests = {"ok": 0, "error": 0, "cancelled": 0}
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.cache_hits = 0
        self.cached_tokens = 0
        self.resumes = 0  # runs resumed after a lost node
        self.last_prompt_tps = 0.0
        self.last_generation_tps = 0.0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.drafted = 0  # speculation: drafts verified, and accepted
        self.accepted = 0
        self.decode_allreduces = 0  # MoE all-reduces the decode steps paid (steps x MoE layers)

    def finished(self, gen) -> None:
        """Called once per request by the API with its Generation."""
        o = gen.outcome
        status = "error" if o.error else ("cancelled" if gen.finish_reason == "cancelled" else "ok")
        self.requests[status] = self.requests.get(status, 0) + 1
        self.prompt_tokens += len(gen.req.prompt)
        self.generated_tokens += len(o.tokens)
        self.resumes += len(o.stalls)
        if gen.ttft is not None:
            self.ttft.observe(gen.ttft)
        d = o.done
        if d is not None:
            c = d.counters
            self.drafted += int(c.get("drafted", 0))
            self.accepted += int(c.get("accepted", 0))
            self.decode_allreduces += int(c.get("decode_steps", 0) * c.get("moe_layers", 0))
            if d.cached_tokens:
                self.cache_hits += 1
                self.cached_tokens += d.cached_tokens
            t = d.timings
            if t.prompt_s:
                self.last_prompt_tps = prompt_tps(d)
            if t.generation_s:
                self.last_generation_tps = len(o.tokens) / t.generation_s

    def speculation(self) -> dict:
        """Drafts verified and accepted, and MoE all-reduces per generated token, since the start
        (what /v1/cluster/status and the dashboard show)."""
        return {
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance": self.accepted / self.drafted if self.drafted else 0.0,
            "allreduces_per_token": (
                self.decode_allreduces / self.generated_tokens if self.generated_tokens else 0.0
            ),
        }

    def render(self, cluster) -> str:
        s = cluster.status()
        lines = [
            "# HELP moe_cluster_requests_total Generation requests by outcome.",
            "# TYPE moe_cluster_requests_total counter",
            *(f'moe_cluster_requests_total{{outcome="{k}"}} {v}' for k, v in self.requests.items()),
            "# HELP moe_cluster_resumes_total Runs resumed where they stopped after a lost node.",
            "# TYPE moe_cluster_resumes_total counter",
            f"moe_cluster_resumes_total {self.resumes}",
            "# HELP moe_cluster_prompt_tokens_total Prompt tokens received.",
            "# TYPE moe_cluster_prompt_tokens_total counter",
            f"moe_cluster_prompt_tokens_total {self.prompt_tokens}",
            "# HELP moe_cluster_generated_tokens_total Tokens generated.",
            "# TYPE moe_cluster_generated_tokens_total counter",
            f"moe_cluster_generated_tokens_total {self.generated_tokens}",
            "# HELP moe_cluster_speculative_drafted_total Drafted tokens verified (speculative decoding).",
            "# TYPE moe_cluster_speculative_drafted_total counter",
            f"moe_cluster_speculative_drafted_total {self.drafted}",
            "# HELP moe_cluster_speculative_accepted_total Drafted tokens the model accepted.",
            "# TYPE moe_cluster_speculative_accepted_total counter",
            f"moe_cluster_speculative_accepted_total {self.accepted}",
            "# HELP moe_cluster_decode_allreduces_total MoE all-reduces paid by decode steps (steps x MoE "
            "layers); over moe_cluster_generated_tokens_total: all-reduces per generated token.",
            "# TYPE moe_cluster_decode_allreduces_total counter",
            f"moe_cluster_decode_allreduces_total {self.decode_allreduces}",
            "# HELP moe_cluster_speculative_acceptance Share of drafted tokens accepted, since the start.",
            "# TYPE moe_cluster_speculative_acceptance gauge",
            f"moe_cluster_speculative_acceptance {self.speculation()['acceptance']:.4f}",
            "# HELP moe_cluster_decode_allreduces_per_token MoE all-reduces per generated token, since "
            "the start (one step per token: the MoE layers).",
            "# TYPE moe_cluster_decode_allreduces_per_token gauge",
            f"moe_cluster_decode_allreduces_per_token {self.speculation()['allreduces_per_token']:.4f}",
            "# HELP moe_cluster_prompt_tokens_per_second Prompt throughput of the last request.",
            "# TYPE moe_cluster_prompt_tokens_per_second gauge",
            f"moe_cluster_prompt_tokens_per_second {self.last_prompt_tps:.3f}",
            "# HELP moe_cluster_generation_tokens_per_second Generation throughput of the last request.",
            "# TYPE moe_cluster_generation_tokens_per_second gauge",
            f"moe_cluster_generation_tokens_per_second {self.last_generation_tps:.3f}",
            "# HELP moe_cluster_time_to_first_token_seconds Time from request to first token.",
            "# TYPE moe_cluster_time_to_first_token_seconds histogram",
            *self.ttft.lines("moe_cluster_time_to_first_token_seconds"),
            "# HELP moe_cluster_prompt_cache_hits_total Requests that reused a cached prefix.",
            "# TYPE moe_cluster_prompt_cache_hits_total counter",
            f"moe_cluster_prompt_cache_hits_total {self.cache_hits}",
            "# HELP moe_cluster_prompt_cache_reused_tokens_total Prompt tokens served from the prompt cache.",
            "# TYPE moe_cluster_prompt_cache_reused_tokens_total counter",
            f"moe_cluster_prompt_cache_reused_tokens_total {self.cached_tokens}",
            "# HELP moe_cluster_requests_running Requests running now (up to serving.max_batch together).",
            "# TYPE moe_cluster_requests_running gauge",
            f"moe_cluster_requests_running {s.get('running', 0)}",
            "# HELP moe_cluster_queue_depth Requests running or waiting.",
            "# TYPE moe_cluster_queue_depth gauge",
            f"moe_cluster_queue_depth {s['queue_depth']}",
            "# HELP moe_cluster_node_up 1 if the node is loaded and answering.",
            "# TYPE moe_cluster_node_up gauge",
            *(
                f'moe_cluster_node_up{{node="{n["name"]}"}} {1 if n["state"] == "ready" else 0}'
                for n in s["nodes"]
            ),
            "# HELP moe_cluster_node_memory_used_bytes Memory in use on the node (weights, caches).",
            "# TYPE moe_cluster_node_memory_used_bytes gauge",
            *(
                f'moe_cluster_node_memory_used_bytes{{node="{n["name"]}"}} {n["used_bytes"]}'
                for n in s["nodes"]
            ),
            "# HELP moe_cluster_node_memory_budget_bytes Memory placement gave the node.",
            "# TYPE moe_cluster_node_memory_budget_bytes gauge",
            *(
                f'moe_cluster_node_memory_budget_bytes{{node="{n["name"]}"}} {n["budget_bytes"]}'
                for n in s["nodes"]
            ),
            "# HELP moe_cluster_node_streams Running streams the node attends for (serving.attention).",
            "# TYPE moe_cluster_node_streams gauge",
            *(
                f'moe_cluster_node_streams{{node="{n["name"]}"}} {n.get("streams", 0)}'
                for n in s["nodes"]
            ),
            "# HELP moe_cluster_node_kv_bytes KV the node reserved for its streams (last status).",
            "# TYPE moe_cluster_node_kv_bytes gauge",
            *(
                f'moe_cluster_node_kv_bytes{{node="{n["name"]}"}} {n.get("kv_bytes", 0)}'
                for n in s["nodes"]
            ),
            "# HELP moe_cluster_node_experts Routed experts the node holds, over all layers.",
            "# TYPE moe_cluster_node_experts gauge",
            *(f'moe_cluster_node_experts{{node="{n["name"]}"}} {n["experts"]}' for n in s["nodes"]),
            "# HELP moe_cluster_ready 1 if the cluster serves requests.",
            "# TYPE moe_cluster_ready gauge",
            f"moe_cluster_ready {1 if s['state'] == 'ready' else 0}",
        ]
        layers = cluster.experts()["layers"] if hasattr(cluster, "experts") else []
        if layers:
            lines += [
                "# HELP moe_cluster_expert_selections_total Tokens the router sent to each expert (one per "
                "token and slot) since the load.",
                "# TYPE moe_cluster_expert_selections_total counter",
            ]
            lines += [
                f'moe_cluster_expert_selections_total{{layer="{entry["layer"]}",expert="{e}"}} {n}'
                for entry in layers
                for e, n in enumerate(entry["tokens"])
            ]
        lines += expert_cache_lines(s["nodes"])
        lines += route_lines(s["nodes"])
        hist = getattr(cluster, "allreduce_histograms", {})
        if hist:
            lines += [
                "# HELP moe_cluster_allreduce_seconds Latency of one MoE layer's all-reduce, per node.",
                "# TYPE moe_cluster_allreduce_seconds histogram",
            ]
            for node, h in sorted(hist.items()):
                lines += h.lines("moe_cluster_allreduce_seconds", f'node="{node}"')
        return "\n".join(lines) + "\n"

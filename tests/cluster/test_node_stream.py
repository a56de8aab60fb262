"""The request path between the coordinator and the nodes, seen from a client of the nodes' own
gRPC: rank 0 streams the tokens and the other ranks only say how the request ended (`quiet`), and
a stop sequence of token ids ends the request on every node at the agreed token that completes it
(finish reason stop), without a cancel from the coordinator. Through the HTTP API: a stop string
the model writes ends the completion there."""

from __future__ import annotations

import asyncio

import pytest

from cluster_fixture import cluster, http, stock_tokens, yaml_for
from moe_cluster.node.demo import MODEL_DIR

SECRET = "node-stream-secret"
PROMPT = "To be, or not to be, that is the question:"


def test_only_rank_0_streams_and_a_stop_sequence_ends_the_request_on_every_node(tmp_path):
    from mlx_lm.tokenizer_utils import load

    from moe_cluster.coordinator.serve.client import NodeClient
    from moe_cluster.proto.records import GenerateDone, GeneratedTokens, GenerateRequest, Sampling

    tok = load(MODEL_DIR)
    greedy = stock_tokens(MODEL_DIR, PROMPT, 12)
    prompt = tuple(tok.encode(PROMPT, add_special_tokens=False))
    with cluster(tmp_path, yaml_for(2), env={"MOE_CLUSTER_SECRET": SECRET}) as (url, proc, lines):
        nodes = http(url, "/v1/cluster/status")[1]["nodes"]

        async def run(req: GenerateRequest) -> list[list]:
            """The same request on both nodes at once (they step it in lock-step), rank 1 quiet."""
            clients = [NodeClient(n["name"], n["address"], SECRET) for n in nodes]

            async def one(c, quiet):
                return [
                    e
                    async for e in c.generate(
                        GenerateRequest(
                            req.request_id,
                            req.prompt,
                            req.sampling,
                            stop_sequences=req.stop_sequences,
                            seq=req.seq,
                            quiet=quiet,
                        ),
                        timeout=60,
                    )
                ]

            try:
                return await asyncio.gather(
                    *(one(c, n["rank"] != 0) for c, n in zip(clients, nodes))
                )
            finally:
                for c in clients:
                    await c.close()

        def tokens(events):
            return [t for e in events if isinstance(e, GeneratedTokens) for t in e.ids]

        def done(events):
            (d,) = [e for e in events if isinstance(e, GenerateDone)]
            return d

        full = asyncio.run(
            run(GenerateRequest("direct-1", prompt, Sampling(max_tokens=12), seq=10_001))
        )
        assert tokens(full[0]) == greedy and tokens(full[1]) == []
        assert done(full[0]).generated_tokens == done(full[1]).generated_tokens == 12
        # a stop sequence: tokens 4 and 5 of the greedy output; both nodes end the request there
        stop = (greedy[4], greedy[5])
        cut = asyncio.run(
            run(
                GenerateRequest(
                    "direct-2", prompt, Sampling(max_tokens=12), seq=10_002, stop_sequences=(stop,)
                )
            )
        )
        assert tokens(cut[0]) == greedy[:6] and tokens(cut[1]) == []
        assert [done(e).finish_reason for e in cut] == ["stop", "stop"]
        assert [done(e).generated_tokens for e in cut] == [6, 6]

        # through the API: the stop string's text is cut and the reason is stop
        text = tok.decode(greedy)
        stop_text = tok.decode(greedy[6:8])
        status, out = http(
            url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "stop": [stop_text]}
        )
        assert status == 200 and out["choices"][0]["finish_reason"] == "stop", out
        assert out["choices"][0]["text"] == text[: text.index(stop_text)], out

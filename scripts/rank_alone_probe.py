"""Where does a cluster token's time go beyond each node's own compute? Every rank of an N-node
cluster decodes here at once, one process each, with a collective that waits for nobody (its
all-reduce returns the node's own partial), so each rank's ms per token is its compute alone, with
the other ranks beside it on the same cores. Set against `bench decode`'s cluster rows on the same
checkpoint: the difference is the all-reduce plus the wait for the slower node at each layer.

    python scripts/rank_alone_probe.py /tmp/q512 --nodes 2

Prints one JSON line per rank and round: median ms per token.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time


class AloneCollective:
    """A collective of `world` ranks that waits for nobody: its all-reduce returns the node's own
    partial (also scripts/gpu/load_check_probe.py's nodes, whose probes never all-reduce)."""

    in_graph = True

    def __init__(self, rank: int, world: int):
        from moe_cluster.node.collective.base import Rider

        self.rank, self.world_size, self._rider = rank, world, Rider(rank, world)

    def all_reduce(self, partial, layer):
        return partial

    def __getattr__(
        self, name
    ):  # begin, ride, settle, watch, close, abort, failure: nothing to do alone
        return lambda *a, **k: None


def _rank(model: str, rank: int, world: int, tokens: int, rounds: int) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from moe_cluster.node.moe.load import load_shard

    net = load_shard(
        model, None, rank, keepalive="none", collective=AloneCollective(rank, world)
    ).model
    for r in range(rounds):
        cache = make_prompt_cache(net)
        mx.eval(net(mx.array([[1, 2, 3, 4]]), cache=cache))
        token, times = mx.array([[5]]), []
        for _ in range(tokens):
            t0 = time.perf_counter()
            token = mx.argmax(net(token, cache=cache)[:, -1:], axis=-1)
            mx.eval(token)
            times.append(time.perf_counter() - t0)
        print(
            json.dumps(
                {"rank": rank, "round": r, "ms_per_token": round(1e3 * statistics.median(times), 2)}
            ),
            flush=True,
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=60)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--rank", type=int, default=None, help=argparse.SUPPRESS
    )  # one rank's own process
    args = ap.parse_args()
    if args.rank is not None:
        _rank(args.model, args.rank, args.nodes, args.tokens, args.rounds)
        return 0
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                args.model,
                "--nodes",
                str(args.nodes),
                "--tokens",
                str(args.tokens),
                "--rounds",
                str(args.rounds),
                "--rank",
                str(r),
            ]
        )
        for r in range(args.nodes)
    ]
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    raise SystemExit(main())

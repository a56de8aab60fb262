"""Process entry of the envoy: arguments, the secret (stdin or environment, never argv), and
the safeguards that keep it from outliving its node.

Normally the node starts it (node/collective/envoy.py); `moe-cluster envoy` runs one by hand.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ..common.process import die_with_parent, run_grpc_loop
from ..proto.errors import UserError
from ..proto.records import COLLECTIVE_TIMEOUT_S, MESH_CONNECT_TIMEOUT_S, TlsFiles

logger = logging.getLogger("moe_cluster.envoy")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rank", type=int, required=True)
    p.add_argument(
        "--addresses",
        required=True,
        help="every rank's envoy host:port, comma-separated, in rank order",
    )
    p.add_argument(
        "--listen", default="", help="bind address (default: this rank's entry of --addresses)"
    )
    p.add_argument(
        "--data-port",
        type=int,
        default=0,
        help="port of the data channel, on the --listen host (default: any free port; rank 0 "
        "opens none)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=COLLECTIVE_TIMEOUT_S,
        help="seconds a request waits for a peer that was connected and is gone",
    )
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=MESH_CONNECT_TIMEOUT_S,
        help="seconds a request waits for the mesh to be whole the first time",
    )
    p.add_argument(
        "--secret-stdin",
        action="store_true",
        help="read the cluster secret from the first line of stdin (default: $MOE_CLUSTER_SECRET)",
    )
    p.add_argument("--tls-cert", default=None, help="PEM certificate chain of this envoy")
    p.add_argument("--tls-key", default=None, help="PEM private key")
    p.add_argument("--tls-ca", default=None, help="PEM root certificates of the cluster")
    p.add_argument("--link-fd", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--parent-pid", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--log-level", default=None, help="WARNING (default), INFO or DEBUG")


def read_secret(from_stdin: bool) -> str:
    from ..common.auth import SECRET_ENV

    secret = sys.stdin.readline().rstrip("\n") if from_stdin else os.environ.get(SECRET_ENV, "")
    if not secret:
        where = "stdin" if from_stdin else f"${SECRET_ENV}"
        raise UserError(f"no cluster secret on {where}")
    return secret


def config_from_args(args: argparse.Namespace):
    from .envoy import EnvoyConfig

    tls_given = [args.tls_cert, args.tls_key, args.tls_ca]
    if any(tls_given) and not all(tls_given):
        raise UserError("TLS needs --tls-cert, --tls-key and --tls-ca together")
    return EnvoyConfig(
        rank=args.rank,
        addresses=tuple(a.strip() for a in args.addresses.split(",") if a.strip()),
        listen=args.listen,
        secret=read_secret(args.secret_stdin),
        timeout_s=args.timeout,
        connect_timeout_s=args.connect_timeout,
        tls=TlsFiles(args.tls_cert, args.tls_key, args.tls_ca) if all(tls_given) else None,
        link_fd=args.link_fd,
        parent_pid=args.parent_pid,
        data_port=args.data_port,
    )


def run(args: argparse.Namespace) -> int:
    """Run one envoy until its node goes away (or SIGTERM/SIGINT)."""
    # grpc warns "Aborting method ... due to server stop" for every stream still open at exit
    logging.getLogger("grpc._cython.cygrpc").setLevel(logging.ERROR)
    die_with_parent(args.parent_pid)

    def serve():
        from .envoy import Envoy

        return Envoy(config_from_args(args)).run()

    reason = run_grpc_loop(serve)
    logger.info("envoy rank %s exited: %s", args.rank, reason)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m moe_cluster.envoy", description="one envoy of a moe-cluster node"
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    level = (args.log_level or "WARNING").upper()
    logging.basicConfig(
        level=level,
        stream=sys.stderr,
        format=f"%(asctime)s envoy[{args.rank}] %(name)s %(levelname)s: %(message)s",
    )
    try:
        return run(args)
    except (UserError, OSError) as exc:  # OSError: a socket the machine refuses
        print(f"envoy rank {args.rank}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

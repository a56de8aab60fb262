"""`moe-cluster node`: the process a user starts on each Mac. Reads its flags and the cluster
secret, builds the agent (node/agent.py) and serves it until it is stopped."""

from __future__ import annotations

import os

from ..proto.errors import UserError
from .agent import AgentConfig, NodeAgent


def main(args) -> int:
    """`moe-cluster node` entry point."""
    import sys

    from ..common.auth import SECRET_ENV

    if args.exit_with_parent:
        from ..common.process import die_with_parent

        die_with_parent(os.getppid(), "node")
    secret = os.environ.get(SECRET_ENV, "")
    if args.secret_file:
        from pathlib import Path

        try:
            secret = Path(args.secret_file).expanduser().read_text().strip()
        except OSError as exc:
            raise UserError(f"--secret-file {args.secret_file}: {exc.strerror or exc}") from None
    import socket

    config = AgentConfig(
        name=args.name or socket.gethostname().split(".")[0],
        host=args.host,
        port=args.port,
        advertise=args.advertise or "",
        cluster=args.cluster,
        secret=secret,
        mdns=not args.no_mdns,
        interfaces=tuple(args.interface or ()),
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_ca=args.tls_ca,
        memory_bytes=args.memory,
        cache_dir=args.cache_dir or "",
    )
    agent = NodeAgent(config)
    agent.start_preimport()

    def ready(port: int) -> None:
        # one machine-readable line for whoever launched us
        print(f"moe-cluster node {config.name} ready on port {port}", flush=True)
        sys.stdout.flush()

    from ..common.process import run_grpc_loop

    run_grpc_loop(lambda: agent.serve(ready))
    return 0

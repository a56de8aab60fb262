"""Coordinator: the `moe-cluster` command and the products it runs, one folder each.

`serve/` runs a cluster (config, launch or discovery, placement, the API); `plan/` is the
performance model and its inputs; `bench/` the benchmarks; `dev/` the development commands
(simulate, profile, single-node run, chat, demo checkpoints). `cli.py` is the argparse table and
`errors.py` the error types every product raises.
"""

"""The all-reduce a node runs once per MoE layer, behind one interface (`base.Collective`).

`specs.py` holds the picklable transport specs and `make_collective`; each transport is a module
(`shm` for processes of one machine, `envoy` for the per-node gRPC process, `mlx` for
`mx.distributed`) that imports its heavy dependencies only when built. This file imports nothing,
so the specs load without mlx.
"""

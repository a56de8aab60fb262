"""The all-reduce a node runs once per MoE layer, behind one interface (`base.Collective`).

`specs.py` holds the picklable transport specs and `make_collective`; each transport is a module
(`shm` for processes of one machine, `envoy` for TCP between the nodes with an envoy child per
node, `mlx` for `mx.distributed`) that imports its heavy dependencies only when built. The envoy
transport's wire code runs here, in the node: `exchange`, `steps`, `reduce` (and `_sum.c`),
`spin`, `link`, `trace`. This file imports nothing,
so the specs load without mlx.
"""

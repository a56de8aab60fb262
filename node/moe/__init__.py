"""The MoE layer on a cluster: find each MoE block of an mlx-lm model, load only this node's
experts (by byte range, stacked), compute the selected local ones (`experts.py`: a slot plan from
`plan.py` and a kernel from `kernels.py`, with the routing rule of `routing.py`) and all-reduce the block's output once. `families/` holds the adapters for
families whose structure the generic rule cannot read."""

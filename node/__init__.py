"""Node: loads its shard of a MoE model and runs it in lock-step with the other nodes."""

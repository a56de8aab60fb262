"""Node: the agent each Mac runs (`agent.py`, gRPC and mDNS), its runtime (prompt cache and the
lock-step token loop, `runtime.py`, `engine.py`), the cluster MoE layer and shard loading
(`moe/`) and the all-reduce behind one interface (`collective/`). It never imports the
coordinator."""

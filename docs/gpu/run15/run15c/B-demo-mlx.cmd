python3 -m moe_cluster.coordinator.cli bench decode --speculative prompt-lookup --model demo --gpus --nodes 2 --transport mlx --max-tokens 64 --rounds 3 --json

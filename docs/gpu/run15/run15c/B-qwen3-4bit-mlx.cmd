python3 -m moe_cluster.coordinator.cli bench decode --speculative prompt-lookup --model /tmp/qwen3-4bit --gpus --nodes 2 --transport mlx --max-tokens 64 --rounds 2 --spoil 0,0.5,1 --json

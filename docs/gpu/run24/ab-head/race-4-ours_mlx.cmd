python3 -m moe_cluster.coordinator.cli bench race --model /tmp/qwen3-235b-a22b-4bit --nodes 4 --gpus --streams 1 --max-tokens 16 --rows ours_mlx --no-stock --hardware h200 --json

python3 -m moe_cluster.coordinator.cli bench race --model /tmp/qwen3-235b-a22b-4bit --nodes 2 --gpus --streams 32 --max-tokens 16 --rows ours_envoy --no-stock --hardware h200 --json

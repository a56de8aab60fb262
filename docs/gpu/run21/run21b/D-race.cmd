python3 -m moe_cluster.coordinator.cli bench race --model /tmp/qwen3-4bit --gpus --nodes 2 --streams 8 --rows ours_envoy,ours_envoy_overlap --no-stock --max-tokens 16 --json

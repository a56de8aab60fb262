python3 -m moe_cluster.coordinator.cli -v bench decode --model /tmp/qwen3-4bit --nodes 2 --keepalive none --transport mlx --gpus --no-peers --max-tokens 32 --rounds 3 --routes skip,device --json

python3 -m moe_cluster.coordinator.cli bench race --model /tmp/deepseek-v3-4bit --nodes 4 --gpus --streams 1,8,32 --max-tokens 16 --rows mlx_lm_tensor --no-stock --hardware h200 --json

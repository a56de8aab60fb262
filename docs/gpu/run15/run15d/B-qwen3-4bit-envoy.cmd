python3 -m moe_cluster.coordinator.cli bench decode --speculative prompt-lookup --model /tmp/qwen3-4bit --gpus --nodes 2 --transport envoy --max-tokens 64 --rounds 1 --spoil 0,1 --json

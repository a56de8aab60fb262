"""Development commands: `simulate` (N node processes on one machine against stock mlx-lm),
`profile` (which experts the routers pick), `run` (single-node stock generation), `chat`, and
the demo checkpoints (`demo-model`, `train-demo`)."""

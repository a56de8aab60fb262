"""Benchmarks that print JSON: each runs its baseline in the same process tree and reports
ratios (decode against stock mlx-lm, the all-reduce against a socket floor, placement, the
prompt cache)."""

"""Envoy: the per-node gRPC process that all-reduces expert outputs."""

"""Coordinator: the CLI, cluster config, discovery, placement, the API and the performance model."""

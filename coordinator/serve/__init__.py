"""Serving: read cluster.yaml, start or find the nodes, plan placement, load them and serve the
HTTP API, fanning each request out to every node and watching their health. It imports neither
the planner (`plan/`) nor the benchmarks (`bench/`)."""

"""Envoy: each node's sidecar process, which dials, authenticates and keeps its peers and hands
the node a data channel to each (the node exchanges the partials itself)."""

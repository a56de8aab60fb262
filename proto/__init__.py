"""The gRPC contract between coordinator, nodes and envoys, with generated stubs."""

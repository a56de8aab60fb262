"""The gRPC contract between coordinator, nodes and envoys, with generated stubs.

`CHANNEL_OPTIONS` are the options of every channel and server of the project.
"""

MAX_MESSAGE_BYTES = 256 << 20  # a prefill chunk of float32 hidden states fits with room to spare

CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # a dead peer on a LAN is noticed within seconds even while no call is active
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    # reconnect quickly: a restarted node should rejoin within a fraction of a second
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
    ("grpc.enable_retries", 0),
    # a second server on a port in use must fail, not share it
    ("grpc.so_reuseport", 0),
)

"""The one place where protobuf messages become domain records and back, one module per family
of messages: `envoy` (envoy <-> envoy), the Node service's `load`, `generate` (and cancel),
`status` (health, status, shutdown), `probe` and `link`, and the Ship service's `ship`; `enums`
holds the tables they share.

Servicers and stubs call these (or pass them to gRPC as serializers) as `convert.<name>`; nothing
else in the code sees a generated message class.
"""

from __future__ import annotations

from .enums import (
    ConvertError,
)
from .envoy import (
    ENVOY_EXCHANGE,
    ENVOY_HEALTH,
    ENVOY_SERVICE,
    envoy_health_from_wire,
    envoy_health_request_from_wire,
    envoy_health_request_to_wire,
    envoy_health_to_wire,
    hello_from_wire,
    hello_to_wire,
)
from .load import (
    load_progress_from_proto,
    load_progress_to_proto,
    load_request_from_proto,
    load_request_to_proto,
    placement_from_proto,
    placement_to_proto,
    transport_from_proto,
    transport_to_proto,
)
from .generate import (
    cancel_is_abort,
    cancel_reply_from_proto,
    cancel_reply_to_proto,
    cancel_request_from_proto,
    cancel_request_to_proto,
    generate_event_from_proto,
    generate_event_to_proto,
    generate_request_from_proto,
    generate_request_to_proto,
)
from .status import (
    health_from_proto,
    health_request_to_proto,
    health_to_proto,
    shutdown_reply_to_proto,
    shutdown_request_from_proto,
    shutdown_request_to_proto,
    status_from_proto,
    status_request_to_proto,
    status_to_proto,
)
from .probe import (
    probe_reply_from_proto,
    probe_reply_to_proto,
    probe_request_from_proto,
    probe_request_to_proto,
)
from .ship import (
    catalog_reply_from_proto,
    catalog_reply_to_proto,
    catalog_request_to_proto,
    chunk_from_proto,
    chunk_to_proto,
    data_channel_from_proto,
    fetch_request_from_proto,
    fetch_request_to_proto,
)
from .link import (
    link_allreduce_reply_from_proto,
    link_allreduce_reply_to_proto,
    link_allreduce_request_from_proto,
    link_allreduce_request_to_proto,
    link_listen_from_proto,
    link_listen_request_to_proto,
    link_listen_to_proto,
    link_probe_reply_from_proto,
    link_probe_reply_to_proto,
    link_probe_request_from_proto,
    link_probe_request_to_proto,
)

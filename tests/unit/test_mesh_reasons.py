"""Why a peer cannot be reached (envoy/mesh.py `Mesh.last_error`): a peer's refusal stays the reason
until the peer is reached, since gRPC may report the same refusal, raced with the dialer's first
write, as INTERNAL; the dial loop's real errors are fed in as it feeds them."""

from __future__ import annotations

from moe_cluster.envoy.mesh import Mesh, MeshConfig


def _mesh() -> Mesh:
    config = MeshConfig(0, ("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"), "127.0.0.1:0", "s")
    return Mesh(config, on_peer=lambda *a: None, on_channel=lambda *a: None)


def test_a_refusal_stays_the_reason_beside_a_later_garbled_attempt() -> None:
    mesh = _mesh()
    refusal = "UNAUTHENTICATED: /moe_cluster.v1.Envoy/Exchange: missing or wrong cluster secret"
    mesh._note_failure(1, refusal, loud=True, refused=True)
    assert mesh.last_error[1] == refusal
    mesh._note_failure(1, "INTERNAL: Internal error from Core", loud=False)
    assert mesh.last_error[1] == (
        f"{refusal}; the latest attempt: INTERNAL: Internal error from Core"
    )
    # another refusal replaces the first; a peer that never refused is named by its latest error
    mesh._note_failure(1, "FAILED_PRECONDITION: protocol 'x'", loud=True, refused=True)
    assert mesh.last_error[1] == "FAILED_PRECONDITION: protocol 'x'"
    mesh._note_failure(2, "UNAVAILABLE: failed to connect", loud=False)
    assert mesh.last_error[2] == "UNAVAILABLE: failed to connect"

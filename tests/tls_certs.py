"""Certificates made by the tests themselves: a CA and one certificate for 127.0.0.1 it signs."""

from __future__ import annotations

from moe_cluster.proto.records import TlsFiles


def make_tls(folder) -> TlsFiles:
    """A CA and one certificate for 127.0.0.1 signed by it (every envoy presents the same one)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def cert(subject, issuer, key, signer, ca: bool):
        b = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            b = b.add_extension(
                x509.SubjectAlternativeName(
                    [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
                ),
                critical=False,
            )
        return b.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "moe-cluster test CA")])
    ca_cert = cert(ca_name, ca_name, ca_key, ca_key, ca=True)
    leaf = cert(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "envoy")]),
        ca_name,
        key,
        ca_key,
        ca=False,
    )
    paths = TlsFiles(str(folder / "envoy.pem"), str(folder / "envoy.key"), str(folder / "ca.pem"))
    (folder / "envoy.pem").write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    (folder / "ca.pem").write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    (folder / "envoy.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return paths

"""Mutual TLS between pdserve processes, with certificates made here: a real
prefill server, decode server and gateway serve exactly as in plaintext; a
plaintext client, and a TLS client without a certificate from the CA, are
refused by the engine servers."""
from __future__ import annotations

import datetime
import ipaddress

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.processes import GatewayProcess, ServiceProcess, free_port

pytestmark = pytest.mark.slow


def _cert(subject: str, issuer_key, issuer_name, key, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder()
         .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
         .issuer_name(issuer_name or x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        b = (b.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                          x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                             critical=False)
             .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                            critical=False))
    return b.sign(issuer_key, hashes.SHA256())


def _pem_key(key) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    out = {}
    for name in ("ca", "stranger-ca"):
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca = _cert(name, ca_key, None, ca_key, ca=True)
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _cert("pdserve", ca_key, ca.subject, key, ca=False)
        paths = {"ca": d / f"{name}.pem", "cert": d / f"{name}-node.pem", "key": d / f"{name}-node.key"}
        paths["ca"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
        paths["cert"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        paths["key"].write_bytes(_pem_key(key))
        out[name] = paths
    return out


def test_cluster_over_mutual_tls(tiny_llama_dir, certs):
    ours = certs["ca"]
    flags = ["--tls-cert", str(ours["cert"]), "--tls-key", str(ours["key"]), "--tls-ca", str(ours["ca"])]
    ports = {role: free_port() for role in ("prefill", "decode")}
    engines = [ServiceProcess(role, f"{role}_service.server",
                              ["--port", str(port), "--metrics-port", "0", "--model", str(tiny_llama_dir),
                               "--kv-cache-memory", "16MiB", *flags], f"{role} server ready",
                              env={"OMP_NUM_THREADS": "1"})
               for role, port in ports.items()]
    gw = GatewayProcess("gw-tls", ["--prefill", f"127.0.0.1:{ports['prefill']}",
                                   "--decode", f"127.0.0.1:{ports['decode']}", "--max-model-len", "512", *flags])
    procs = [gw, *engines]
    try:
        for p in procs:
            p.wait_ready()
        gw.wait_healthy()
        stub = gateway_pb2_grpc.GatewayStub(grpc.insecure_channel(gw.grpc_address))  # the client port: plaintext
        prompt = [7 + (j * 13) % 370 for j in range(40)]
        sampling = common_pb2.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        deltas = list(stub.Generate(gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=prompt),
                                                                sampling=sampling), timeout=60))
        assert sum(len(d.token_ids) for d in deltas) == 4 and deltas[-1].finish_reason == "length"

        def check(channel: grpc.Channel) -> None:
            with channel:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)

        decode = f"127.0.0.1:{ports['decode']}"
        with pytest.raises(grpc.RpcError):  # plaintext to a TLS port
            check(grpc.insecure_channel(decode))
        stranger = certs["stranger-ca"]
        creds = grpc.ssl_channel_credentials(root_certificates=ours["ca"].read_bytes(),
                                             private_key=stranger["key"].read_bytes(),
                                             certificate_chain=stranger["cert"].read_bytes())
        with pytest.raises(grpc.RpcError):  # a client certificate from another CA
            check(grpc.secure_channel(decode, creds))
        good = grpc.ssl_channel_credentials(root_certificates=ours["ca"].read_bytes(),
                                            private_key=ours["key"].read_bytes(),
                                            certificate_chain=ours["cert"].read_bytes())
        check(grpc.secure_channel(decode, good))
    finally:
        codes = [p.stop() for p in procs]
    assert codes == [0, 0, 0], [p.logs() for p in procs]

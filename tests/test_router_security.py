"""The router's front door: API keys (gRPC metadata and the OpenAI HTTP API) and TLS, with the real SDK."""

from __future__ import annotations

import asyncio
import datetime
import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from baton.client import AsyncClient, BatonError
from baton.router.config import RouterConfig
from baton.router.security import API_KEYS_ENV, RouterSecurity
from baton.router.server import main, start_router
from tests.test_router_fakes import expected_tokens, run, start_fake


def self_signed(tmp_path) -> tuple[str, str]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


def post(url: str, body: bytes | None, auth: str | None,
         context: ssl.SSLContext | None = None) -> tuple[int, dict | None]:
    """(status, error body) of a POST (or a GET without a body)."""
    headers = {"Content-Type": "application/json", **({"Authorization": auth} if auth else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=body, headers=headers), timeout=10,
                                    context=context) as r:
            return r.status, None
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_keys_come_from_a_file_and_the_environment(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# team a\nalpha\n\nbeta\n")
    sec = RouterSecurity.from_sources(str(f), environ={API_KEYS_ENV: "gamma, delta"})
    assert sec.api_keys == {"alpha", "beta", "gamma", "delta"} and sec.requires_key and not sec.tls
    assert sec.allows("Bearer beta") and sec.allows("bearer gamma")
    assert not sec.allows(None) and not sec.allows("Bearer nope") and not sec.allows("beta")
    assert RouterSecurity().allows(None)  # no keys configured: open
    for kwargs, field in [({"api_keys_file": str(tmp_path / "missing")}, "api_keys_file"),
                          ({"tls_cert": str(f)}, "tls"),
                          ({"tls_cert": str(f), "tls_key": str(f)}, "tls_cert")]:
        with pytest.raises(ValueError, match=field):
            RouterSecurity.from_sources(**kwargs, environ={})
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n")
    with pytest.raises(ValueError, match="at least one key"):
        RouterSecurity.from_sources(str(empty), environ={})


def test_main_refuses_a_bad_tls_pair(tmp_path, capsys):
    cert, _ = self_signed(tmp_path)
    assert main(["--port", "0", "--decode", "127.0.0.1:1", "--tls-cert", cert]) == 2
    assert "tls" in capsys.readouterr().err


def test_api_key_and_tls_with_the_sdk(tmp_path):
    cert, key = self_signed(tmp_path)
    roots = Path(cert).read_bytes()
    security = RouterSecurity(frozenset({"k1", "k2"}), roots, Path(key).read_bytes())

    async def go():
        fake, server, addr = await start_fake("decode", "d0")
        router = await start_router(RouterConfig((), (addr,)), 0, "localhost", http_port=0, served_model_name="m",
                                    security=security)
        target = f"localhost:{router.port}"
        try:
            async with AsyncClient(target, api_key="k2", root_certificates=roots, timeout=10, retries=0) as c:
                done = await c.generate([1, 2, 3], max_tokens=4)
                assert list(done.token_ids) == expected_tokens([1, 2, 3], 4)
                assert (await c.health()).ok  # open even without a key, below
            async with AsyncClient(target, root_certificates=roots, timeout=10, retries=0) as c:
                assert (await c.health()).ok
                with pytest.raises(BatonError) as e:
                    await c.generate([1, 2, 3], max_tokens=4)
                assert e.value.code == "UNAUTHENTICATED"
            async with AsyncClient(target, api_key="wrong", root_certificates=roots, timeout=10, retries=0) as c:
                with pytest.raises(BatonError) as e:
                    await c.generate([1, 2, 3], max_tokens=4)
                assert e.value.code == "UNAUTHENTICATED"
            # Plain text to a TLS port does not get through.
            async with AsyncClient(target, api_key="k1", timeout=3, retries=0) as c:
                with pytest.raises(BatonError) as e:
                    await c.generate([1, 2, 3], max_tokens=4)
                assert e.value.code == "UNAVAILABLE"
            assert len(fake.decodes) == 1  # refused calls never reached a worker
            # The OpenAI-compatible HTTP API is HTTPS too and wants the same keys; /health and /metrics stay open.
            base = f"https://localhost:{router.http.port}"
            trust = ssl.create_default_context(cafile=cert)
            body = json.dumps({"model": "m", "prompt": [1, 2, 3], "max_tokens": 2}).encode()
            # (urllib blocks: run it off this loop, which is also the router's.)
            for auth, status in [(None, 401), ("Bearer nope", 401), ("Bearer k1", 200)]:
                got, err = await asyncio.to_thread(post, f"{base}/v1/completions", body, auth, trust)
                assert got == status, auth
                if status == 401:
                    assert err["error"]["type"] == "authentication_error"
            for path in ("/health", "/metrics"):
                got, _ = await asyncio.to_thread(post, base + path, None, None, trust)
                assert got == 200, path
            # Plain HTTP gets no answer from the HTTPS port.
            with pytest.raises((urllib.error.URLError, ConnectionError)):
                await asyncio.to_thread(post, f"http://localhost:{router.http.port}/health", None, None)
        finally:
            await router.stop(0)
            await server.stop(0)

    run(go())

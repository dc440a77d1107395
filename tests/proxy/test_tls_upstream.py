"""https:// upstreams: a fake engine serving TLS with a self-signed certificate made for the
test (by the openssl command), called through the proxy with the certificate trusted
(``proxy.upstream_tls.ca_file``), not trusted (a clean 502), or not checked (``verify: false``);
and upstream URLs the proxy cannot call refused when the settings are read."""

from __future__ import annotations

import logging
import ssl
import subprocess
from pathlib import Path

import aiohttp
import orjson
import pytest

from proxy.keys import UPSTREAM
from proxy.upstream import UpstreamClient, UpstreamTLSError, tls_context
from shared.settings import SettingsError, settings_from_mapping
from tests.proxy.conftest import EngineFactory, ProxyFactory
from tests.proxy.fake_engine import FakeEngine
from tests.proxy.upstream_servers import Run

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(certificate, key) for 127.0.0.1 and localhost, self-signed."""
    folder = tmp_path_factory.mktemp("tls")
    crt, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=IP:127.0.0.1,DNS:localhost",
            "-keyout",
            str(key),
            "-out",
            str(crt),
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )
    return crt, key


def _server_context(cert: tuple[Path, Path]) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(*cert)
    return ctx


@pytest.fixture
async def tls_engine(engine_factory: EngineFactory, cert: tuple[Path, Path]) -> FakeEngine:
    return await engine_factory(name="tls", models=("m",), ssl_context=_server_context(cert))


async def _post(url: str, body: object) -> tuple[int, str, bytes]:
    async with aiohttp.ClientSession() as session, session.post(url, json=body) as r:
        return r.status, r.headers.get("Content-Type", ""), await r.read()


async def test_trusted_ca_file_calls_and_streams_over_tls(
    proxy_factory: ProxyFactory, tls_engine: FakeEngine, cert: tuple[Path, Path]
) -> None:
    assert tls_engine.url.startswith("https://")
    proxy = await proxy_factory([("m", tls_engine.url)], upstream_tls={"ca_file": str(cert[0])})
    status, _, body = await _post(f"{proxy.url}/v1/chat/completions", CHAT)
    assert status == 200 and orjson.loads(body)["choices"][0]["message"]["content"].startswith(
        "tls: tok0"
    )
    status, ctype, body = await _post(f"{proxy.url}/v1/chat/completions", {**CHAT, "stream": True})
    assert status == 200 and ctype.startswith("text/event-stream")
    assert body.endswith(b"data: [DONE]\n\n") and b"tok4" in body
    assert proxy.app[UPSTREAM].connections() == (1, 1)  # one TLS connection, pooled and reused
    recs = await proxy.records()
    assert [(r["upstream"], r["status"], r["error"]) for r in recs] == [
        (tls_engine.url, 200, None)
    ] * 2
    assert recs[1]["completion_tokens"] == 5
    # Probes and /v1/models use the same trust: the engine's own metadata comes back.
    async with aiohttp.ClientSession() as session, session.get(f"{proxy.url}/v1/models") as r:
        models = orjson.loads(await r.read())["data"]
    assert models == [{"id": "m", "object": "model", "owned_by": "vllm", "max_model_len": 4096}]


async def test_untrusted_certificate_is_a_clean_502(
    proxy_factory: ProxyFactory, tls_engine: FakeEngine, caplog: pytest.LogCaptureFixture
) -> None:
    proxy = await proxy_factory([("m", tls_engine.url)])  # verify on, the system's CAs
    with caplog.at_level(logging.WARNING, logger="proxy.forward"):
        status, ctype, body = await _post(f"{proxy.url}/v1/chat/completions", CHAT)
    assert (status, ctype) == (502, "application/json")
    err = orjson.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["code"]) == ("bad_gateway", "upstream_error")
    assert "TLS handshake" in err["message"] and "Traceback" not in err["message"]
    assert tls_engine.calls == []  # nothing was sent
    [line] = [r.getMessage() for r in caplog.records if r.name == "proxy.forward"]
    assert tls_engine.url in line and "model m" in line and "certificate" in line
    [rec] = await proxy.records()
    assert rec["status"] == 502 and rec["error"].startswith("connect: TLS handshake with")


async def test_untrusted_replica_is_retried_on_a_trusted_one(
    proxy_factory: ProxyFactory, tls_engine: FakeEngine, engine_factory: EngineFactory
) -> None:
    plain = await engine_factory(name="plain", models=("m",))
    proxy = await proxy_factory([("m", tls_engine.url), ("m", plain.url)])
    for _ in range(4):  # whichever replica is picked first, the call is served
        status, _, body = await _post(f"{proxy.url}/v1/chat/completions", CHAT)
        assert status == 200 and b"plain: tok0" in body
    assert tls_engine.calls == []


async def test_verify_false_accepts_any_certificate(
    proxy_factory: ProxyFactory, tls_engine: FakeEngine
) -> None:
    proxy = await proxy_factory([("m", tls_engine.url)], upstream_tls={"verify": False})
    status, _, body = await _post(f"{proxy.url}/v1/chat/completions", CHAT)
    assert status == 200 and b"tls: tok0" in body


async def test_https_url_to_a_plain_http_engine_is_a_clean_502(
    proxy_factory: ProxyFactory, engine: FakeEngine
) -> None:
    url = engine.url.replace("http://", "https://")
    proxy = await proxy_factory([("m", url)], upstream_tls={"verify": False})
    status, ctype, body = await _post(f"{proxy.url}/v1/chat/completions", CHAT)
    assert (status, ctype) == (502, "application/json")
    assert orjson.loads(body)["error"]["code"] == "upstream_error"


def test_client_pools_tls_per_scheme_host_port_on_every_loop(
    run: Run, cert: tuple[Path, Path]
) -> None:
    async def body() -> None:
        eng = await FakeEngine(name="tls", ssl_context=_server_context(cert)).start()
        port = eng.port
        trusted = UpstreamClient(ssl_context=tls_context(ca_file=str(cert[0])))
        untrusted = UpstreamClient()
        try:
            for url in (f"https://127.0.0.1:{port}", f"https://127.0.0.1:{port}/"):
                async with await trusted.request(
                    "POST",
                    url,
                    "/v1/completions",
                    [("Content-Type", "application/json")],
                    b'{"model": "m", "prompt": "a"}',
                ) as r:
                    assert r.status == 200 and b"tls: tok0" in await r.read()
            assert trusted.connections() == (1, 1)
            with pytest.raises(UpstreamTLSError, match="certificate"):
                await untrusted.request("POST", eng.url, "/v1/completions", [], b"{}")
            # Plain http to the TLS port is a different pool and fails on its own terms.
            with pytest.raises(Exception) as plain:
                await trusted.request(
                    "POST", f"http://127.0.0.1:{port}", "/v1/completions", [], b"{}"
                )
            assert not isinstance(plain.value, UpstreamTLSError)
        finally:
            await trusted.close()
            await untrusted.close()
            await eng.stop()

    run(body)


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("ftp://10.0.0.5:8000", "must start with http:// or https://"),
        ("http://10.0.0.5:0", "port must be between 1 and 65535"),
        ("http://10.0.0.5:65536", "Port out of range"),
        ("http://10.0.0.5:80x", "Port could not be cast"),
        ("http://user:pass@10.0.0.5:8000", "must not hold credentials"),
        ("http://10.0.0.5:8000?x=1", "must not have a query or fragment"),
        ("http://10.0.0.5:8000#top", "must not have a query or fragment"),
        ("http://10.0.0.5:8000/v1", "must not have a path"),
        ("http://:8000", "names no host"),
        ("http://[::1:8000", "Invalid IPv6 URL"),
        ("https://ëngine:8000", "host must be ASCII"),
    ],
)
def test_upstream_urls_the_proxy_cannot_call_are_refused(url: str, why: str) -> None:
    doc = {
        "proxy": {"upstreams": [{"model": "m", "url": "http://ok:1"}, {"model": "m", "url": url}]}
    }
    with pytest.raises(SettingsError) as err:
        settings_from_mapping(doc)
    assert err.value.path == "proxy.upstreams[1].url"
    assert why in str(err.value) and "\n" not in str(err.value)


def test_upstream_urls_the_proxy_can_call_are_kept() -> None:
    urls = ["http://10.0.0.5:8000", "https://engine.internal", "http://[::1]:9000/", "HTTP://h"]
    doc = {"proxy": {"upstreams": [{"model": "m", "url": u} for u in urls]}}
    got = [u.url for u in settings_from_mapping(doc).proxy.upstreams]
    assert got == [
        "http://10.0.0.5:8000",
        "https://engine.internal",
        "http://[::1]:9000",
        "HTTP://h",
    ]


def test_tls_settings_are_checked(tmp_path: Path, cert: tuple[Path, Path]) -> None:
    ok = settings_from_mapping({"proxy": {"upstream_tls": {"ca_file": str(cert[0])}}})
    assert ok.proxy.upstream_tls.verify and ok.proxy.upstream_tls.ca_file == str(cert[0])
    (tmp_path / "junk.pem").write_text("not a certificate\n")
    for value, why in [
        (str(tmp_path / "missing.pem"), "No such file"),
        (str(tmp_path / "junk.pem"), "no certificate"),
    ]:
        with pytest.raises(SettingsError) as err:
            settings_from_mapping({"proxy": {"upstream_tls": {"ca_file": value}}})
        assert err.value.path == "proxy.upstream_tls.ca_file" and why in str(err.value)
    with pytest.raises(SettingsError) as err:
        settings_from_mapping({"proxy": {"upstream_tls": {"verify": "yes"}}})
    assert err.value.path == "proxy.upstream_tls.verify"
    with pytest.raises(SettingsError) as err:
        settings_from_mapping(
            {"proxy": {"upstreams": [{"model": "m", "url": "http://h:1", "api_key": "a\nb"}]}}
        )
    assert err.value.path == "proxy.upstreams[0].api_key"

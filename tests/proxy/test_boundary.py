"""The proxy's edge (issue 22): only engine routes reach engines, every client mistake is an
OpenAI-shaped 4xx (aiohttp's own refusals included, with no traceback logged), clients that
stall are cut, and the recorded status is the one the client got."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Any

import orjson
import pytest
from aiohttp import web

from proxy.app import make_app, make_runner
from shared.settings import SettingsError, settings_from_mapping
from tests.proxy.conftest import ProxyFactory, ProxyHandle
from tests.proxy.fake_engine import FakeEngine
from tests.proxy.raw_client import assert_openai_error, exchange, request_bytes
from tests.proxy.upstream_servers import raw_server, read_request

CHAT = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


@pytest.mark.parametrize(
    "path",
    [
        b"/v1/load_lora_adapter",
        b"/admin/x",
        b"/v1/chat%20completions",
        b"/v1/chat/completions/",
        b"/v1//chat/completions",
        b"/V1/chat/completions",
        b"/w/a%2Fb/v1/chat/completions",
        b"/w/a%2fv1/chat/completions",
        b"/w/%2E%2E/v1/chat/completions",
        b"/w/x/../v1/chat/completions",
        b"/w/x/r/../v1/chat/completions",
        b"/w//v1/chat/completions",
        b"/w/x/r//v1/chat/completions",
        b"/w/x",
        b"/w/x/v1/load_lora_adapter",
        b"/w/a%00b/v1/chat/completions",
    ],
)
async def test_only_engine_routes_reach_engines(
    proxy: ProxyHandle, engine: FakeEngine, path: bytes
) -> None:
    resp = await asyncio.to_thread(exchange, proxy.port, request_bytes("POST", path, CHAT))
    err = assert_openai_error(resp, 404)
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "not_found", None)
    assert engine.calls == [] and await proxy.records() == []


async def test_the_upstream_path_is_the_allow_lists_own(
    proxy: ProxyHandle, engine: FakeEngine
) -> None:
    for path in (
        b"/w/caf%C3%A9/r/r%201/v1/chat/completions?x=1&y=/admin",
        b"/w/beam/v1/chat/completions",
        b"/v1/chat/completions?debug=1",
    ):
        resp = await asyncio.to_thread(exchange, proxy.port, request_bytes("POST", path, CHAT))
        assert resp.status == 200, resp.body
    assert [c.path for c in engine.calls] == ["/v1/chat/completions"] * 3
    recs = await proxy.records()
    assert [(r["workflow"], r["request_id"]) for r in recs] == [
        ("café", "r 1"),
        ("beam", None),
        ("wf0", None),
    ]


async def test_extra_routes(proxy_factory: ProxyFactory, engine: FakeEngine) -> None:
    proxy = await proxy_factory([("m", engine.url)], extra_routes=["/tokenize"])
    resp = await asyncio.to_thread(
        exchange, proxy.port, request_bytes("POST", b"/w/wf/tokenize", CHAT)
    )
    assert resp.status == 200 and engine.calls[-1].path == "/tokenize"
    [rec] = await proxy.records()
    assert (rec["endpoint"], rec["workflow"]) == ("/tokenize", "wf")
    for bad in ("tokenize", "/a/../b", "/w/x", "/a?b=1", "/a%2Fb", "/a//b"):
        doc = {"proxy": {"extra_routes": [bad]}}
        with pytest.raises(SettingsError, match=r"proxy\.extra_routes\[0\]"):
            settings_from_mapping(doc)


DEEP = b'{"model": "m", "messages": [], "x": ' + b"[" * 1000 + b"]" * 1000 + b"}"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (DEEP, None),
        (
            b'{"model": "m", "messages": [], "stream": true, "stream_options": [1]}',
            "stream_options",
        ),
        (b'{"model": "m", "messages": [], "stream_options": "yes"}', "stream_options"),
        (b'{"model": "m", "messages": [], "stream": "yes"}', "stream"),
        (b'{"model": 5, "messages": []}', "model"),
        (b'{"model": ["m"], "messages": []}', "model"),
        (
            b'{"model": "m", "messages": [], "stream": true, "x": '
            + b"[" * 300
            + b"]" * 300
            + b"}",
            None,
        ),
    ],
)
async def test_wrong_typed_or_too_deep_bodies_are_400s(
    proxy_factory: ProxyFactory, engine: FakeEngine, body: bytes, param: str | None
) -> None:
    for record_bodies in (True, False):
        proxy = await proxy_factory([("m", engine.url)], record_bodies=record_bodies)
        resp = await asyncio.to_thread(
            exchange, proxy.port, request_bytes("POST", b"/v1/chat/completions", body)
        )
        err = assert_openai_error(resp, 400)
        assert err["param"] == param
    assert engine.calls == []


async def test_wrong_methods_and_paths_answer_openai_json(proxy: ProxyHandle) -> None:
    for method, path, status in [
        ("GET", b"/v1/chat/completions", 405),
        ("PUT", b"/v1/models", 405),
        ("GET", b"/nope", 405),  # every path takes a POST (answered 404 there)
        ("DELETE", b"/admin/routes", 405),
    ]:
        resp = await asyncio.to_thread(exchange, proxy.port, request_bytes(method, path))
        err = assert_openai_error(resp, status)
        assert err["type"] == "invalid_request_error"


async def test_parser_refusals_are_openai_json_without_a_traceback(
    proxy: ProxyHandle, caplog: pytest.LogCaptureFixture
) -> None:
    many = [(b"X-H%d" % i, b"v") for i in range(300)]
    cases = [
        b"GARBAGE\r\n\r\n",
        b"POST /v1/chat/completions HTTP/9.9\r\nHost: x\r\n\r\n",
        request_bytes("POST", b"/v1/chat/completions", CHAT, many),
        request_bytes("POST", b"/v1/chat/completions", CHAT, [(b"X-Long", b"a" * 20000)]),
        request_bytes("POST", b"/" + b"a" * 20000, CHAT),
        request_bytes("POST", b"/v1/chat/completions", CHAT, [(b"X-Bad", b"a\x01b")]),
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    ]
    with caplog.at_level(logging.DEBUG):
        for data in cases:
            resp = await asyncio.to_thread(exchange, proxy.port, data)
            err = assert_openai_error(resp)
            assert 400 <= resp.status < 500, (data[:60], resp.status)
            assert err["type"] == "invalid_request_error"
    assert not [r for r in caplog.records if r.exc_info], [r.getMessage() for r in caplog.records]


async def test_a_malformed_chunked_body_is_a_400(proxy: ProxyHandle) -> None:
    data = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b'Connection: close\r\n\r\n5\r\n{"mod\r\nZZ\r\n'
    )
    resp = await asyncio.to_thread(exchange, proxy.port, data)
    assert_openai_error(resp, 400)


def _closed_within(port: int, data: bytes, limit: float) -> float:
    """Seconds until the proxy closed a connection that sent ``data`` and nothing more."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=limit) as sock:
        if data:
            sock.sendall(data)
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
    return time.monotonic() - start


async def test_stalled_clients_are_cut(proxy_factory: ProxyFactory, engine: FakeEngine) -> None:
    proxy = await proxy_factory(
        [("m", engine.url)], client_header_timeout_s=0.5, client_body_timeout_s=0.5
    )
    # Nothing at all, and half a request head: closed at the header timeout.
    assert await asyncio.to_thread(_closed_within, proxy.port, b"", 5.0) < 3.0
    half = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
    assert await asyncio.to_thread(_closed_within, proxy.port, half, 5.0) < 3.0
    # Half a body: a 408 in OpenAI shape, then the connection is closed.
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 500\r\n\r\n"
    )
    start = time.monotonic()
    resp = await asyncio.to_thread(exchange, proxy.port, head + CHAT[:10], 5.0)
    assert time.monotonic() - start < 3.0
    assert_openai_error(resp, 408)
    # A body sent slowly but within the limit is served.
    resp = await asyncio.to_thread(
        exchange, proxy.port, request_bytes("POST", b"/v1/chat/completions", CHAT)
    )
    assert resp.status == 200


async def _one_reply(
    reply: bytes, stall: bool, proxy_factory: ProxyFactory, **kw: object
) -> tuple[int, dict[str, Any]]:
    seen: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await read_request(reader))
        writer.write(reply.replace(b"{SEEN}", seen[-1].replace(b"\r\n", b" ")))
        await writer.drain()
        if stall:
            await reader.read()  # until the proxy gives up on the exchange and closes

    async with raw_server(handler) as (url, _):
        proxy = await proxy_factory([("m", url)], **kw)
        data = request_bytes(
            "POST",
            b"/v1/chat/completions",
            CHAT,
            [(b"Authorization", b"Bearer sk-client-key-123456")],
        )
        resp = await asyncio.to_thread(exchange, proxy.port, data)
        [rec] = [r for r in await proxy.records() if r["upstream"] == url]
        await proxy.stop()
    return resp.status, rec


async def test_recorded_status_is_what_the_client_got(proxy_factory: ProxyFactory) -> None:
    # A plain body cut short: the head said 200, the client got a 502.
    status, rec = await _one_reply(
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial", False, proxy_factory
    )
    assert status == rec["status"] == 502 and rec["error"].startswith("upstream:")
    # A plain body that stops coming: the client got a 504.
    status, rec = await _one_reply(
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial",
        True,
        proxy_factory,
        read_timeout_s=0.3,
    )
    assert status == rec["status"] == 504 and rec["error"] == "upstream timed out"


async def test_an_upstream_error_echoing_the_key_is_not_stored(proxy_factory: ProxyFactory) -> None:
    # The engine quotes the request it got (its Authorization header with it) in its error.
    reply = (
        b"HTTP/1.1 401 Unauthorized\r\nContent-Type: application/json\r\nConnection: close\r\n"
        b'\r\n{"error": {"message": "Incorrect API key in {SEEN}"}}'
    )
    status, rec = await _one_reply(reply, False, proxy_factory)
    assert status == rec["status"] == 401
    assert "sk-client-key" not in rec["error"] and "[redacted]" in rec["error"]
    assert "Incorrect API key" in rec["error"]


def _chunked(method: bytes, path: bytes, body: bytes, auth: bytes = b"") -> bytes:
    head = b"%s %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n" % (method, path)
    head += b"Authorization: Bearer %s\r\n" % auth if auth else b""
    return head + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)


async def test_aiohttp_own_answers_are_openai_json(
    proxy_factory: ProxyFactory, engine: FakeEngine
) -> None:
    """aiohttp's HTTPNotFound, HTTPMethodNotAllowed and HTTPRequestEntityTooLarge, and the
    proxy's own 413, reach the client as OpenAI JSON (never aiohttp's text/plain)."""
    proxy = await proxy_factory([("m", engine.url)], max_body_bytes=2048, admin_token="t")
    big = b'{"x": "' + b"a" * 5000 + b'"}'
    for data, status, code in [
        (b"OPTIONS * HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 404, "not_found"),
        (request_bytes("GET", b"/v1/chat/completions"), 405, "method_not_allowed"),
        (request_bytes("PUT", b"/health"), 405, "method_not_allowed"),
        (request_bytes("POST", b"/v1/chat/completions", big), 413, "request_too_large"),
        (_chunked(b"POST", b"/v1/chat/completions", big), 413, "request_too_large"),
        (
            request_bytes("PUT", b"/admin/routes", big, [(b"Authorization", b"Bearer t")]),
            413,
            "request_too_large",
        ),
        (_chunked(b"PUT", b"/admin/routes", big, b"t"), 413, "request_too_large"),
        (request_bytes("POST", b"/nope", CHAT), 404, "not_found"),
    ]:
        resp = await asyncio.to_thread(exchange, proxy.port, data)
        err = assert_openai_error(resp, status)
        assert (err["type"], err["code"]) == ("invalid_request_error", code), data[:40]
        if status == 405:
            assert "POST" in resp.headers["allow"].split(","), resp.headers
    assert engine.calls == [] and await proxy.records() == []


async def test_a_handler_bug_is_a_500_in_openai_shape(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Any exception a handler lets out is a JSON 500 and one log line with its traceback."""

    async def buggy(request: web.Request) -> web.Response:
        raise RuntimeError("a bug")

    doc = {"proxy": {"listen": "127.0.0.1:0"}, "store": {"path": str(tmp_path / "store")}}
    app = make_app(settings_from_mapping(doc))
    app.router.add_get("/bug", buggy)
    runner = make_runner(app, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        with caplog.at_level(logging.INFO):
            resp = await asyncio.to_thread(
                exchange, runner.addresses[0][1], request_bytes("GET", b"/bug")
            )
    finally:
        await runner.cleanup()
    err = assert_openai_error(resp, 500)
    assert (err["type"], err["code"]) == ("internal_error", "internal_error")
    assert "a bug" not in err["message"]  # the log has the detail, the client does not
    [bug] = [r for r in caplog.records if r.exc_info]
    assert bug.getMessage() == "bug: GET /bug failed"

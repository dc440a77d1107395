"""Header values the client sends, whatever their bytes: forwarded upstream byte for byte, or
refused with a 400 — never a 5xx. Requests are written on a raw socket, so any bytes can be
sent (an HTTP client library would refuse or re-encode them); a property test covers
arbitrary text (non-Latin-1, lone surrogates, controls) and arbitrary bytes."""

from __future__ import annotations

import asyncio
import socket

import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.keys import RECORDER
from tests.proxy.conftest import ProxyHandle
from tests.proxy.fake_engine import FakeEngine

CHAT = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
# Forwarded upstream as they are (the proxy drops hop-by-hop, credential-less and X-Scepsy-*).
FORWARDED = ("X-Title", "x-session-id", "Idempotency-Key", "traceparent", "Authorization")
NAMES = (*FORWARDED, "X-Scepsy-Workflow", "X-Scepsy-Request-Id", "x-stainless-retry-count")


def _send(port: int, name: str, value: bytes) -> tuple[int, bytes]:
    """POST a chat call carrying ``name: value`` (raw bytes); (status, whole response)."""
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n%s: %s\r\n\r\n"
        % (len(CHAT), name.encode(), value)
    )
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(head + CHAT)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1]), data


def _seen(engine: FakeEngine, name: str) -> bytes:
    """The bytes of ``name`` in the engine's last call (aiohttp decoded them as the proxy's
    did: UTF-8 with undecodable bytes as surrogates, which encoding the same way undoes)."""
    return engine.calls[-1].headers[name].encode("utf-8", "surrogateescape")


async def test_non_latin1_and_undecodable_values_pass_byte_for_byte(
    proxy: ProxyHandle, engine: FakeEngine
) -> None:
    for value in ("日本".encode(), b"caf\xe9 \xff\xfe", "🦜 ü".encode(), b"\xed\xa0\x80"):
        status, data = await asyncio.to_thread(_send, proxy.port, "X-Title", value)
        assert status == 200, data
        assert _seen(engine, "X-Title") == value


async def test_identity_headers_with_undecodable_bytes_are_stored_as_replacement_characters(
    proxy: ProxyHandle, engine: FakeEngine
) -> None:
    for name in ("X-Scepsy-Workflow", "X-Scepsy-Request-Id", "Idempotency-Key", "x-session-id"):
        status, data = await asyncio.to_thread(_send, proxy.port, name, b"w\xff\xfe-\xe6\x97\xa5")
        assert status == 200, data
    recs = await proxy.records()
    assert proxy.app[RECORDER].write_errors == 0 and len(recs) == 4
    assert recs[0]["workflow"] == "w\ufffd\ufffd-日"
    assert recs[1]["request_id"] == "w\ufffd\ufffd-日"
    assert recs[2]["call_id"] == "w\ufffd\ufffd-日"
    assert recs[3]["request_id"] == "w\ufffd\ufffd-日"
    assert _seen(engine, "x-session-id") == b"w\xff\xfe-\xe6\x97\xa5"  # still byte for byte


async def test_odd_retry_counts_are_ignored(proxy: ProxyHandle) -> None:
    for value in ("²".encode(), "٣".encode(), b"9" * 5000, b"-1"):
        status, data = await asyncio.to_thread(_send, proxy.port, "x-stainless-retry-count", value)
        assert status == 200, data
    assert [r["attempt"] for r in await proxy.records()] == [0, 0, 0, 0]


async def test_control_characters_are_a_400(proxy: ProxyHandle) -> None:
    status, _ = await asyncio.to_thread(_send, proxy.port, "X-Title", b"a\x01b")
    assert status == 400


_VALUES = st.one_of(
    st.text(st.characters(exclude_categories=()), max_size=40).map(
        lambda s: s.encode("utf-8", "surrogatepass")  # lone surrogates as their 3 bytes
    ),
    st.binary(max_size=40),
)


async def test_no_header_value_gives_a_5xx(proxy: ProxyHandle, engine: FakeEngine) -> None:
    @settings(
        max_examples=250,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(name=st.sampled_from(NAMES), value=_VALUES)
    def prop(name: str, value: bytes) -> None:
        status, data = _send(proxy.port, name, value)
        assert status < 500, data
        clean = not any(b in value for b in b"\r\n")
        sent = value.strip(b" \t")  # what HTTP makes of it: surrounding blanks are not part
        if status == 200 and clean and name in FORWARDED:
            if name == "Authorization" and not sent:
                assert name not in engine.calls[-1].headers  # an empty key is not passed on
            else:
                assert _seen(engine, name) == sent

    await asyncio.to_thread(prop)
    await proxy.flush()
    assert proxy.app[RECORDER].write_errors == 0
    status, data = await asyncio.to_thread(_send, proxy.port, "X-Title", b"after")
    assert status == 200, data

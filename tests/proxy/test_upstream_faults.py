"""proxy.upstream against broken or unusual servers (closing unanswered, malformed heads,
cut bodies, silence, pipelined extras, idle closes), and the wire parser fed at every split
point through a recording transport; under asyncio's loop and uvloop."""

from __future__ import annotations

import asyncio
import socket

import pytest

from proxy.upstream import (
    UpstreamClient,
    UpstreamConnectError,
    UpstreamProtocolError,
    UpstreamUnanswered,
)
from proxy.upstream_wire import Connection, Target
from tests.proxy.upstream_servers import (
    OK,
    Run,
    post,
    raw_server,
    read_request,
)

# -- broken or unusual servers ---------------------------------------------------------------


def test_refused_port_is_a_connect_error(run: Run) -> None:
    async def body() -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]  # bound, never listening: connections are refused
            client = UpstreamClient()
            with pytest.raises(UpstreamConnectError) as info:
                await post(client, f"http://127.0.0.1:{port}")
            assert isinstance(info.value, ConnectionError)
        await client.close()

    run(body)


def test_connect_timeout_is_a_connect_error(run: Run) -> None:
    async def body() -> None:
        listener = socket.socket()
        fillers = [socket.socket() for _ in range(3)]
        try:
            listener.bind(("127.0.0.1", 0))
            listener.listen(0)  # never accepts: once its queue is full, SYNs go unanswered
            port = listener.getsockname()[1]
            for s in fillers:
                s.setblocking(False)
                s.connect_ex(("127.0.0.1", port))
            client = UpstreamClient(connect_timeout_s=0.2)
            with pytest.raises(UpstreamConnectError, match="timed out"):
                await post(client, f"http://127.0.0.1:{port}")
            assert client.connections() == (0, 0)
            await client.close()
        finally:
            for s in [listener, *fillers]:
                s.close()

    run(body)


def test_closed_unanswered_is_not_retryable(run: Run) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)

    async def body() -> None:
        async with raw_server(handler) as (url, accepted):
            client = UpstreamClient()
            with pytest.raises(UpstreamUnanswered) as info:
                await post(client, url)
            # The engine read the call: it may have started on it, so it is not a connect error.
            assert not isinstance(info.value, UpstreamConnectError)
            assert len(accepted) == 1  # a fresh connection is not retried
            await client.close()

    run(body)


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 2x0 OK\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/2 200 OK\r\n\r\n",
        b"SSH-2.0-OpenSSH\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n",  # head cut by the close
    ],
)
def test_malformed_response_is_a_protocol_error(run: Run, reply: bytes) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(reply)
        await writer.drain()
        await asyncio.sleep(0.05)

    async def body() -> None:
        async with raw_server(handler) as (url, _):
            client = UpstreamClient()
            with pytest.raises(UpstreamProtocolError):
                await post(client, url)
            await client.close()

    run(body)


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\ndata\r\n4\r\nda",
    ],
)
def test_disconnect_mid_body_is_a_protocol_error(run: Run, reply: bytes) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(reply)
        await writer.drain()

    async def body() -> None:
        async with raw_server(handler) as (url, _):
            client = UpstreamClient()
            r = await client.request("POST", url, "/", [], b"")
            with pytest.raises(UpstreamProtocolError):
                await r.read()
            r.release()
            await client.close()

    run(body)


def test_read_timeout(run: Run) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = await read_request(reader)
        if request.startswith(b"POST /body"):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        elif request.startswith(b"POST /eof"):
            writer.write(b"HTTP/1.0 200 OK\r\n\r\nabc")  # a body that ends at the close
        await reader.read()  # then silence until the client gives up

    async def body() -> None:
        async with raw_server(handler) as (url, _):
            client = UpstreamClient(read_timeout_s=0.15)
            with pytest.raises(TimeoutError):
                await post(client, url, "/head")
            for path in ("/body", "/eof"):
                r = await client.request("POST", url, path, [], b"")
                with pytest.raises(TimeoutError):
                    await r.read()
                r.release()
            await client.close()

    run(body)


def test_total_timeout_despite_steady_bytes(run: Run) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
        for _ in range(1000):
            writer.write(b"x")
            await asyncio.sleep(0.02)

    async def body() -> None:
        async with raw_server(handler) as (url, _):
            client = UpstreamClient(read_timeout_s=0.25, total_timeout_s=0.4)
            r = await client.request("POST", url, "/", [], b"")
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            with pytest.raises(TimeoutError, match="total"):
                await r.read()
            assert loop.time() - t0 < 1.5
            r.release()
            await client.close()

    run(body)


def test_cancel_before_the_head_closes_the_connection(run: Run) -> None:
    hung_up = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        hung_up.append(await reader.read() == b"")  # EOF once the client closes

    async def body() -> None:
        async with raw_server(handler) as (url, _):
            client = UpstreamClient()
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(post(client, url), 0.1)
            for _ in range(100):
                if hung_up:
                    break
                await asyncio.sleep(0.01)
            assert hung_up == [True]
            assert client.connections() == (0, 0)
            await client.close()

    run(body)


def test_idle_close_by_the_server_then_a_new_connection(run: Run) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(OK)
        await writer.drain()  # then close, as uvicorn does past its keep-alive timeout

    async def body() -> None:
        async with raw_server(handler) as (url, accepted):
            client = UpstreamClient()
            assert await post(client, url) == (200, b"ok")
            await asyncio.sleep(0.05)  # the server has closed the pooled connection
            assert await post(client, url) == (200, b"ok")
            assert len(accepted) == 2
            await client.close()

    run(body)


def test_reused_connection_closed_unanswered_is_retried_once(run: Run) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(OK)
        await read_request(reader)  # a second request on this connection: close unanswered

    async def body() -> None:
        async with raw_server(handler) as (url, accepted):
            client = UpstreamClient()
            assert await post(client, url) == (200, b"ok")
            assert await post(client, url) == (200, b"ok")  # retried on a fresh connection
            assert len(accepted) == 2
            await client.close()

    run(body)


@pytest.mark.parametrize(
    "reply",
    [
        OK + b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nextra",  # pipelined extra response
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok",
    ],
)
def test_connections_not_reusable_are_not_pooled(run: Run, reply: bytes) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await read_request(reader):
            writer.write(reply)

    async def body() -> None:
        async with raw_server(handler) as (url, accepted):
            client = UpstreamClient()
            assert await post(client, url) == (200, b"ok")
            await asyncio.sleep(0.02)  # let any extra bytes arrive before release... and after
            assert await post(client, url) == (200, b"ok")
            assert len(accepted) == 2
            await client.close()

    run(body)


def test_body_until_close_and_interim_responses(run: Run) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.0 200 OK\r\nX-K: v\r\n\r\nuntil ")
        await writer.drain()
        await asyncio.sleep(0.02)
        writer.write(b"close")

    async def body() -> None:
        async with raw_server(handler) as (url, _):
            client = UpstreamClient()
            r = await client.request("POST", url, "/", [], b"")
            assert (r.status, r.headers["x-k"]) == (200, "v")
            assert await r.read() == b"until close"
            r.release()
            await client.close()

    run(body)


def test_bad_arguments_are_value_errors(run: Run) -> None:
    async def body() -> None:
        client = UpstreamClient()
        with pytest.raises(ValueError, match="http://"):
            await client.request("POST", "ftp://127.0.0.1:1", "/", [], b"")
        with pytest.raises(ValueError, match="path"):
            await client.request("POST", "http://127.0.0.1:1/v1", "/", [], b"")
        with pytest.raises(ValueError, match="line breaks"):
            await client.request("POST", "http://127.0.0.1:1", "/", [("X", "a\r\nB: c")], b"")
        with pytest.raises(ValueError, match="request line"):
            await client.request("POST", "http://127.0.0.1:1", "/a b", [], b"")
        await client.close()

    run(body)


# -- the parser at every split point ---------------------------------------------------------


class RecordingTransport:
    """What a Connection needs of a transport, recording what it is asked to do."""

    def __init__(self) -> None:
        self.written = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


WIRE_CASES = [
    (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b'5;ext=1\r\nhello\r\n1;a;b="c"\r\n \r\n5\r\nworld\r\n0\r\nX-Trailer: t\r\nY: u\r\n\r\n',
        b"hello world",
        True,
    ),
    (
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 3\r\n\r\nabc",
        b"abc",
        True,
    ),
    (b"HTTP/1.1 204 No Content\r\n\r\n", b"", True),
    (b"HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 1\r\n\r\nz", b"z", True),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokEXTRA", b"ok", False),
    (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n", b"", False),
    # Bare LF line endings (RFC 9112 §2.2 lets a recipient accept them), whole or mixed.
    (b"HTTP/1.1 200 OK\nContent-Length: 2\n\nok", b"ok", True),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\n\r\nok", b"ok", True),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\nok", b"ok", True),
    (
        b"HTTP/1.1 200 OK\nTransfer-Encoding: chunked\n\n5\nhello\n6;x\r\n world\n0\nT: t\n\n",
        b"hello world",
        True,
    ),
]


@pytest.mark.parametrize(("wire", "expected", "reusable"), WIRE_CASES)
def test_parser_at_every_split(run: Run, wire: bytes, expected: bytes, reusable: bool) -> None:
    async def body() -> None:
        loop = asyncio.get_running_loop()
        for split in range(1, len(wire) + 1):
            conn = Connection(loop, Target("h", 1, b""), lambda c: None)
            transport = RecordingTransport()
            conn.connection_made(transport)  # type: ignore[arg-type]
            conn.send(b"GET / HTTP/1.1\r\n\r\n", b"", False, 10.0, loop.time() + 10)
            # two reads: [0, split) and [split, end): every boundary is one of them
            conn.data_received(wire[:split])
            if split < len(wire):
                conn.data_received(wire[split:])
            assert conn.exc is None, (split, conn.exc)
            assert conn.body_done and b"".join(conn.pieces) == expected, split
            assert conn.keep_alive is reusable, split
            conn.connection_lost(None)  # cancels the timer

    run(body)


def test_parser_byte_by_byte(run: Run) -> None:
    async def body() -> None:
        loop = asyncio.get_running_loop()
        for wire, expected, reusable in WIRE_CASES:
            conn = Connection(loop, Target("h", 1, b""), lambda c: None)
            conn.connection_made(RecordingTransport())  # type: ignore[arg-type]
            conn.send(b"GET / HTTP/1.1\r\n\r\n", b"", False, 10.0, loop.time() + 10)
            for i in range(len(wire)):
                conn.data_received(wire[i : i + 1])
            assert conn.body_done and b"".join(conn.pieces) == expected
            assert conn.keep_alive is reusable
            conn.connection_lost(None)

    run(body)


def test_bare_lf_answer_is_parsed_at_once(run: Run) -> None:
    """An engine answering with bare-LF line endings is read as soon as its bytes are in, not
    after the read timeout (300 s here)."""

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\nContent-Type: application/json\nContent-Length: 2\n\n{}")
        await writer.drain()
        await asyncio.sleep(0.5)

    async def body() -> None:
        async with raw_server(handler) as (url, _):
            client = UpstreamClient(read_timeout_s=300.0)
            r = await asyncio.wait_for(client.request("POST", url, "/", [], b""), 2.0)
            assert r.status == 200 and r.headers["Content-Type"] == "application/json"
            assert await asyncio.wait_for(r.read(), 2.0) == b"{}"
            r.release()
            await client.close()

    run(body)

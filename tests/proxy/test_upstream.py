"""proxy.upstream against real loopback servers, under asyncio's loop and uvloop.

An aiohttp app on port 0 plays a well-behaved engine (JSON, SSE, big bodies, one that streams
until the client hangs up); raw asyncio servers play the broken ones (closing unanswered,
malformed heads, cut bodies, silence, pipelined extras, idle closes). The wire parser is also
fed byte by byte through a recording transport, so every split point of a response is parsed.
Each test runs in a fresh loop of each kind and must leave no task behind.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any

import orjson
import pytest
import uvloop
from aiohttp import web

from proxy.upstream import (
    UpstreamClient,
    UpstreamConnectError,
    UpstreamProtocolError,
    UpstreamUnanswered,
)
from proxy.upstream_wire import HIGH_WATER, Connection, Target

Run = Callable[[Callable[[], Coroutine[Any, Any, None]]], None]
LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop] | None] = {
    "asyncio": None,
    "uvloop": uvloop.new_event_loop,
}
BIG = 3 * 1024 * 1024


@pytest.fixture(params=list(LOOPS))
def run(request: pytest.FixtureRequest) -> Run:
    """Run one test coroutine in a fresh loop of the parametrized kind; fail on leftovers."""

    def runner(test: Callable[[], Coroutine[Any, Any, None]]) -> None:
        with asyncio.Runner(loop_factory=LOOPS[request.param]) as r:
            r.run(asyncio.wait_for(test(), 10))
            left = [t for t in asyncio.all_tasks(r.get_loop()) if not t.done()]
            assert not left, f"tasks left running: {left}"

    return runner


# -- servers ---------------------------------------------------------------------------------


class Engine:
    """The aiohttp fake engine's observations."""

    def __init__(self) -> None:
        self.url = ""
        self.gate = asyncio.Event()  # /sse sends its second half once this is set
        self.hung_up = asyncio.Event()  # /forever saw its client disconnect


def _engine_app(eng: Engine) -> web.Application:
    async def json_(request: web.Request) -> web.Response:
        body = await request.read()
        port = request.transport.get_extra_info("peername")[1]  # type: ignore[union-attr]
        echo = {
            "port": port,
            "body": body.decode(),
            "headers": [[str(k), v] for k, v in request.headers.items()],
        }
        return web.Response(body=orjson.dumps(echo), content_type="application/json")

    async def sse(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: first\n\n")
        await eng.gate.wait()
        for i in range(5):
            await resp.write(b"data: %d\n\n" % i)
        await resp.write_eof()
        return resp

    async def forever(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            while True:
                await resp.write(b"data: tick\n\n")
                await asyncio.sleep(0.01)
        except (asyncio.CancelledError, ConnectionError):
            eng.hung_up.set()
            raise

    async def big(request: web.Request) -> web.StreamResponse:
        data = bytes(range(256)) * (BIG // 256)
        if request.query.get("chunked"):
            resp = web.StreamResponse()
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            for i in range(0, BIG, 100_000):
                await resp.write(data[i : i + 100_000])
            await resp.write_eof()
            return resp
        return web.Response(body=data)

    app = web.Application()
    app.router.add_post("/json", json_)
    app.router.add_post("/sse", sse)
    app.router.add_post("/forever", forever)
    app.router.add_post("/big", big)
    return app


@asynccontextmanager
async def engine() -> AsyncIterator[Engine]:
    eng = Engine()
    runner = web.AppRunner(_engine_app(eng), handler_cancellation=True, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
    await site.start()
    eng.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
    try:
        yield eng
    finally:
        eng.gate.set()
        await runner.cleanup()


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A raw TCP server running ``handler`` per connection; yields its URL and a list that
    gets one entry per accepted connection."""
    accepted: list[int] = []
    tasks: set[asyncio.Task[Any]] = set()

    async def on_conn(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        accepted.append(1)
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            tasks.discard(task)

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", accepted
    finally:
        server.close()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One request (head and Content-Length body), or b"" at end of stream."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return b""
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":", 1)[1])
    return head + await reader.readexactly(length)


OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


async def post(client: UpstreamClient, url: str, path: str = "/json") -> tuple[int, bytes]:
    async with await client.request("POST", url, path, [("X-A", "1")], b"{}") as r:
        return r.status, await r.read()


# -- a well-behaved engine -------------------------------------------------------------------


def test_json_request_and_response(run: Run) -> None:
    async def body() -> None:
        async with engine() as eng:
            client = UpstreamClient()
            headers = [("Content-Type", "application/json"), ("Host", "evil"), ("X-Two", "a")]
            headers.append(("X-Two", "b"))
            r = await client.request("POST", eng.url, "/json", headers, b'{"q": 1}')
            echo = orjson.loads(await r.read())
            r.release()
            assert r.status == 200 and r.reason == "OK"
            assert r.headers["content-type"].startswith("application/json")
            assert echo["body"] == '{"q": 1}'
            sent = [(k.lower(), v) for k, v in echo["headers"]]
            assert ("host", eng.url.removeprefix("http://")) in sent
            assert [v for k, v in sent if k == "host"] == [eng.url.removeprefix("http://")]
            assert [v for k, v in sent if k == "content-length"] == ["8"]
            assert [v for k, v in sent if k == "x-two"] == ["a", "b"]
            assert ("content-type", "application/json") in sent
            await client.close()

    run(body)


def test_sse_pieces_arrive_before_the_stream_ends(run: Run) -> None:
    async def body() -> None:
        async with engine() as eng:
            client = UpstreamClient()
            async with await client.request("POST", eng.url, "/sse", [], b"{}") as r:
                assert r.headers["Content-Type"] == "text/event-stream"
                pieces = r.iter_any()
                first = await anext(pieces)
                assert first == b"data: first\n\n"  # seen while the server still holds the rest
                eng.gate.set()
                rest = b"".join([p async for p in pieces])
            assert rest == b"".join(b"data: %d\n\n" % i for i in range(5))
            assert client.connections() == (1, 1)
            await client.close()

    run(body)


def test_sequential_requests_reuse_one_connection(run: Run) -> None:
    async def body() -> None:
        async with engine() as eng:
            client = UpstreamClient()
            ports = set()
            for url in [eng.url, eng.url + "/"] * 3:  # two spellings, one pool
                status, data = await post(client, url)
                assert status == 200
                ports.add(orjson.loads(data)["port"])
            assert len(ports) == 1
            await client.close()

    run(body)


def test_big_bodies_content_length_and_chunked(run: Run) -> None:
    async def body() -> None:
        async with engine() as eng:
            client = UpstreamClient()
            expected = bytes(range(256)) * (BIG // 256)
            for path in ("/big", "/big?chunked=1"):
                assert await post(client, eng.url, path) == (200, expected)
            await client.close()

    run(body)


def test_slow_consumer_pauses_reading(run: Run) -> None:
    async def body() -> None:
        async with engine() as eng:
            client = UpstreamClient()
            sizes = []
            async with await client.request("POST", eng.url, "/big", [], b"") as r:
                async for piece in r.iter_any():
                    sizes.append(len(piece))
                    await asyncio.sleep(0.02)  # loopback would deliver all 3 MiB meanwhile
            assert sum(sizes) == BIG
            assert max(sizes) <= HIGH_WATER + 512 * 1024, sizes
            await client.close()

    run(body)


def test_pool_limits_idle_time_and_size(run: Run) -> None:
    async def body() -> None:
        async with engine() as eng:
            client = UpstreamClient(idle_timeout_s=0.15, max_idle_per_host=2)
            results = await asyncio.gather(*(post(client, eng.url) for _ in range(5)))
            assert [status for status, _ in results] == [200] * 5
            assert client.connections()[1] == 2  # the other three were closed at release
            await asyncio.sleep(0.01)
            assert client.connections() == (2, 2)
            await asyncio.sleep(0.4)  # past the idle timeout
            assert client.connections() == (0, 0)
            assert (await post(client, eng.url))[0] == 200
            await client.close()

    run(body)


def test_200_concurrent_requests(run: Run) -> None:
    async def body() -> None:
        async with engine() as eng:
            client = UpstreamClient()
            results = await asyncio.gather(*(post(client, eng.url) for _ in range(200)))
            assert all(status == 200 for status, _ in results)
            assert len({orjson.loads(d)["port"] for _, d in results}) <= 200
            again = await asyncio.gather(*(post(client, eng.url) for _ in range(200)))
            assert all(status == 200 for status, _ in again)
            assert client.connections()[0] <= 200  # the second round reused the first's
            await client.close()
            assert client.connections() == (0, 0)

    run(body)


def test_cancel_mid_stream_closes_the_connection(run: Run) -> None:
    async def body() -> None:
        async with engine() as eng:
            client = UpstreamClient()
            started = asyncio.Event()

            async def consume() -> None:
                async with await client.request("POST", eng.url, "/forever", [], b"{}") as r:
                    async for _ in r.iter_any():
                        started.set()

            task = asyncio.create_task(consume())
            await started.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.wait_for(eng.hung_up.wait(), 2)
            assert client.connections()[1] == 0
            await client.close()

    run(body)


def test_unread_body_is_not_pooled(run: Run) -> None:
    async def body() -> None:
        async with engine() as eng:
            client = UpstreamClient()
            r = await client.request("POST", eng.url, "/forever", [], b"{}")
            r.release()  # body not read: the connection must close, the engine must notice
            await asyncio.wait_for(eng.hung_up.wait(), 2)
            assert client.connections()[1] == 0
            await client.close()

    run(body)


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
            await client.request("POST", "https://127.0.0.1:1", "/", [], b"")
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

"""proxy.upstream against a well-behaved engine (JSON, SSE, big bodies, pooling,
cancellation), under asyncio's loop and uvloop."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from proxy.upstream import (
    UpstreamClient,
)
from proxy.upstream_wire import HIGH_WATER
from tests.proxy.upstream_servers import (
    BIG,
    Run,
    engine,
    post,
)

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

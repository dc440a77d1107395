"""A minimal engine stand-in for the proxy benchmark: raw asyncio HTTP/1.1, never the bottleneck.

Role: answers ``POST`` (any path) with a small fixed vLLM-shaped chat completion (with
``usage``), or, when the body asks ``"stream": true``, a Server-Sent Event stream of
``chunks`` chunk events, then the usage event when ``stream_options.include_usage`` is set (or
``stream_options`` is ``{}``, as vLLM does), then ``data: [DONE]``. A ``POST`` to a path ending
in ``/render`` (vLLM's ``/v1/chat/completions/render``, which the vLLM router asks before each
call to route on prompt tokens) answers fixed prompt ``token_ids`` and counts as a render, not
as a POST. ``GET /health`` answers 200; ``GET /stats`` returns how many POSTs, streams and
renders it has served, and how many POSTs carried ``X-Bench-Direct`` (the benchmark sends it on
direct runs only, so the other POSTs are the ones that came through the proxy, to compare with
the proxy's store). Any other path answers 404 (the SGLang gateway's metadata probes fall back
and go on). Run as ``python -m bench.proxy._upstream --port 0 [--chunks K]``; it prints
``upstream listening on PORT`` once it accepts connections.

Invariants:
- every response is pre-built bytes; a request costs a header scan and a dict lookup, and
  the JSON body is parsed only when it mentions ``"stream"``;
- requests are parsed from a per-connection buffer, so partial reads and pipelined requests
  are answered in order; a pipelined request waits until the stream before it has ended;
- a stream writes each event as its own chunk in its own event-loop turn (as an engine emits
  one token at a time), and waits while the transport's buffer is over its high-water mark.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections import deque

import orjson

MODEL = "bench"
_OK = b"HTTP/1.1 200 OK\r\n"
_HEAD_END = b"\r\n\r\n"
_MAX_HEAD = 64 * 1024

_COMPLETION = orjson.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 1700000000,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "pong", "tool_calls": []},
                "logprobs": None,
                "finish_reason": "stop",
                "stop_reason": None,
            }
        ],
        "usage": {"prompt_tokens": 12, "total_tokens": 13, "completion_tokens": 1},
    }
)


# vLLM's render answer (a GenerateRequest): the prompt's token ids; ``features`` for media.
_RENDER = orjson.dumps(
    {"request_id": "render-bench", "token_ids": list(range(1000, 1012)), "features": None}
)


def _response(body: bytes, ctype: bytes = b"application/json", status: bytes = _OK) -> bytes:
    return (
        status
        + b"Content-Type: "
        + ctype
        + b"\r\nContent-Length: "
        + str(len(body)).encode()
        + _HEAD_END
        + body
    )


def _chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


def _event(obj: object) -> bytes:
    return _chunk(b"data: " + orjson.dumps(obj) + b"\n\n")


def stream_events(chunks: int) -> tuple[list[bytes], bytes, bytes]:
    """(chunk events, usage event, ``[DONE]`` + end of body), each as HTTP chunked bytes."""
    base = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1700000000}
    events = []
    for i in range(chunks):
        delta = {"role": "assistant", "content": ""} if i == 0 else {"content": f" t{i}"}
        last = i == chunks - 1
        choice = {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": "length" if last else None,
        }
        events.append(_event({**base, "model": MODEL, "choices": [choice]}))
    usage = {"prompt_tokens": 12, "total_tokens": 12 + chunks, "completion_tokens": chunks}
    usage_event = _event({**base, "model": MODEL, "choices": [], "usage": usage})
    done = _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
    return events, usage_event, done


def wants_usage(body: dict[str, object]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and (not options or bool(options.get("include_usage")))


class Counters:
    def __init__(self) -> None:
        self.posts = 0
        self.direct_posts = 0
        self.streams = 0
        self.renders = 0


class EngineProtocol(asyncio.Protocol):
    """One keep-alive connection: a byte buffer parsed into requests, answered in order."""

    def __init__(self, counters: Counters, chunks: int) -> None:
        self.counters = counters
        self.events, self.usage_event, self.done = stream_events(chunks)
        self.stream_head = (
            _OK + b"Content-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        self.completion = _response(_COMPLETION)
        self.render = _response(_RENDER)
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self.streaming = False
        self.close_after = False
        self.can_write = asyncio.Event()
        self.can_write.set()
        self.pending: deque[bytes] = deque()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.can_write.set()  # wake a stream so it sees the closed transport and ends

    def pause_writing(self) -> None:
        self.can_write.clear()

    def resume_writing(self) -> None:
        self.can_write.set()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if not self.streaming:
            self._serve()

    def _serve(self) -> None:
        """Answer every complete request in the buffer (stops at a stream or a partial one)."""
        buf = self.buf
        while not self.streaming and self.transport is not None:
            end = buf.find(_HEAD_END)
            if end < 0:
                if len(buf) > _MAX_HEAD:
                    self._fail(b"431 Request Header Fields Too Large")
                return
            head = bytes(buf[:end]).lower()
            length = 0
            at = head.find(b"\r\ncontent-length:")
            if at >= 0:
                stop = head.find(b"\r\n", at + 2)
                length = int(head[at + 17 : stop if stop >= 0 else None])
            elif b"\r\ntransfer-encoding:" in head:
                self._fail(b"411 Length Required")
                return
            total = end + 4 + length
            if len(buf) < total:
                return
            body = bytes(buf[end + 4 : total])
            del buf[:total]
            self.close_after = b"\r\nconnection: close" in head
            self._answer(head, body)
            if self.close_after and not self.streaming and self.transport is not None:
                self.transport.close()

    def _answer(self, head: bytes, body: bytes) -> None:
        assert self.transport is not None
        if head.startswith(b"post ") and head.split(b" ", 2)[1].endswith(b"/render"):
            self.counters.renders += 1
            self.transport.write(self.render)
        elif head.startswith(b"post "):
            self.counters.posts += 1
            if b"\r\nx-bench-direct:" in head:
                self.counters.direct_posts += 1
            if b'"stream"' in body:
                parsed = orjson.loads(body)
                if isinstance(parsed, dict) and parsed.get("stream") is True:
                    self.counters.streams += 1
                    self.streaming = True
                    asyncio.get_running_loop().create_task(self._stream(wants_usage(parsed)))
                    return
            self.transport.write(self.completion)
        elif head.startswith(b"get /stats"):
            c = self.counters
            stats = {
                "posts": c.posts,
                "direct_posts": c.direct_posts,
                "streams": c.streams,
                "renders": c.renders,
            }
            self.transport.write(_response(orjson.dumps(stats)))
        elif head.startswith(b"get /health"):
            self.transport.write(_response(b'{"status":"ok"}'))
        elif head.startswith(b"get /v1/models"):
            model = {"id": MODEL, "object": "model", "owned_by": "bench", "max_model_len": 4096}
            self.transport.write(_response(orjson.dumps({"object": "list", "data": [model]})))
        else:
            self.transport.write(
                _response(b'{"error":"not found"}', status=b"HTTP/1.1 404 Not Found\r\n")
            )

    async def _stream(self, usage: bool) -> None:
        transport = self.transport
        assert transport is not None
        transport.write(self.stream_head)
        for event in self.events:
            await asyncio.sleep(0)  # one event per loop turn, as an engine emits tokens
            if not self.can_write.is_set():
                await self.can_write.wait()
            if self.transport is None:
                return
            transport.write(event)
        if usage:
            transport.write(self.usage_event)
        transport.write(self.done)
        self.streaming = False
        if self.close_after:
            transport.close()
        elif self.buf:
            self._serve()

    def _fail(self, status: bytes) -> None:
        assert self.transport is not None
        self.transport.write(_response(b"", status=b"HTTP/1.1 " + status + b"\r\n"))
        self.transport.close()


async def serve(host: str, port: int, chunks: int) -> None:
    loop = asyncio.get_running_loop()
    counters = Counters()
    server = await loop.create_server(
        lambda: EngineProtocol(counters, chunks), host, port, backlog=4096, reuse_address=True
    )
    actual = server.sockets[0].getsockname()[1]
    print(f"upstream listening on {actual} (pid {os.getpid()})", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description="minimal vLLM-shaped upstream for bench.proxy.overhead")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--chunks", type=int, default=64, help="chunk events per stream")
    args = p.parse_args()
    try:
        asyncio.run(serve(args.host, args.port, args.chunks))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()

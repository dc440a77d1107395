"""A fake vLLM replica: a real aiohttp app on a loopback port, speaking vLLM's wire shapes.

Behaviour is chosen per call by the ``X-Fake-Mode`` header (which the proxy forwards like any
other non-Scepsy header): ``cut`` ends a stream mid-way by dropping the connection,
``error_event`` sends a mid-stream error event, ``status500`` answers 500 with an error body,
``hang`` never answers (to test cancellation), ``slow`` paces stream events, ``hold`` sends
the first token (streams) or nothing (plain calls) and then waits for ``FakeEngine.release``.
Two optional headers shape any call: ``X-Fake-Tokens`` (tokens generated, default
``FakeEngine.tokens``) and ``X-Fake-Delay-S`` (seconds to wait before answering).
Every call the fake saw is kept in ``FakeEngine.calls`` (path, headers, body) for assertions;
``in_flight``/``peak_in_flight`` count calls being answered, ``cancelled`` the calls whose
client (the proxy) hung up while the fake waited, ``probes`` the ``/health`` requests.
``kill()`` dies like a killed process: the port stops listening and every open connection is
dropped at once; ``start(port)`` brings a replica back on the same port.
``/v1/responses`` speaks the Responses API: a whole ``response`` object, or (``stream``) named
events from ``response.created`` to ``response.completed`` (which carries ``usage``), with the
modes above (``error_event`` sends the API's ``error`` event). With ``ssl_context`` set the
fake serves https.
"""

from __future__ import annotations

import asyncio
import itertools
import ssl
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web


@dataclass
class SeenCall:
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


@dataclass
class FakeEngine:
    name: str = "fake"
    models: tuple[str, ...] = ("m",)
    tokens: int = 5
    healthy: bool = True
    calls: list[SeenCall] = field(default_factory=list)
    cancelled: int = 0
    in_flight: int = 0
    peak_in_flight: int = 0
    probes: int = 0
    release: asyncio.Event = field(default_factory=asyncio.Event)
    runner: web.AppRunner | None = None
    port: int = 0
    ssl_context: ssl.SSLContext | None = None

    @property
    def url(self) -> str:
        scheme = "https" if self.ssl_context is not None else "http"
        return f"{scheme}://127.0.0.1:{self.port}"

    async def start(self, port: int = 0, backlog: int = 128) -> FakeEngine:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/{tail:.*}", self._post)
        self.runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
        await self.runner.setup()
        site = web.TCPSite(
            self.runner,
            "127.0.0.1",
            port,
            reuse_address=True,
            backlog=backlog,
            ssl_context=self.ssl_context,
        )
        await site.start()
        server = site._server
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def kill(self) -> None:
        """Stop listening and drop every open connection without a goodbye, as the kernel does
        for a process killed mid-call; in-flight handlers are cancelled."""
        if self.runner is None:
            return
        for site in list(self.runner.sites):
            await site.stop()
        server = self.runner.server
        for handler in server.connections if server is not None else []:
            if handler.transport is not None:
                handler.transport.abort()
        await self.runner.cleanup()
        self.runner = None

    async def _wait(self, until: asyncio.Event | float) -> None:
        """Wait for ``until`` (an event, or seconds), counting a hang-up by the caller."""
        try:
            if isinstance(until, asyncio.Event):
                await until.wait()
            else:
                await asyncio.sleep(until)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def _health(self, request: web.Request) -> web.Response:
        self.probes += 1
        return web.Response(status=200 if self.healthy else 503)

    async def _models(self, request: web.Request) -> web.Response:
        data = [
            {"id": m, "object": "model", "owned_by": "vllm", "max_model_len": 4096}
            for m in self.models
        ]
        return web.json_response({"object": "list", "data": data})

    async def _post(self, request: web.Request) -> web.StreamResponse:
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            return await self._answer(request)
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            # A field of the wrong type: vLLM's request validation answers 400 (so does this).
            return web.json_response(
                {
                    "error": {
                        "message": f"invalid request: {exc}",
                        "type": "BadRequestError",
                        "param": None,
                        "code": "400",
                    }
                },
                status=400,
            )
        finally:
            self.in_flight -= 1

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        self.calls.append(SeenCall(request.path, dict(request.headers), body))
        mode = request.headers.get("X-Fake-Mode", "")
        tokens = int(request.headers.get("X-Fake-Tokens", self.tokens))
        delay = float(request.headers.get("X-Fake-Delay-S", 0))
        if delay > 0:
            await self._wait(delay)
        if mode == "status500":
            return web.json_response(
                {
                    "error": {
                        "message": "engine exploded",
                        "type": "InternalServerError",
                        "code": 500,
                    }
                },
                status=500,
            )
        if mode == "hang":
            await self._wait(3600)
        path = request.path
        if path.endswith("/responses"):
            return await self._responses(request, body, mode, tokens)
        if path.endswith("/embeddings"):
            inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
            data = [
                {"index": i, "object": "embedding", "embedding": [0.1 * i, 0.2, 0.3]}
                for i in range(len(inputs))
            ]
            n = sum(len(str(x).split()) for x in inputs)
            return web.json_response(
                {
                    "object": "list",
                    "data": data,
                    "model": body["model"],
                    "usage": {"prompt_tokens": n, "total_tokens": n},
                }
            )
        if path.endswith("rerank"):
            docs = body.get("documents", [])
            results = [
                {"index": i, "document": {"text": d}, "relevance_score": 1.0 / (i + 1)}
                for i, d in enumerate(docs)
            ][: body.get("top_n") or None]
            return web.json_response(
                {
                    "id": "rerank-1",
                    "model": body["model"],
                    "usage": {"total_tokens": 7 * len(docs)},
                    "results": results,
                }
            )
        chat = path.endswith("/chat/completions")
        prompt_tokens = (
            10 * len(body.get("messages", [])) if chat else len(str(body.get("prompt", "")).split())
        )
        if body.get("stream"):
            return await self._stream(request, body, chat, prompt_tokens, mode, tokens)
        if mode == "hold":
            await self._wait(self.release)
        kind = "chat.completion" if chat else "text_completion"
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
        text = " ".join(f"tok{i}" for i in range(tokens))
        if chat:
            choice["message"] = {"role": "assistant", "content": f"{self.name}: {text}"}
        else:
            choice["text"] = f"{self.name}: {text}"
        return web.json_response(
            {
                "id": "cmpl-1",
                "object": kind,
                "created": int(time.time()),
                "model": body["model"],
                "choices": [choice],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": tokens,
                    "total_tokens": prompt_tokens + tokens,
                    "prompt_tokens_details": {"cached_tokens": 2},
                },
            }
        )

    async def _stream(
        self,
        request: web.Request,
        body: dict[str, Any],
        chat: bool,
        prompt_tokens: int,
        mode: str,
        tokens: int,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        kind = "chat.completion.chunk" if chat else "text_completion"

        def event(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
            obj: dict[str, Any] = {
                "id": "c1",
                "object": kind,
                "created": 1,
                "model": body["model"],
                "choices": choices,
            }
            if usage is not None:
                obj["usage"] = usage
            return b"data: " + orjson.dumps(obj) + b"\n\n"

        def piece(text: str, finish: str | None = None) -> dict[str, Any]:
            if chat:
                return {
                    "index": 0,
                    "delta": {"content": text},
                    "logprobs": None,
                    "finish_reason": finish,
                }
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

        if chat:
            await resp.write(
                event(
                    [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "finish_reason": None,
                        }
                    ]
                )
            )
        for i in range(tokens):
            if mode == "hold" and i == 1:
                await self._wait(self.release)
            if mode == "cut" and i == 2:
                assert request.transport is not None
                request.transport.close()
                return resp
            if mode == "error_event" and i == 2:
                await resp.write(
                    b'data: {"error": {"message": "KV cache exhausted", "type": "BadRequestError", "code": 400}}\n\n'
                )
                await resp.write(b"data: [DONE]\n\n")
                return resp
            if mode == "slow":
                await asyncio.sleep(0.01)
            await resp.write(event([piece(f"tok{i} ")]))
        await resp.write(event([piece("", "length")]))
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": tokens,
                "total_tokens": prompt_tokens + tokens,
            }
            await resp.write(event([], usage))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _responses(
        self, request: web.Request, body: dict[str, Any], mode: str, tokens: int
    ) -> web.StreamResponse:
        """The Responses API as vLLM serves it (``/v1/responses``)."""
        given = body.get("input", "")
        input_tokens = len(given.split()) if isinstance(given, str) else 10 * len(given)
        pieces = [f"tok{i} " for i in range(tokens)]
        usage = {
            "input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": 2},
            "output_tokens": tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + tokens,
        }

        def message(text: str, status: str) -> dict[str, Any]:
            part = {"type": "output_text", "text": text, "annotations": []}
            return {
                "id": "msg_1",
                "type": "message",
                "status": status,
                "role": "assistant",
                "content": [part] if text else [],
            }

        def response(status: str, text: str | None) -> dict[str, Any]:
            return {
                "id": "resp_1",
                "object": "response",
                "created_at": int(time.time()),
                "status": status,
                "error": None,
                "incomplete_details": None,
                "instructions": None,
                "model": body["model"],
                "output": [] if text is None else [message(text, "completed")],
                "parallel_tool_calls": True,
                "temperature": 1.0,
                "tool_choice": "auto",
                "tools": [],
                "top_p": 1.0,
                "usage": usage if status == "completed" else None,
            }

        if not body.get("stream"):
            if mode == "hold":
                await self._wait(self.release)
            return web.json_response(response("completed", "".join(pieces)))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        seq = itertools.count()

        async def send(kind: str, **fields: Any) -> None:
            obj = {"type": kind, "sequence_number": next(seq), **fields}
            await resp.write(b"event: %s\ndata: %s\n\n" % (kind.encode(), orjson.dumps(obj)))

        where = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
        await send("response.created", response=response("in_progress", None))
        await send("response.in_progress", response=response("in_progress", None))
        await send("response.output_item.added", output_index=0, item=message("", "in_progress"))
        part = {"type": "output_text", "text": "", "annotations": []}
        await send("response.content_part.added", **where, part=part)
        for i, piece in enumerate(pieces):
            if mode == "hold" and i == 1:
                await self._wait(self.release)
            if mode == "cut" and i == 2:
                assert request.transport is not None
                request.transport.close()
                return resp
            if mode == "error_event" and i == 2:
                await send("error", code="server_error", message="KV cache exhausted", param=None)
                return resp
            if mode == "slow":
                await asyncio.sleep(0.01)
            await send("response.output_text.delta", **where, delta=piece, logprobs=[])
        text = "".join(pieces)
        await send("response.output_text.done", **where, text=text, logprobs=[])
        await send("response.content_part.done", **where, part={**part, "text": text})
        await send("response.output_item.done", output_index=0, item=message(text, "completed"))
        await send("response.completed", response=response("completed", text))
        return resp

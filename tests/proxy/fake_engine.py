"""A fake vLLM replica: a real aiohttp app on a loopback port, speaking vLLM's wire shapes.

Behaviour is chosen per call by the ``X-Fake-Mode`` header (which the proxy forwards like any
other non-Scepsy header): ``cut`` ends a stream mid-way by dropping the connection,
``error_event`` sends a mid-stream error event, ``status500`` answers 500 with an error body,
``hang`` never answers (to test cancellation), ``slow`` paces stream events.
Every call the fake saw is kept in ``FakeEngine.calls`` (path, headers, body) for assertions.
"""

from __future__ import annotations

import asyncio
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
    runner: web.AppRunner | None = None
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, port: int = 0) -> FakeEngine:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/{tail:.*}", self._post)
        self.runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", port, reuse_address=True)
        await site.start()
        server = site._server
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _models(self, request: web.Request) -> web.Response:
        data = [
            {"id": m, "object": "model", "owned_by": "vllm", "max_model_len": 4096}
            for m in self.models
        ]
        return web.json_response({"object": "list", "data": data})

    async def _post(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        self.calls.append(SeenCall(request.path, dict(request.headers), body))
        mode = request.headers.get("X-Fake-Mode", "")
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
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
        path = request.path
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
            return await self._stream(request, body, chat, prompt_tokens, mode)
        kind = "chat.completion" if chat else "text_completion"
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
        text = " ".join(f"tok{i}" for i in range(self.tokens))
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
                    "completion_tokens": self.tokens,
                    "total_tokens": prompt_tokens + self.tokens,
                    "prompt_tokens_details": {"cached_tokens": 2},
                },
            }
        )

    async def _stream(
        self, request: web.Request, body: dict[str, Any], chat: bool, prompt_tokens: int, mode: str
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
        for i in range(self.tokens):
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
                "completion_tokens": self.tokens,
                "total_tokens": prompt_tokens + self.tokens,
            }
            await resp.write(event([], usage))
        await resp.write(b"data: [DONE]\n\n")
        return resp

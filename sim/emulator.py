"""The engine emulator: an aiohttp app that serves one emulated model in vLLM's dialect.

Role: ``make_app(config)`` builds the app: routes (chat, completions, embeddings, rerank,
score, pooling, models, health, metrics), OpenAI-style errors, the ``X-Scepsy-Emulated``
header on every response, and a ``cleanup_ctx`` that runs the real-time driver over an
``EngineCore`` for the app's lifetime and cancels it on shutdown.

Invariants: one engine core, one driver task and one metrics registry per app (several apps
can share a process and an event loop); every response says it is emulated; a client error
never shows a traceback; ``/health`` answers 503 once the driver task has died; with a GPU
board (``EmulatorConfig.gpu_board``) engines on the same GPUs slow each other as simulated
replicas do (:mod:`sim.colocation`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from sim.colocation import Neighbours, attach
from sim.completions import chat_completions, completions
from sim.engine import EngineCore
from sim.engine_driver import EngineDriver
from sim.engine_metrics import EngineMetrics
from sim.perf import MODELS, perf_model
from sim.pooling import embeddings, pooling, rerank, score
from sim.serving import (
    EMULATED_HEADER,
    ENGINE,
    FINGERPRINT,
    ApiError,
    EmulatedEngine,
    EmulatorConfig,
    created,
    engine_of,
    json_response,
)

log = logging.getLogger("scepsy.emulator")
DRIVER_TASK = web.AppKey("driver_task", asyncio.Task[None])

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def build_engine(config: EmulatorConfig) -> EmulatedEngine:
    """The engine state for config; ValueError on an unknown model or GPU."""
    perf = perf_model(config.model, config.gpu, config.tp, config.share)
    core = EngineCore(
        perf, max_num_batched_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs
    )
    driver = EngineDriver(core, speedup=config.speedup)
    if config.gpu_board is not None:
        neighbours = Neighbours(config.gpu_board, config.gpu_ids, config.share)
        driver.before_step, driver.on_idle = attach(core, neighbours)
    metrics = EngineMetrics(config.name, driver)
    driver.on_finished = metrics.observe
    return EmulatedEngine(config, MODELS[config.model], driver, metrics)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """OpenAI-style error bodies for every failure, including unknown routes."""
    try:
        return await handler(request)
    except ApiError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return ApiError(exc.reason, status=exc.status, type_=type(exc).__name__).response()
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as exc:
        log.exception("emulated engine failed on %s", request.path)
        return ApiError(
            f"emulated engine error: {exc}", status=500, type_="InternalServerError"
        ).response()


@web.middleware
async def _auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    """vLLM's --api-key: only the /v1 routes ask for the bearer token."""
    key = request.app[ENGINE].config.api_key
    if key is not None and request.path.startswith("/v1/"):
        if request.headers.get("Authorization", "") != f"Bearer {key}":
            raise ApiError("Unauthorized", status=401, type_="AuthenticationError")
    return await handler(request)


async def _mark_emulated(request: web.Request, response: web.StreamResponse) -> None:
    response.headers[EMULATED_HEADER] = "1"


async def _run_driver(app: web.Application) -> AsyncIterator[None]:
    """cleanup_ctx: the driver task lives exactly as long as the app."""
    engine = app[ENGINE]
    task = asyncio.create_task(engine.driver.run(), name=f"emulator-driver-{engine.name}")
    app[DRIVER_TASK] = task
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def models(request: web.Request) -> web.Response:
    engine = engine_of(request)
    card = {
        "id": engine.name,
        "object": "model",
        "created": created(),
        "owned_by": FINGERPRINT,
        "root": engine.config.model,
        "parent": None,
        "max_model_len": engine.spec.max_context,
        "permission": [],
    }
    return json_response({"object": "list", "data": [card]})


async def health(request: web.Request) -> web.Response:
    task = request.app.get(DRIVER_TASK)
    if task is None or task.done():
        return web.Response(status=503)
    return web.Response(status=200)


async def metrics(request: web.Request) -> web.Response:
    body = engine_of(request).metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})


def make_app(config: EmulatorConfig) -> web.Application:
    """The emulator app for one model (build_engine's ValueError on a bad model or GPU)."""
    app = web.Application(middlewares=[_errors, _auth], client_max_size=64 * 1024 * 1024)
    app[ENGINE] = build_engine(config)
    app.cleanup_ctx.append(_run_driver)
    app.on_response_prepare.append(_mark_emulated)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/embeddings", embeddings)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.router.add_post(path, rerank)
    for path in ("/score", "/v1/score"):
        app.router.add_post(path, score)
    app.router.add_post("/pooling", pooling)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app

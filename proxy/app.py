"""The proxy's aiohttp application: app factory, state keys, background tasks, read-only routes.

Role: wires settings, router, recorder, metrics and the upstream HTTP session into one
``web.Application`` (``make_app``). The forwarding handler lives in ``proxy.forward``, the
admin API in ``proxy.admin``.

Invariants:
- all state hangs off ``web.AppKey``s; background work (recorder, health prober, the client
  session) is started and stopped by ``cleanup_ctx``, in an order that lets shutdown drain
  in-flight calls first and flush their records last;
- the proxy never waits for the control plane: it serves with the routes it was last given.

Health: ``/health/live`` answers 200 whenever the event loop does (a liveness probe);
``/health/ready`` answers 200 only when the route table has an upstream and the trace store
takes writes (the recorder's last write did not fail recently, and the segment folder takes a
file now), else 503 with ``reasons``. ``/health`` is kept as it was (always 200, with models
and routes version) for existing probes and scripts; new deployments should probe the two
above.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proxy.boundary import ProxyRunner, error_middleware
from proxy.metrics import AccessLoggingMetrics, ProxyMetrics
from proxy.recorder import Recorder
from proxy.router import Replica, Router
from proxy.routes import Routes
from proxy.upstream import UpstreamClient, tls_context
from shared.settings import Settings

log = logging.getLogger("scepsy.proxy")

SETTINGS = web.AppKey("settings", Settings)
ROUTER = web.AppKey("router", Router)
ROUTES = web.AppKey("routes", Routes)  # the allow-list of engine routes
RECORDER = web.AppKey("recorder", Recorder)
METRICS = web.AppKey("metrics", ProxyMetrics)
SESSION = web.AppKey("session", aiohttp.ClientSession)  # health probes and /v1/models
UPSTREAM = web.AppKey("upstream", UpstreamClient)  # the engine calls: the hot path
PROXY_ID = web.AppKey("proxy_id", str)


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")


async def _session_ctx(app: web.Application) -> AsyncIterator[None]:
    s = app[SETTINGS].proxy
    # One TLS context for https:// upstreams, shared by engine calls, probes and /v1/models.
    tls = tls_context(s.upstream_tls.verify, s.upstream_tls.ca_file)
    # Idle connections are dropped before the engines drop them (uvicorn: 5 s), so a call is
    # rarely sent down a connection the engine is closing.
    app[UPSTREAM] = UpstreamClient(
        connect_timeout_s=s.connect_timeout_s,
        read_timeout_s=s.read_timeout_s,
        total_timeout_s=s.upstream_timeout_s,
        idle_timeout_s=4.0,
        ssl_context=tls,
    )
    timeout = aiohttp.ClientTimeout(total=30, sock_connect=s.connect_timeout_s)
    connector = aiohttp.TCPConnector(ssl=tls)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        app[SESSION] = session
        try:
            yield
        finally:
            await app[UPSTREAM].close()


async def _recorder_ctx(app: web.Application) -> AsyncIterator[None]:
    recorder = app[RECORDER]
    await recorder.start()
    yield
    # Runs after the server stopped and in-flight handlers finished: nothing is left to record.
    await recorder.close()
    log.info("recorder closed: %d written, %d dropped", recorder.written, recorder.dropped)


async def _probe(session: aiohttp.ClientSession, rep: Replica, limit_s: float) -> bool:
    try:
        async with session.get(
            f"{rep.url}/health", timeout=aiohttp.ClientTimeout(total=limit_s)
        ) as r:
            return r.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


async def _prober_ctx(app: web.Application) -> AsyncIterator[None]:
    router, session = app[ROUTER], app[SESSION]
    interval = app[SETTINGS].proxy.routing.probe_interval_s

    async def loop() -> None:
        while True:
            await asyncio.sleep(min(interval, 1.0))
            due = router.due_probes()
            if due:
                results = await asyncio.gather(*(_probe(session, r, interval) for r in due))
                for rep, ok in zip(due, results, strict=True):
                    router.probe_result(rep, ok)  # logs the re-admission

    task = asyncio.create_task(loop(), name="scepsy-prober")
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def health(request: web.Request) -> web.Response:
    router = request.app[ROUTER]
    return _json(
        {
            "status": "ok",
            "proxy_id": request.app[PROXY_ID],
            "models": router.models(),
            "routes_version": router.version,
        }
    )


async def health_live(request: web.Request) -> web.Response:
    """The event loop answers: the process is alive (never depends on upstreams or store)."""
    return _json({"status": "live", "proxy_id": request.app[PROXY_ID]})


async def health_ready(request: web.Request) -> web.Response:
    """200 when calls can be served and recorded; 503 with the reasons otherwise."""
    app = request.app
    router, recorder = app[ROUTER], app[RECORDER]
    reasons: list[str] = []
    if not router.models():
        reasons.append("no routes: the route table has no upstream")
    # A failed write counts for a few flush intervals; past that, with no traffic to write,
    # the folder check alone says whether the store works again.
    failed = recorder.failing(max(30.0, 3 * app[SETTINGS].store.flush_interval_s))
    if failed is not None:
        reasons.append(f"the trace store's last write failed: {failed}")
    unwritable = await asyncio.to_thread(recorder.check_writable)
    if unwritable is not None:
        reasons.append(f"the trace store is not writable: {unwritable}")
    return _json(
        {
            "status": "not ready" if reasons else "ready",
            "reasons": reasons,
            "proxy_id": app[PROXY_ID],
            "models": router.models(),
            "routes_version": router.version,
        },
        status=503 if reasons else 200,
    )


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def list_models(request: web.Request) -> web.Response:
    """``/v1/models`` merged over the upstreams: each routed model once, with the engine's own
    metadata (``max_model_len``, ``owned_by``, ...) from the first replica that answers."""
    router, session = request.app[ROUTER], request.app[SESSION]
    first: dict[str, Replica] = {}
    for rep in router.replicas():
        if rep.active:
            first.setdefault(rep.model, rep)

    async def fetch(rep: Replica) -> list[dict[str, object]]:
        headers = {"Authorization": f"Bearer {rep.api_key}"} if rep.api_key else {}
        auth = request.headers.get("Authorization")
        if auth and not rep.api_key and not request.app[SETTINGS].proxy.client_keys:
            headers["Authorization"] = auth
        try:
            async with session.get(
                f"{rep.url}/v1/models", headers=headers, timeout=aiohttp.ClientTimeout(total=3)
            ) as r:
                data = orjson.loads(await r.read()).get("data", []) if r.status == 200 else []
                return [d for d in data if isinstance(d, dict)]
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, AttributeError):
            return []

    fetched = await asyncio.gather(*(fetch(r) for r in first.values()))
    merged: dict[str, dict[str, object]] = {}
    for model, entries in zip(first, fetched, strict=True):
        own = next((e for e in entries if e.get("id") == model), None)
        merged[model] = own or {"id": model, "object": "model", "owned_by": "scepsy"}
    for model in router.models():
        merged.setdefault(model, {"id": model, "object": "model", "owned_by": "scepsy"})
    return _json({"object": "list", "data": list(merged.values())})


def _named_workflows(settings: Settings) -> set[str]:
    """Workflows the settings name: they always get a metrics label of their own."""
    rollout = settings.rollout
    entries = [*rollout.allocation, *(e for sc in rollout.scenarios for e in sc.allocation)]
    named = {e.workflow for e in entries if e.workflow != "*"}
    if settings.proxy.default_workflow:
        named.add(settings.proxy.default_workflow)
    return named


def make_app(settings: Settings) -> web.Application:
    """The proxy application for ``settings``; serve it with :func:`make_runner` (a client
    that hangs up cancels its upstream call; aiohttp's own refusals are OpenAI-shaped)."""
    from proxy import admin, forward  # the handlers need the keys defined above

    app = web.Application(
        client_max_size=settings.proxy.max_body_bytes, middlewares=[error_middleware]
    )
    proxy_id = settings.proxy.resolved_proxy_id
    app[SETTINGS] = settings
    app[ROUTES] = Routes(settings.proxy.extra_routes)
    app[PROXY_ID] = proxy_id
    recorder = Recorder(settings.store, proxy_id)
    app[RECORDER] = recorder
    app[ROUTER] = Router(
        settings.proxy.routing,
        settings.proxy.upstreams,
        on_eject=lambda rep: app[METRICS].ejections.labels(rep.model, rep.url).inc(),
    )
    metrics_class = AccessLoggingMetrics if settings.proxy.access_log else ProxyMetrics
    app[METRICS] = metrics_class(
        app[ROUTER],
        recorder,
        max_workflows=settings.proxy.metrics_max_workflows,
        known_workflows=_named_workflows(settings),
    )
    # Order matters: started first, stopped last. The recorder outlives the session and the
    # prober, so records of calls cut at shutdown are still written.
    app.cleanup_ctx.extend([_recorder_ctx, _session_ctx, _prober_ctx])
    app.router.add_get("/health", health)
    app.router.add_get("/health/live", health_live)
    app.router.add_get("/health/ready", health_ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/w/{workflow}/v1/models", list_models)
    app.router.add_get("/w/{workflow}/r/{rid}/v1/models", list_models)
    admin.add_routes(app)
    # The engine routes by name resolve with one dict lookup; everything else (workflow paths,
    # unknown paths) falls through to the catch-all, where the allow-list (proxy.routes)
    # answers 404 for what is not an engine route.
    for path in sorted(app[ROUTES].allowed):
        app.router.add_post(path, forward.handle)
    app.router.add_post("/{tail:.*}", forward.handle)
    return app


def make_runner(app: web.Application, shutdown_timeout: float | None = None) -> web.AppRunner:
    """The runner to serve a :func:`make_app` app with: handler cancellation on client
    hang-up, aiohttp's refusals in OpenAI shape (``proxy.boundary``), and
    ``proxy.client_header_timeout_s`` as the connections' keep-alive timeout, which in aiohttp
    also closes a connection that sends nothing or only part of a request head, and
    ``proxy.client_body_timeout_s`` (10 s at most) as the time an unread body is drained.
    ``shutdown_timeout`` overrides ``proxy.shutdown_grace_s`` (tests)."""
    s = app[SETTINGS].proxy
    return ProxyRunner(
        app,
        handler_cancellation=True,
        shutdown_timeout=s.shutdown_grace_s if shutdown_timeout is None else shutdown_timeout,
        access_log=None,
        keepalive_timeout=s.client_header_timeout_s,
        # What is left of a body the proxy did not read (after a 404, 408, 413, ...) is
        # drained for at most this long before the connection is closed.
        lingering_time=min(10.0, s.client_body_timeout_s),
    )

"""The proxy's aiohttp application: assembled from settings, resources and route tables.

Role: :func:`make_app` wires settings, router, recorder, metrics and the upstream HTTP clients
into one ``web.Application`` and adds the handler modules' route tables (``proxy.health``,
``proxy.models``, ``proxy.admin``, ``proxy.forward``); :func:`make_runner` serves it through
the error boundary's runner (``proxy.boundary``). Handlers live in those modules, the state
keys in ``proxy.keys``: this module only assembles.

Invariants:
- all state hangs off ``web.AppKey``s; background work (recorder, the client sessions, the
  watchers of ``proxy.watchers``) is started and stopped by ``cleanup_ctx``, in an order that
  lets shutdown drain in-flight calls first and flush their records last;
- every error a client gets passes ``proxy.boundary`` (its middleware wraps every route);
- the proxy never waits for the control plane: it serves with the routes it was last given.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from proxy import admin, forward, health, models
from proxy.boundary import ProxyRunner, error_middleware
from proxy.keys import METRICS, PROXY_ID, RECORDER, ROUTER, ROUTES, SESSION, SETTINGS, UPSTREAM
from proxy.metrics import AccessLoggingMetrics, ProxyMetrics
from proxy.recorder import Recorder
from proxy.router import Router
from proxy.routes import Routes
from proxy.upstream import UpstreamClient, tls_context
from proxy.watchers import prober_ctx, scraper_ctx
from shared.settings import Settings

log = logging.getLogger("scepsy.proxy")


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
    # watchers, so records of calls cut at shutdown are still written.
    app.cleanup_ctx.extend([_recorder_ctx, _session_ctx, prober_ctx, scraper_ctx])
    for module in (health, models, admin, forward):  # forward's catch-all POST comes last
        app.add_routes(module.routes)
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

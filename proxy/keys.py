"""The proxy application's state: one ``web.AppKey`` per object the handlers share.

Role: the names under which ``proxy.app`` hangs settings, routing, recording and the upstream
clients off the ``web.Application``, typed so that ``request.app[KEY]`` is checked. A leaf
module: it imports the types it names and nothing that handles requests, so every handler
module and the app factory import it without a cycle.

Invariants: every key is set by ``proxy.app.make_app`` before the app starts (``SESSION`` and
``UPSTREAM`` by its ``cleanup_ctx``, when the app starts); handlers only read them.
"""

from __future__ import annotations

import aiohttp
from aiohttp import web

from proxy.metrics import ProxyMetrics
from proxy.recorder import Recorder
from proxy.router import Router
from proxy.routes import Routes
from proxy.siblings import Siblings
from proxy.upstream import UpstreamClient
from shared.settings import Settings

__all__ = [
    "METRICS",
    "PROXY_ID",
    "RECORDER",
    "ROUTER",
    "ROUTES",
    "SESSION",
    "SETTINGS",
    "SIBLINGS",
    "UPSTREAM",
]

SETTINGS = web.AppKey("settings", Settings)
ROUTER = web.AppKey("router", Router)
ROUTES = web.AppKey("routes", Routes)  # the allow-list of engine routes
RECORDER = web.AppKey("recorder", Recorder)
METRICS = web.AppKey("metrics", ProxyMetrics)
SESSION = web.AppKey("session", aiohttp.ClientSession)  # health probes and /v1/models
UPSTREAM = web.AppKey("upstream", UpstreamClient)  # the engine calls: the hot path
PROXY_ID = web.AppKey("proxy_id", str)
# the line to the other workers (only with proxy.workers > 1)
SIBLINGS = web.AppKey("siblings", Siblings)

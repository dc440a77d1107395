"""The admin API: read and replace the route table at run time, behind a bearer token.

Role: ``GET /admin/routes`` shows every replica with its state; ``PUT /admin/routes`` with
``{"upstreams": [{"model", "url", "api_key"?}, ...]}`` (the settings file's shape) installs a
new table atomically: with several workers (``proxy.workers``) in every worker, before the
answer (:mod:`proxy.siblings`; 503 if that cannot be confirmed). Replicas no longer listed
drain: no new calls, in-flight ones finish.
Both are in :data:`routes`; their errors are raised and answered by ``proxy.boundary``.

Invariants: with no ``admin_token`` in settings the API answers 404 (it does not exist); a wrong
or missing token is 401; a bad table is a 400 naming the key path, and changes nothing; the
token comparison is constant-time. ``api_key`` values are never echoed back. Every accepted
table is logged (INFO, ``scepsy.proxy.admin``): upstream counts old → new, overall and per model.
"""

from __future__ import annotations

import hmac
import logging
from collections import Counter

import orjson
from aiohttp import web

from proxy.errors import BadRequest, RouteNotFound, ServiceUnavailable, Unauthorized
from proxy.keys import ROUTER, SETTINGS, SIBLINGS
from proxy.siblings import SiblingsDown
from shared.settings import ProxySettings, UpstreamSettings
from shared.settings_schema import SettingsError, decode

log = logging.getLogger("scepsy.proxy.admin")
routes = web.RouteTableDef()


def _authorise(request: web.Request) -> None:
    token = request.app[SETTINGS].proxy.admin_token
    if token is None:
        raise RouteNotFound("The admin API is disabled (no proxy.admin_token in settings).")
    auth = request.headers.get("Authorization", "")
    given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
    if not hmac.compare_digest(given.encode(), token.encode()):
        raise Unauthorized("Missing or wrong admin token.")


async def _respond(request: web.Request) -> web.Response:
    siblings = request.app.get(SIBLINGS)
    if siblings is None:
        view = request.app[ROUTER].snapshot()
    else:
        try:
            view = await siblings.routes()  # every worker's calls summed
        except SiblingsDown as exc:
            raise ServiceUnavailable(f"Routes of every worker unavailable: {exc}.") from exc
    return web.Response(body=orjson.dumps(view), content_type="application/json")


@routes.get("/admin/routes")
async def get_routes(request: web.Request) -> web.Response:
    _authorise(request)
    return await _respond(request)


def parse_routes(data: object) -> tuple[UpstreamSettings, ...]:
    """The ``upstreams`` of a PUT body, validated exactly as the settings file is."""
    if not isinstance(data, dict) or set(data) - {"upstreams"} or "upstreams" not in data:
        raise BadRequest('Body must be {"upstreams": [{"model": ..., "url": ...}, ...]}.')
    try:
        proxy = decode(ProxySettings, {"upstreams": data["upstreams"]})
    except SettingsError as exc:
        raise BadRequest(str(exc), param=exc.path) from exc
    return proxy.upstreams


@routes.put("/admin/routes")
async def put_routes(request: web.Request) -> web.Response:
    _authorise(request)
    try:
        data = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"Body is not valid JSON: {exc.msg}.") from exc
    upstreams = parse_routes(data)
    siblings = request.app.get(SIBLINGS)
    if siblings is None:
        install(request.app, upstreams)
    else:
        try:
            await siblings.swap_routes(upstreams)  # every worker, this one included
        except SiblingsDown as exc:
            raise ServiceUnavailable(f"Routes not changed everywhere: {exc}.") from exc
    return await _respond(request)


def install(app: web.Application, upstreams: tuple[UpstreamSettings, ...]) -> None:
    """Install ``upstreams`` as this process's route table, and log the change."""
    router = app[ROUTER]
    before = Counter(r.model for r in router.replicas() if not r.draining)
    old = {(r.model, r.url) for r in router.replicas() if not r.draining}
    router.replace(upstreams)
    after = Counter(up.model for up in upstreams)
    new = {(up.model, up.url) for up in upstreams}
    per_model = ", ".join(f"{m} {before[m]}→{after[m]}" for m in sorted(before | after))
    log.info(
        "routes swapped via the admin API: %d → %d upstreams (%d added, %d draining), "
        "version %d; %s",
        sum(before.values()),
        len(upstreams),
        len(new - old),
        len(old - new),
        router.version,
        per_model or "no models",
        extra={
            "event": "routes",
            "upstreams_before": sum(before.values()),
            "upstreams_after": len(upstreams),
            "added": len(new - old),
            "removed": len(old - new),
            "routes_version": router.version,
        },
    )

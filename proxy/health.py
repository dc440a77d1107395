"""What the proxy says about itself to operators: health probes and Prometheus metrics.

Role: the read-only ``GET`` routes a deployment probes and scrapes, in :data:`routes`.

- ``/health/live`` answers 200 whenever the event loop does (a liveness probe);
- ``/health/ready`` answers 200 only when the route table has an upstream and the trace store
  takes writes (the recorder's last write did not fail recently, and the segment folder takes
  a file now), else 503 with ``reasons``;
- ``/health`` is kept as it was (always 200, with models and routes version) for existing
  probes and scripts; new deployments should probe the two above;
- ``/metrics`` is the proxy's Prometheus registry in the text exposition format (with
  several workers, every worker's summed: ``proxy.metrics.merge_expositions``).

Invariants: none of these calls an upstream or waits for the control plane; readiness checks
the store folder off the event loop.
"""

from __future__ import annotations

import asyncio

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from proxy.errors import ServiceUnavailable
from proxy.keys import METRICS, PROXY_ID, RECORDER, ROUTER, SETTINGS, SIBLINGS
from proxy.siblings import SiblingsDown

routes = web.RouteTableDef()


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(data), content_type="application/json")


@routes.get("/health")
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


@routes.get("/health/live")
async def health_live(request: web.Request) -> web.Response:
    """The event loop answers: the process is alive (never depends on upstreams or store)."""
    return _json({"status": "live", "proxy_id": request.app[PROXY_ID]})


@routes.get("/health/ready")
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


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    siblings = request.app.get(SIBLINGS)
    if siblings is None:
        body = generate_latest(request.app[METRICS].registry)
    else:
        try:
            body = await siblings.metrics()  # every worker's, summed
        except SiblingsDown as exc:
            raise ServiceUnavailable(f"Metrics of every worker unavailable: {exc}.") from exc
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

"""``/v1/models``: the models this proxy routes, as the OpenAI API lists them.

Role: the client-facing model list, in :data:`routes` (bare and under the ``/w/<workflow>``
and ``/w/<workflow>/r/<id>`` prefixes, as the engine routes are). Each routed model appears
once, with the engine's own metadata (``max_model_len``, ``owned_by``, ...) from the first
active replica that answers its own ``/v1/models``.

Invariants: a replica that fails, stalls (3 s) or answers nonsense costs its metadata, never
the list: every model the route table knows is listed; the client's ``Authorization`` reaches
an engine only when neither the replica has its own key nor the proxy has client keys.
"""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
from aiohttp import web

from proxy.keys import ROUTER, SESSION, SETTINGS
from proxy.router import Replica

routes = web.RouteTableDef()


@routes.get("/w/{workflow}/r/{rid}/v1/models")
@routes.get("/w/{workflow}/v1/models")
@routes.get("/v1/models")  # decorators apply bottom up: the bare route is registered first
async def list_models(request: web.Request) -> web.Response:
    """``/v1/models`` merged over the upstreams: each routed model once, with the engine's own
    metadata from the first replica that answers."""
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
    return web.Response(
        body=orjson.dumps({"object": "list", "data": list(merged.values())}),
        content_type="application/json",
    )

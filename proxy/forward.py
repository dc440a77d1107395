"""Forwarding one client call: validate, identify, route, call upstream (retrying once), relay,
and record — whatever happens.

Role: the ``POST`` handler behind every engine route, and its route table (:data:`routes`).
Parsing and validation produce a :class:`Call`; :func:`handle` runs the exchange and raises a
:class:`~proxy.errors.ProxyError` for whatever the client should hear, which
``proxy.boundary`` answers in OpenAI shape.

Invariants:
- every attempt that reached an upstream (or tried to) becomes one record, submitted in a
  ``finally`` without awaiting, so a cancelled handler (client hang-up, shutdown) still records;
- only connection failures before the upstream answered are retried, once, on another replica;
  once a byte may have reached the engine's response path nothing is retried;
- whatever the route, an upstream answer of ``text/event-stream`` is relayed event by event
  (chat and completions, the Responses API, any route a known model is called on); a client's
  stream is never buffered to its end;
- every upstream failure (connect, TLS, protocol, timeout) logs one warning naming the replica
  and the model, and reaches the client as an OpenAI-style error, never a traceback;
- header-borne strings stored or counted (workflow, request id, call id) are normalised once
  (:func:`proxy.identity.normalise`: valid UTF-8, bounded), while the headers themselves go
  upstream byte for byte;
- only an allow-listed route reaches an engine (:mod:`proxy.routes`), at the allow-list's own
  path; any other path is a 404;
- a client's mistake (a body field of the wrong type, a body nested past
  ``shared.records.MAX_BODY_DEPTH``, a body not sent within ``proxy.client_body_timeout_s``)
  is an OpenAI-shaped 4xx; an upstream failure is a 502/503/504, and the recorded ``status``
  is the status the client got;
- credentials never reach the store (bodies are scrubbed, error text redacted), and
  ``X-Scepsy-*`` headers never reach an upstream.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from proxy.errors import (
    BadRequest,
    BodyTooLarge,
    ClientTimeout,
    ModelNotFound,
    NoReplica,
    ProxyError,
    RouteNotFound,
    Unauthorized,
    UpstreamFailed,
    UpstreamTimeout,
)
from proxy.identity import identify, is_private_header, normalise
from proxy.keys import METRICS, PROXY_ID, RECORDER, ROUTER, ROUTES, SETTINGS, UPSTREAM
from proxy.relay import relay_body, relay_stream
from proxy.ring import affinity_key
from proxy.router import Replica
from proxy.routes import ENGINE_ROUTES, PathRefused
from proxy.upstream import (
    UpstreamConnectError,
    UpstreamProtocolError,
    UpstreamRequestError,
    UpstreamTLSError,
)
from shared.records import (
    MAX_BODY_DEPTH,
    BodyTooDeep,
    CallRecord,
    check_depth,
    new_call_id,
    now_us,
    redact_text,
    scrub_body,
)
from shared.settings import ProxySettings

__all__ = ["ENGINE_ROUTES", "handle", "routes"]
log = logging.getLogger(__name__)
# Routes whose `stream: true` asks for an event stream (recorded as a streamed call). Any
# route is relayed as a stream when its upstream answers text/event-stream, whatever it asked.
_STREAMING_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
# Routes whose streams report usage only when asked (`stream_options.include_usage`): the proxy
# asks on the client's behalf. The Responses API always reports it (`response.completed`).
_USAGE_OPTION_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions"})
_DROP_UPSTREAM = frozenset(
    {
        "host",
        "content-length",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "proxy-authorization",
        "accept-encoding",
        "authorization",
        "api-key",
        "x-api-key",
    }
)


@dataclass(slots=True)
class Call:
    path: str
    model: str
    payload: bytes
    stream: bool
    strip_usage: bool
    prompt: str | None  # prefix_affinity's input
    key: str | None  # consistent_hash's affinity key
    headers: list[tuple[str, str]]
    client_auth: str | None


def _prompt_text(body: dict[str, Any]) -> str | None:
    """The text engines cache by prefix: chat messages in order, or a completion prompt."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts: list[str] = []
        for msg in messages:
            if isinstance(msg, dict):
                content = msg.get("content")
                if isinstance(content, list):
                    content = "".join(
                        str(p.get("text", "")) for p in content if isinstance(p, dict)
                    )
                parts.append(f"{msg.get('role', '')}:{content or ''}\n")
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        return prompt[0]
    return None


def _check_client(request: web.Request) -> str | None:
    """The client's Authorization to pass on, or None; 401 when the proxy's own keys are set
    and the client sent none of them (then the client's key is the proxy's, never forwarded)."""
    auth = request.headers.get("Authorization")
    keys = request.app[SETTINGS].proxy.client_keys
    if not keys:
        return auth
    token = auth[7:].strip() if auth and auth[:7].lower() == "bearer " else None
    if token not in keys:
        raise Unauthorized("Incorrect API key provided to the Scepsy proxy.")
    return None


async def _read_body(request: web.Request, settings: ProxySettings) -> tuple[bytes, dict[str, Any]]:
    limit = settings.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise BodyTooLarge(f"Request body of {request.content_length} bytes exceeds {limit}.")
    try:
        if request.content.is_eof():  # the usual small body: it came with the head
            raw = await request.read()
        else:
            async with asyncio.timeout(settings.client_body_timeout_s):
                raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise BodyTooLarge(f"Request body exceeds {limit} bytes.") from exc
    except TimeoutError as exc:
        raise ClientTimeout(
            f"The request body did not arrive within {settings.client_body_timeout_s:g} s."
        ) from exc
    except web.RequestPayloadError as exc:  # bad chunked framing, a cut or bad compression
        raise BadRequest(f"The request body is malformed: {exc}.") from exc
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise BadRequest(f"Request body is not valid JSON: {exc.msg}.") from exc
    if not isinstance(body, dict):
        raise BadRequest("Request body must be a JSON object.")
    return raw, body


def _upstream_headers(request: web.Request) -> list[tuple[str, str]]:
    return [
        (k, v)
        for k, v in request.headers.items()
        if k.lower() not in _DROP_UPSTREAM and not is_private_header(k)
    ]


async def handle(request: web.Request) -> web.StreamResponse:
    """The engine routes' handler; its errors are raised, and answered by
    ``proxy.boundary.error_middleware`` (an exchange's are already counted and recorded)."""
    try:
        call, rec = await _prepare(request)
    except ProxyError as exc:
        request.app[METRICS].rejected(exc.status)
        raise
    return await _exchange(request, call, rec)


async def _prepare(request: web.Request) -> tuple[Call, CallRecord]:
    """Validate and identify the call; raises the 4xx a malformed call deserves."""
    app = request.app
    settings = app[SETTINGS].proxy
    client_auth = _check_client(request)
    try:
        routed = app[ROUTES].resolve(request.raw_path)
    except PathRefused as exc:
        raise RouteNotFound(str(exc)) from None
    raw, body = await _read_body(request, settings)
    ident = identify(
        routed, request.headers, body, settings.default_workflow, settings.identity_max_chars
    )
    path = ident.upstream_path
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("Missing required field `model` (a string).", param="model")
    if not app[ROUTER].knows(model):
        raise ModelNotFound(f"The model `{model[:200]}` does not exist.", param="model")
    asked_stream = body.get("stream")
    if asked_stream is not None and not isinstance(asked_stream, bool):
        raise BadRequest("`stream` must be a boolean.", param="stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("`stream_options` must be an object.", param="stream_options")

    stream = bool(asked_stream) and path in _STREAMING_ROUTES
    strip_usage = False
    payload = raw
    if stream and path in _USAGE_OPTION_ROUTES:
        if not options or not options.get("include_usage"):
            # Ask for usage on the client's behalf; the extra event is removed on the way back.
            # A shallow copy: the stored body stays the client's own.
            asked = {**(options or {}), "include_usage": True}
            try:
                payload = orjson.dumps({**body, "stream_options": asked})
            except orjson.JSONEncodeError as exc:  # nested past what orjson writes
                raise _too_deep() from exc
            strip_usage = True
    try:
        if settings.record_bodies:
            stored: str | None = scrub_body(raw, body)
        else:
            stored = None
            check_depth(body)
    except BodyTooDeep as exc:
        raise _too_deep() from exc
    limit = settings.identity_max_chars
    rec = CallRecord(
        call_id=normalise(request.headers.get("Idempotency-Key"), limit) or new_call_id(),
        proxy_id=app[PROXY_ID],
        workflow=ident.workflow,
        request_id=ident.request_id,
        model=model,
        endpoint=path,
        stream=stream,
        t_start=now_us(),
        request_bytes=len(raw),
        attempt=_client_retries(request),
        body=stored,
    )
    routing = settings.routing
    prompt, key = None, None
    if routing.policy == "prefix_affinity":
        prompt = _prompt_text(body)
    elif routing.policy == "consistent_hash":
        # A workflow request id is the key when present: the prompt is then not read at all.
        text = None if ident.request_id else _prompt_text(body)
        key = affinity_key(ident.workflow, ident.request_id, text, routing.hash_key_chars)
    call = Call(
        path,
        model,
        payload,
        stream,
        strip_usage,
        prompt,
        key,
        _upstream_headers(request),
        client_auth,
    )
    return call, rec


def _too_deep() -> BadRequest:
    return BadRequest(f"Request body is nested deeper than {MAX_BODY_DEPTH} levels.")


def _client_retries(request: web.Request) -> int:
    value = request.headers.get("x-stainless-retry-count", "0")
    # str.isdigit() admits "²" and other digits int() refuses; a count has a few ASCII digits.
    return int(value) if value.isascii() and value.isdecimal() and len(value) <= 6 else 0


async def _exchange(request: web.Request, call: Call, rec: CallRecord) -> web.StreamResponse:
    app = request.app
    router, recorder, metrics = app[ROUTER], app[RECORDER], app[METRICS]
    tried: list[Replica] = []
    status = 0
    while True:
        recorder.begin(rec)
        try:
            rep = router.pick(call.model, call.prompt, exclude=tried, key=call.key)
        except NoReplica as exc:
            # Turned away with no replica to try: the call still reached the proxy, so it is
            # recorded (upstream null) and counted.
            rec.upstream, rec.status, rec.error = None, exc.status, f"no replica: {exc.message}"
            rec.t_end = now_us()
            recorder.submit(rec)
            metrics.observe(rec, exc.status)
            raise
        tried.append(rep)
        rec.upstream = rep.url
        auth = f"Bearer {rep.api_key}" if rep.api_key else call.client_auth
        headers = [*call.headers, ("Authorization", auth)] if auth else call.headers
        router.acquire(rep)
        retry = False
        try:
            upstream = await app[UPSTREAM].request(
                "POST", rep.url, call.path, headers, call.payload
            )
            async with upstream:
                router.succeeded(rep)
                status = upstream.status
                rec.status = status
                if upstream.status >= 500:
                    metrics.upstream_error(call.model, rep.url, str(upstream.status))
                # Decided by the answer, not by the call: the client's `stream` may be unknown
                # to the proxy (a new route) and the engine's word is what arrives.
                ctype = upstream.headers.get("Content-Type", "")
                if ctype[:17].lower() == "text/event-stream":
                    rec.stream = True
                    return await relay_stream(request, upstream, rec, call.strip_usage)
                return await relay_body(upstream, rec)
        except UpstreamRequestError as exc:
            # Nothing was sent: a header of the call has no bytes to send (aiohttp never
            # decodes one so; said as a 400 rather than a traceback all the same).
            rec.error = f"request: {exc}"
            status = rec.status = BadRequest.status
            raise BadRequest(f"The call cannot be sent upstream: {exc}.") from exc
        except UpstreamConnectError as exc:
            # The connection was never made, so the engine never saw the call: safe to retry.
            router.failed(rep)
            metrics.upstream_error(call.model, rep.url, "connect")
            rec.error = f"connect: {exc}"
            log.warning("upstream %s of model %s: %s", rep.url, call.model, exc)
            retry = len(tried) == 1 and router.has_alternative(call.model, tried)
            if not retry:
                if isinstance(exc, UpstreamTLSError):
                    # A certificate the proxy does not trust: a setup problem of this replica,
                    # said as such rather than as "no replica".
                    status = rec.status = UpstreamFailed.status
                    raise UpstreamFailed(
                        "The TLS handshake with the upstream engine failed (see the proxy's log)."
                    ) from exc
                status = rec.status = NoReplica.status
                raise NoReplica(f"No replica of `{call.model}` could be reached.") from exc
            metrics.retries.labels(call.model).inc()
        except TimeoutError as exc:
            metrics.upstream_error(call.model, rep.url, "timeout")
            rec.error = "upstream timed out"
            log.warning("upstream %s of model %s timed out: %s", rep.url, call.model, exc)
            # Only a plain body's read gets here (a stream ends itself with an error event):
            # the client gets the 504, and the record says so, whatever the head said.
            status = rec.status = UpstreamTimeout.status
            raise UpstreamTimeout("The upstream engine did not answer in time.") from exc
        except UpstreamProtocolError as exc:
            # The call may have reached the engine: never replayed (it may not be idempotent
            # in cost, and the client may already hold part of the answer).
            if rec.status is None:
                router.failed(rep)
            metrics.upstream_error(call.model, rep.url, "disconnect")
            rec.error = f"upstream: {exc}"
            log.warning("upstream %s of model %s broke the exchange: %s", rep.url, call.model, exc)
            status = rec.status = UpstreamFailed.status
            raise UpstreamFailed("The upstream engine broke the exchange.") from exc
        except (asyncio.CancelledError, ConnectionResetError):
            rec.error = rec.error or "client disconnected"
            status = 499  # nginx's "client closed request", for metrics only
            raise
        except Exception as exc:  # a bug of the proxy's: the boundary answers 500
            rec.error = f"proxy error: {exc.__class__.__name__}: {exc}"
            status = rec.status = 500
            raise
        finally:
            router.release(rep)
            rec.t_end = now_us()
            if rec.error is not None:  # an upstream may echo the call's key back
                rec.error = redact_text(rec.error, _secrets(request, rep))
            recorder.submit(rec)
            if not retry:
                metrics.observe(rec, status or 500)
        # Retry: the failed attempt is recorded above; the next attempt is a new row of the
        # same logical call.
        rec = _next_attempt(rec)


def _secrets(request: web.Request, rep: Replica) -> tuple[str | None, ...]:
    """The keys this call carried (the client's and the replica's), to keep out of ``error``."""
    headers = request.headers
    auth = headers.get("Authorization")
    token = auth[7:].strip() if auth and auth[:7].lower() == "bearer " else auth
    return (token, headers.get("api-key"), headers.get("x-api-key"), rep.api_key)


def _next_attempt(rec: CallRecord) -> CallRecord:
    return CallRecord(
        call_id=rec.call_id,
        proxy_id=rec.proxy_id,
        workflow=rec.workflow,
        request_id=rec.request_id,
        model=rec.model,
        endpoint=rec.endpoint,
        attempt=rec.attempt + 1,
        stream=rec.stream,
        t_start=rec.t_start,
        request_bytes=rec.request_bytes,
        body=rec.body,
    )


# The engine routes by name resolve with one dict lookup in aiohttp's router; everything else
# (workflow paths, proxy.extra_routes, unknown paths) falls through to the catch-all, where the
# allow-list (proxy.routes) answers 404 for what is not an engine route. Any other method on
# these paths is aiohttp's 405.
routes = web.RouteTableDef()
for _route in sorted(ENGINE_ROUTES):
    routes.post(_route)(handle)
routes.post("/{tail:.*}")(handle)

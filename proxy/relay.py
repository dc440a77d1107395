"""Relaying one upstream exchange to the client: plain bodies and Server-Sent Event streams.

Role: given an open upstream response, write it to the client and fill the call record's
first-byte time, token usage, response size and mid-stream error. Knows the engines' wire
shapes (engine-api.md), nothing about routing or identity.

Invariants:
- SSE events are forwarded as they arrive: every read from upstream is split into complete
  events and those are written at once; only an incomplete tail waits for its next bytes;
- the usage event the proxy asked for on the client's behalf (``strip_usage``) is read and
  never forwarded; every other event is forwarded byte for byte;
- usage found nowhere stays ``None`` (unknown), never zero; both shapes are read: chat and
  completions (``prompt_tokens``/``completion_tokens``) and the Responses API
  (``input_tokens``/``output_tokens``, in its final ``response.completed`` event);
- an event may carry ``event:``/``id:`` lines before its ``data:`` line (the Responses API
  names every event): its data is read all the same;
- an upstream stream cut mid-way ends the client's stream with an OpenAI-style error event, so
  the client sees a failure rather than a silently short answer.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import orjson
from aiohttp import web
from multidict import CIMultiDict

from proxy.errors import error_body
from proxy.upstream import UpstreamProtocolError, UpstreamResponse
from shared.records import CallRecord, now_us

log = logging.getLogger(__name__)

_EVENT_END = re.compile(rb"\r?\n\r?\n")
_USAGE = b'"usage"'
# Every error shape engines stream contains this: chat's `data: {"error": ...}`, the Responses
# API's `{"type": "error", ...}` and its `response.failed` event (`"error": {...}`).
_ERROR = b'"error"'
_TYPE_ERROR = re.compile(rb'"type"\s*:\s*"error"')
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "content-length",
        "content-encoding",
        "date",
        "server",
    }
)


def _object_after(data: bytes, start: int) -> Any:
    """Parse the JSON object opening at the first ``{`` at or after ``start``. Braces are
    matched by counting, which is exact for ``usage`` objects (numbers and nested objects,
    no strings) and costs a few C-level scans instead of a Python loop over bytes."""
    begin = data.find(b"{", start)
    if begin < 0:
        return None
    end = data.find(b"}", begin)
    while end >= 0 and data.count(b"{", begin, end + 1) > data.count(b"}", begin, end + 1):
        end = data.find(b"}", end + 1)
    if end < 0:
        return None
    try:
        return orjson.loads(data[begin : end + 1])
    except orjson.JSONDecodeError:
        return None


def find_usage(data: bytes) -> dict[str, Any] | None:
    """The last ``"usage": {...}`` object in a JSON body or event, without parsing the rest
    (embedding responses are large; usage sits at their end)."""
    at = data.rfind(_USAGE)
    if at < 0:
        return None
    colon = data.find(b":", at + len(_USAGE))
    if colon < 0 or data[colon + 1 : colon + 8].lstrip().startswith(b"null"):
        return None
    usage = _object_after(data, colon)
    return usage if isinstance(usage, dict) else None


def apply_usage(rec: CallRecord, usage: dict[str, Any]) -> None:
    prompt = usage.get("prompt_tokens")
    if prompt is None:
        prompt = usage.get("input_tokens")  # the Responses API
    if prompt is None:
        prompt = usage.get("total_tokens")  # rerank/score report only a total
    if isinstance(prompt, int):
        rec.prompt_tokens = prompt
    completion = usage.get("completion_tokens")
    if completion is None:
        completion = usage.get("output_tokens")
    if isinstance(completion, int):
        rec.completion_tokens = completion
    elif isinstance(prompt, int):
        rec.completion_tokens = 0
    details = usage.get("prompt_tokens_details")
    if details is None:
        details = usage.get("input_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        rec.cached_tokens = details["cached_tokens"]


def response_headers(upstream: UpstreamResponse, call_id: str) -> CIMultiDict[str]:
    headers = CIMultiDict(
        (k, v) for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP
    )
    headers["X-Scepsy-Call-Id"] = call_id
    return headers


async def relay_body(upstream: UpstreamResponse, rec: CallRecord) -> web.Response:
    """A whole (non-streamed) response: read, take usage, pass through unchanged."""
    body = await upstream.read()
    rec.t_first_byte = rec.t_first_byte or now_us()
    rec.response_bytes = len(body)
    if upstream.status < 300:
        usage = find_usage(body)
        if usage is not None:
            apply_usage(rec, usage)
    else:
        rec.error = body[:500].decode("utf-8", errors="replace")
    return web.Response(
        status=upstream.status, body=body, headers=response_headers(upstream, rec.call_id)
    )


def _event_payload(event: bytes) -> bytes:
    """The data of a ``data: ...`` event (what engines send), also when ``event:`` or ``id:``
    lines come first (the Responses API)."""
    if event.startswith(b"data:"):
        return event[5:].lstrip()
    at = event.find(b"\ndata:")
    return event[at + 6 :].lstrip() if at >= 0 else event


async def relay_stream(
    request: web.Request, upstream: UpstreamResponse, rec: CallRecord, strip_usage: bool
) -> web.StreamResponse:
    """Relay an SSE stream event by event; strip the usage event the client did not ask for.

    A client that hangs up ends the relay quietly: leaving this function closes the upstream
    response, which makes the engine abort the request.
    """
    out = web.StreamResponse(
        status=upstream.status, headers=response_headers(upstream, rec.call_id)
    )
    out.headers["Cache-Control"] = "no-cache"
    try:
        await out.prepare(request)
        await _relay_events(out, upstream, rec, strip_usage)
    except ConnectionResetError:
        rec.error = "client disconnected"
        return out
    if upstream.status >= 300 and rec.error is None:
        rec.error = f"upstream answered {upstream.status} with an event stream"
    return out


async def _relay_events(
    out: web.StreamResponse, upstream: UpstreamResponse, rec: CallRecord, strip_usage: bool
) -> web.StreamResponse:
    pending = b""
    try:
        async for chunk in upstream.iter_any():
            if rec.t_first_byte is None:
                rec.t_first_byte = now_us()
            data = pending + chunk if pending else chunk
            if b"\r" not in data and _USAGE not in data and _ERROR not in data:
                # Fast path (nearly every chunk): forward all complete events in one write.
                end = data.rfind(b"\n\n") + 2
                pending = data[end:] if end > 1 else data
                if end > 1:
                    rec.response_bytes += end
                    await out.write(data[:end])
                continue
            last = 0
            keep: list[bytes] = []
            dropped = False
            for m in _EVENT_END.finditer(data):
                event = data[last : m.end()]
                last = m.end()
                if (_USAGE in event or _ERROR in event) and _inspect_event(event, rec, strip_usage):
                    dropped = True
                    continue
                keep.append(event)
            pending = data[last:]
            if last == 0:
                continue
            payload = data[:last] if not dropped else b"".join(keep)
            if payload:
                rec.response_bytes += len(payload)
                await out.write(payload)
        if pending:
            rec.response_bytes += len(pending)
            await out.write(pending)
    except UpstreamProtocolError as exc:
        rec.error = f"upstream stream cut: {exc.__class__.__name__}: {exc}"
        log.warning("upstream %s of model %s cut a stream: %s", rec.upstream, rec.model, exc)
        await out.write(
            _error_event("The upstream engine ended the stream early.", "upstream_error")
        )
    except TimeoutError:
        rec.error = "upstream stream timed out"
        log.warning("upstream %s of model %s: a stream timed out", rec.upstream, rec.model)
        await out.write(_error_event("The upstream engine stopped sending.", "upstream_timeout"))
    await out.write_eof()
    return out


def _is_dropped(event: bytes, strip_usage: bool) -> bool:
    """The proxy-requested usage chunk: ``choices`` empty and ``usage`` set."""
    if not strip_usage:
        return False
    try:
        obj = orjson.loads(_event_payload(event))
    except orjson.JSONDecodeError:
        return False
    return isinstance(obj, dict) and not obj.get("choices") and bool(obj.get("usage"))


def _inspect_event(event: bytes, rec: CallRecord, strip_usage: bool) -> bool:
    """Take usage or an error from one event; True when the event is to be dropped."""
    payload = _event_payload(event)
    if payload.startswith(b'{"error"'):
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            obj = None
        err = obj.get("error") if isinstance(obj, dict) else None
        message = err.get("message") if isinstance(err, dict) else err
        rec.error = f"upstream error event: {message}"
        return False
    if b'"response.failed"' in payload or _TYPE_ERROR.search(payload):
        _responses_error(payload, rec)
    usage = find_usage(payload)
    if usage is not None:
        apply_usage(rec, usage)
    return _is_dropped(event, strip_usage)


def _responses_error(payload: bytes, rec: CallRecord) -> None:
    """The Responses API's failures: an ``error`` event (``{"type": "error", "message"}``) or
    ``response.failed`` (the response's ``error`` object)."""
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return
    if not isinstance(obj, dict):
        return
    if obj.get("type") == "error":
        rec.error = f"upstream error event: {obj.get('message')}"
    elif obj.get("type") == "response.failed":
        response = obj.get("response")
        err = response.get("error") if isinstance(response, dict) else None
        message = err.get("message") if isinstance(err, dict) else err
        rec.error = f"upstream response failed: {message}"


def _error_event(message: str, code: str) -> bytes:
    return b"data: " + error_body(message, type_="bad_gateway", code=code) + b"\n\n"

"""The proxy's one error boundary: whatever goes wrong in a request, the client gets an
OpenAI-shaped JSON error, and the log gets one line (a traceback only for the proxy's own bugs).

Role: the only place an error response is built (:func:`error_response`, whose body is
``proxy.errors.error_body``), and three pieces that together route every way aiohttp can answer
a request through it:
- :func:`error_middleware`, around every handler: a :class:`~proxy.errors.ProxyError` (which
  handlers raise, never answer themselves) becomes its response, aiohttp's own
  ``HTTPException`` (no such route 404, wrong method 405, body over ``client_max_size`` 413,
  ...) the same status in OpenAI shape, and any other exception a 500 logged once with its
  traceback (a real bug);
- :class:`ProxyRunner`, the ``web.AppRunner`` to serve the app with: it builds the server's
  per-connection protocol as :class:`_Protocol`, whose ``handle_error`` answers what aiohttp
  refuses before any handler runs (a bad request line, too many or too long headers, a control
  character in a header: ``BadHttpMessage``/``HttpProcessingError``) in OpenAI shape too, and
  logs one line without a traceback. aiohttp has no hook for those answers
  (aio-libs/aiohttp#3287); subclassing the runner's server factory, the one place it builds
  protocols, is the supported way to give it another protocol class;
- the client-side timeouts: the runner's ``keepalive_timeout`` is ``proxy.client_header_timeout_s``,
  which in aiohttp also bounds a connection that sends nothing or part of a request head (the
  body's bound is read in ``proxy.forward``).

Invariants: no client input yields a text/plain answer or a traceback in the log; a 5xx from
here is a bug of the proxy's, never a client's mistake.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from proxy.errors import ProxyError

log = logging.getLogger("scepsy.proxy")

# aiohttp's own refusals, by status: (OpenAI error type, code). Others: invalid_request_error.
_HTTP_CODES: dict[int, tuple[str, str]] = {
    400: ("invalid_request_error", "invalid_request"),
    401: ("authentication_error", "invalid_api_key"),
    404: ("invalid_request_error", "not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    408: ("invalid_request_error", "request_timeout"),
    413: ("invalid_request_error", "request_too_large"),
    414: ("invalid_request_error", "uri_too_long"),
    415: ("invalid_request_error", "unsupported_media_type"),
    431: ("invalid_request_error", "request_header_fields_too_large"),
}
_MESSAGE_LIMIT = 300  # characters of aiohttp's own message (it may quote the client's bytes)


class InternalError(ProxyError):
    """A bug of the proxy's: the one way a client sees a 500."""


_BUG = "The proxy failed on this call (see its log)."


class Refusal(ProxyError):
    """One of aiohttp's own answers (a status it chose), in OpenAI terms; ``code`` is the
    fallback for a status :data:`_HTTP_CODES` does not name."""

    def __init__(self, status: int, message: str, *, code: str) -> None:
        super().__init__(message)
        self.status = status
        if status >= 500:
            self.type, self.code = "internal_error", "internal_error"
        else:
            self.type, self.code = _HTTP_CODES.get(status, ("invalid_request_error", code))


def error_response(exc: ProxyError, headers: dict[str, str] | None = None) -> web.Response:
    """The answer to ``exc``: its status, its OpenAI-shaped body (``proxy.errors.error_body``);
    the one place the proxy builds an error response."""
    resp = web.Response(
        status=exc.status, body=exc.body(), content_type="application/json", headers=headers
    )
    if exc.close:
        resp.force_close()
    return resp


def _from_http_exception(exc: web.HTTPException) -> web.Response:
    if exc.status == 404:
        message = "Unknown route."
    elif isinstance(exc, web.HTTPMethodNotAllowed):
        message = f"Method {exc.method} is not allowed on this route."
    else:
        message = exc.text or exc.reason
    allow = exc.headers.get("Allow")
    refusal = Refusal(exc.status, message[:_MESSAGE_LIMIT], code="http_error")
    return error_response(refusal, {"Allow": allow} if allow else None)


@web.middleware
async def error_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """Every handler's errors, as OpenAI-shaped JSON (see the module docstring)."""
    try:
        resp: web.StreamResponse = await handler(request)
        return resp
    except ProxyError as exc:
        return error_response(exc)
    except web.HTTPException as exc:
        if exc.status < 400:  # a redirect or a success raised as an exception: as it is
            raise
        return _from_http_exception(exc)
    except (asyncio.CancelledError, ConnectionError):
        raise  # the client hung up (or shutdown): nobody to answer
    except Exception:
        log.exception("bug: %s %s failed", request.method, request.rel_url.raw_path[:200])
        return error_response(InternalError(_BUG))


class _Protocol(RequestHandler):
    """aiohttp's per-connection protocol, answering its own refusals in OpenAI shape."""

    __slots__ = ()

    def handle_error(
        self,
        request: Any,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0:  # as aiohttp: the answer has begun, nothing to add
            raise ConnectionError("response already started; cannot send the error")
        if status >= 500:
            log.error("bug: aiohttp failed on a request", exc_info=exc)
            err: ProxyError = InternalError(_BUG)
        else:
            why = message or (str(exc) if exc is not None else "") or "bad request"
            why = why[:_MESSAGE_LIMIT]
            log.info("refused a malformed request from %s: %s", request.remote, why)
            err = Refusal(status, f"Malformed HTTP request: {why}", code="invalid_request")
        err.close = True  # the connection's state is unknown: aiohttp closes it too
        return error_response(err)


class _Server(web.Server):
    """aiohttp's server (the protocol factory), making :class:`_Protocol` connections."""

    def __init__(
        self,
        handler: Any,
        *,
        request_factory: Any,
        handler_cancellation: bool,
        loop: asyncio.AbstractEventLoop,
        protocol_kwargs: dict[str, Any],
    ) -> None:
        super().__init__(
            handler,
            request_factory=request_factory,
            handler_cancellation=handler_cancellation,
            loop=loop,
            **protocol_kwargs,
        )
        self._protocol_loop = loop
        self._protocol_kwargs = protocol_kwargs

    def __call__(self) -> RequestHandler:
        return _Protocol(self, loop=self._protocol_loop, **self._protocol_kwargs)


class ProxyRunner(web.AppRunner):
    """``web.AppRunner`` whose connections answer aiohttp's own refusals in OpenAI shape.
    Takes ``AppRunner``'s arguments (``keepalive_timeout``, ``access_log``, ...)."""

    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        skip = {"handle_signals", "shutdown_timeout", "handler_cancellation"}
        self._protocol_kwargs = {k: v for k, v in kwargs.items() if k not in skip}
        self._handler_cancellation = bool(kwargs.get("handler_cancellation", False))

    async def _make_server(self) -> web.Server:
        base = await super()._make_server()  # starts and freezes the app, as AppRunner does
        return _Server(
            base.request_handler,
            request_factory=base.request_factory,
            handler_cancellation=self._handler_cancellation,
            loop=asyncio.get_running_loop(),
            protocol_kwargs=self._protocol_kwargs,
        )

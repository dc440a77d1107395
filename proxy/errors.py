"""The proxy's error vocabulary, and the one function that shapes an OpenAI-style error body.

Role: every failure a client can see is a :class:`ProxyError` raised somewhere in the proxy
(or one of aiohttp's own refusals) and answered by ``proxy.boundary`` as
``{"error": {"message", "type", "param", "code"}}`` with the error's status. :func:`error_body`
is the only place that shape is written: the boundary's responses and the relay's mid-stream
error events both use it.

Invariants: no aiohttp here (errors are data; responses are the boundary's); a subclass fixes
``status``/``type``/``code``, an instance carries the message and the offending ``param``.
"""

from __future__ import annotations

import orjson


def error_body(message: str, *, type_: str, code: str, param: str | None = None) -> bytes:
    """An OpenAI-style error document, as JSON bytes (the shape the OpenAI SDKs parse)."""
    return orjson.dumps(
        {"error": {"message": message, "type": type_, "param": param, "code": code}}
    )


class ProxyError(Exception):
    """A failure with the HTTP status and OpenAI error ``type``/``code`` a client should see."""

    status = 500
    type = "internal_error"
    code = "internal_error"
    close = False  # close the connection after answering (a request left half-read)

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> bytes:
        return error_body(self.message, type_=self.type, code=self.code, param=self.param)


class BadRequest(ProxyError):
    status, type, code = 400, "invalid_request_error", "invalid_request"


class BodyTooLarge(ProxyError):
    status, type, code = 413, "invalid_request_error", "request_too_large"


class ClientTimeout(ProxyError):
    """The client did not send its request body in time (``proxy.client_body_timeout_s``)."""

    status, type, code = 408, "invalid_request_error", "request_timeout"
    close = True


class Unauthorized(ProxyError):
    status, type, code = 401, "authentication_error", "invalid_api_key"


class ModelNotFound(ProxyError):
    status, type, code = 404, "invalid_request_error", "model_not_found"


class RouteNotFound(ProxyError):
    status, type, code = 404, "invalid_request_error", "not_found"


class NoReplica(ProxyError):
    """No replica of the model could be reached (all ejected, draining, or refusing)."""

    status, type, code = 503, "service_unavailable", "no_replica_available"


class UpstreamFailed(ProxyError):
    """The upstream broke the exchange after the connection was made."""

    status, type, code = 502, "bad_gateway", "upstream_error"


class UpstreamTimeout(ProxyError):
    status, type, code = 504, "timeout", "upstream_timeout"


class ServiceUnavailable(ProxyError):
    """The proxy itself cannot do what was asked right now (its workers' supervisor is gone)."""

    status, type, code = 503, "service_unavailable", "service_unavailable"

"""The proxy's error vocabulary, and its translation into OpenAI-style HTTP error bodies.

Role: every failure a client can see is a :class:`ProxyError` raised somewhere in the proxy and
turned into ``{"error": {"message", "type", "param", "code"}}`` with the right status at the
boundary (the request handler). Nothing else in the proxy builds error responses.
"""

from __future__ import annotations

import orjson
from aiohttp import web


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
        return orjson.dumps(
            {
                "error": {
                    "message": self.message,
                    "type": self.type,
                    "param": self.param,
                    "code": self.code,
                }
            }
        )

    def response(self) -> web.Response:
        resp = web.Response(status=self.status, body=self.body(), content_type="application/json")
        if self.close:
            resp.force_close()
        return resp


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

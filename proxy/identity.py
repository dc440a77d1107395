"""Workflow identity (DESIGN §3.1): which workflow and which workflow request a call belongs to.

Role: pure functions from a call's routed path (:mod:`proxy.routes`), headers and parsed body
to ``(workflow, request_id)``. Sources are tried in the order DESIGN §3.1 gives; the first
present wins.

Invariants:
- identity values are normalised here, once, before anything stores, counts or routes on them:
  valid UTF-8 (aiohttp keeps undecodable header bytes as lone surrogates; each becomes U+FFFD)
  and at most ``max_chars`` characters (``proxy.identity_max_chars``); see :func:`normalise`;
- ``X-Scepsy-*`` headers never go upstream (see :func:`is_private_header`); ``traceparent`` does;
- a request id is ``None`` when no source names one (such calls are excluded from per-request
  statistics, and counted).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proxy.routes import RoutedPath
from shared.records import valid_text

WORKFLOW_HEADER = "X-Scepsy-Workflow"
REQUEST_ID_HEADER = "X-Scepsy-Request-Id"
PRIVATE_HEADER_PREFIX = "x-scepsy-"

# Session headers other tools already send, in the order they are trusted. One table: add a
# tool here and nowhere else.
SESSION_HEADERS: tuple[str, ...] = (
    "x-session-id",
    "Helicone-Session-Id",
    "X-SMG-Routing-Key",
    "x-session-token",
    "agent-session-id",
)
# Body fields that carry a session/root id: (path of keys, what the tool is).
SESSION_BODY_FIELDS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("vllm_xargs", "agentic_context"), "vLLM agentic context root id"),
    (("metadata", "litellm_session_id"), "LiteLLM session"),
    (("litellm_session_id",), "LiteLLM session (top level)"),
)
# Inside a structured agentic_context, the keys that name the root of the agent run.
_ROOT_KEYS = ("root_id", "root_request_id", "session_id", "id")

_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-(?P<trace>[0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}")
_ZERO_TRACE = "0" * 32


DEFAULT_MAX_CHARS = 256  # proxy.identity_max_chars


@dataclass(frozen=True, slots=True)
class Identity:
    workflow: str | None
    request_id: str | None
    upstream_path: str
    source: str  # which source gave the request id ("header", "path", a session header, ...)


def normalise(value: str | None, max_chars: int = DEFAULT_MAX_CHARS) -> str | None:
    """A client-given identity string as the store, ``/metrics`` and routing can take it:
    valid UTF-8 (U+FFFD for what was not), at most ``max_chars`` characters; an empty value
    is no value. ASCII within the bound (nearly every value) passes untouched."""
    if not value:
        return None
    if value.isascii() and len(value) <= max_chars:
        return value
    return valid_text(value, max_chars)


def _dig(body: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    # Bodies are parsed JSON: plain dicts (an ABC isinstance check costs ten times more).
    value: Any = body
    for key in keys:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def _body_session(body: Mapping[str, Any]) -> tuple[str | None, str]:
    for keys, what in SESSION_BODY_FIELDS:
        value = _dig(body, keys)
        if isinstance(value, dict):
            value = next((value[k] for k in _ROOT_KEYS if value.get(k)), None)
        if isinstance(value, str | int) and str(value):
            return str(value), what
    return None, ""


def trace_id(traceparent: str | None) -> str | None:
    """The W3C trace-id of a ``traceparent`` header, or None when absent or invalid."""
    if not traceparent:
        return None
    m = _TRACEPARENT.match(traceparent.strip().lower())
    if m is None or m["trace"] == _ZERO_TRACE:
        return None
    return m["trace"]


def identify(
    path: RoutedPath,
    headers: Mapping[str, str],
    body: Mapping[str, Any],
    default_workflow: str | None,
    max_chars: int = DEFAULT_MAX_CHARS,
) -> Identity:
    """Workflow and request id of one call, from the first source present (DESIGN §3.1),
    each normalised (:func:`normalise`)."""
    workflow = normalise(
        headers.get(WORKFLOW_HEADER) or path.workflow or default_workflow, max_chars
    )
    route = path.route
    rid = headers.get(REQUEST_ID_HEADER)
    if rid:
        return Identity(workflow, normalise(rid, max_chars), route, "header")
    if path.request_id:
        return Identity(workflow, normalise(path.request_id, max_chars), route, "path")
    for name in SESSION_HEADERS:
        value = headers.get(name)
        if value:
            return Identity(workflow, normalise(value, max_chars), route, name.lower())
    value, what = _body_session(body)
    if value:
        return Identity(workflow, normalise(value, max_chars), route, what)
    tid = trace_id(headers.get("traceparent"))
    if tid:
        return Identity(workflow, tid, route, "traceparent")
    return Identity(workflow, None, route, "none")


def is_private_header(name: str) -> bool:
    return name.lower().startswith(PRIVATE_HEADER_PREFIX)

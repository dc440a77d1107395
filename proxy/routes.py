"""Which client paths reach an engine, and the upstream path each becomes.

Role: resolve a client's raw request path (``/v1/chat/completions``, or with the workflow
prefix ``/w/<workflow>[/r/<request id>]/v1/...``) against an allow-list of engine routes: the
OpenAI-compatible routes vLLM and SGLang serve (engine-api.md), the engines' own documented
ones, and ``proxy.extra_routes``. Pure functions and one small class; no I/O.

Invariants:
- only an allow-listed route reaches an engine, and the upstream path is the allow-list's own
  string, never bytes copied from the client's path (a query string is dropped, as before);
- the prefix is parsed on the raw (still percent-encoded) path, so an escape can never move a
  segment boundary: a workflow or request-id segment that is empty, is ``.`` or ``..``, holds
  ``%2F``/``%2E`` or a control character once decoded is refused (:class:`PathRefused`);
- the common call (a bare allow-listed path) costs one dict lookup and allocates nothing.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import unquote

# The OpenAI-compatible routes engines serve (engine-api.md: vLLM and SGLang), and the
# engines' own documented ones (rerank and score aliases, pooling, classify).
ENGINE_ROUTES: frozenset[str] = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/rerank",
        "/rerank",
        "/v2/rerank",
        "/v1/score",
        "/score",
        "/pooling",
        "/classify",
    }
)
_ESCAPED_SEPARATOR = re.compile(r"%2[fFeE]|%5[cC]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


class PathRefused(ValueError):
    """The path is not an engine route, or its workflow prefix is malformed."""


@dataclass(frozen=True, slots=True)
class RoutedPath:
    route: str  # the allow-listed route: the upstream path
    workflow: str | None  # from the /w/<workflow> prefix, percent-decoded
    request_id: str | None  # from the /r/<id> prefix, percent-decoded


class Routes:
    """The allow-list of one proxy (its settings' ``extra_routes`` included)."""

    __slots__ = ("_plain", "allowed")

    def __init__(self, extra: Iterable[str] = ()) -> None:
        self.allowed: frozenset[str] = ENGINE_ROUTES | frozenset(extra)
        self._plain = {route: RoutedPath(route, None, None) for route in self.allowed}

    def resolve(self, raw_path: str) -> RoutedPath:
        """The route and path-borne identity of ``raw_path`` (``request.raw_path``: still
        percent-encoded, maybe with a query); :class:`PathRefused` for anything else."""
        hit = self._plain.get(raw_path)
        if hit is not None:
            return hit
        path = raw_path.partition("?")[0].partition("#")[0]
        workflow = rid = None
        if path.startswith("/w/"):
            wf_raw, sep, rest = path[3:].partition("/")
            if not sep:
                raise PathRefused("A /w/<workflow> prefix must be followed by a route.")
            workflow = _segment(wf_raw, "workflow")
            if rest.startswith("r/"):
                rid_raw, sep, rest = rest[2:].partition("/")
                if not sep:
                    raise PathRefused("A /r/<request id> prefix must be followed by a route.")
                rid = _segment(rid_raw, "request id")
            path = "/" + rest
        route = unquote(path, errors="replace") if "%" in path else path
        known = self._plain.get(route)
        if known is None:
            shown = route if len(route) <= 100 else route[:100] + "..."
            raise PathRefused(f"Unknown route POST {shown!r}.")
        if workflow is None:
            return known
        return RoutedPath(known.route, workflow, rid)


def _segment(raw: str, what: str) -> str:
    """One prefix segment, decoded; refused when it could name another path."""
    if not raw:
        raise PathRefused(f"The {what} in the path prefix is empty.")
    if "%" in raw:
        if _ESCAPED_SEPARATOR.search(raw):
            raise PathRefused(f"The {what} in the path prefix holds an escaped / . or \\.")
        raw = unquote(raw, errors="replace")
    if raw in (".", "..") or _CONTROL.search(raw):
        raise PathRefused(f"The {what} in the path prefix is not a plain name.")
    return raw

"""A lean keep-alive HTTP/1.1 client for the proxy's calls to engine replicas.

Role: send one request to an engine (vLLM/SGLang behind uvicorn) and hand back its response
head and body pieces, with pooled connections per ``(scheme, host, port)``. It replaces
``aiohttp.ClientSession`` on the proxy's hot path, where that costs about a quarter of the
proxy's CPU per call; it speaks only what engines speak: ``http`` or ``https`` (TLS, checked
with the caller's ``ssl.SSLContext``), ``Content-Length`` or chunked bodies (SSE), or bodies
that end when the connection closes.

Invariants:
- one connection carries one exchange at a time; it returns to the pool only when its
  response was received in full, the server allowed keep-alive and nothing arrived after the
  response; anything else (cancellation, an unread body, a malformed or over-long answer,
  stray bytes) closes it, so no byte of one exchange can ever reach another;
- failures before any response byte are :class:`UpstreamConnectError` (the engine never
  answered: safe to retry elsewhere; :class:`UpstreamTLSError` when the TLS handshake failed);
  a reused pooled connection failing that way is retried
  once on a fresh connection before the caller sees anything; failures after a response byte
  are :class:`UpstreamProtocolError`; silence past ``read_timeout_s`` or an exchange past
  ``total_timeout_s`` is :class:`TimeoutError`;
- header values go out as the bytes they came in as: a ``str`` decoded by aiohttp (UTF-8, with
  undecodable bytes as lone surrogates) is encoded back the same way, so nothing is lost or
  re-coded on the way; a value that cannot be written is :class:`UpstreamRequestError`
  (a ``ValueError``), raised before any connection is used;
- each connection owns at most one timer handle, re-armed only when it fires, serving the
  read, total and idle timeouts alike; each wait is one future, woken by the protocol;
- at most ``_HIGH_WATER`` bytes of unread body are buffered before reading pauses, and
  reading resumes once the consumer has taken them.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Iterable
from types import TracebackType

from multidict import CIMultiDictProxy

from proxy.upstream_wire import (
    DONE,
    HEAD,
    Connection,
    Target,
    UpstreamConnectError,
    UpstreamProtocolError,
    UpstreamTLSError,
    UpstreamUnanswered,
)
from shared.settings import split_upstream_url

__all__ = [
    "UpstreamClient",
    "UpstreamConnectError",
    "UpstreamProtocolError",
    "UpstreamRequestError",
    "UpstreamResponse",
    "UpstreamTLSError",
    "UpstreamUnanswered",
    "tls_context",
]

# Headers the client writes itself; a caller's copy would contradict the framing.
_RESERVED = frozenset({"host", "content-length", "transfer-encoding", "connection"})
_RESERVED_LENGTHS = frozenset(map(len, _RESERVED))  # most names skip the lower() this way
_MAX_CACHED_LINES = 1024
# A TLS connection the proxy closes waits this long for the engine's close_notify before it is
# dropped: the engine needs no goodbye (it aborts the request either way), and shutdown must
# not wait on a silent peer for asyncio's default 30 s.
_TLS_SHUTDOWN_S = 1.0


class UpstreamRequestError(ValueError):
    """The request cannot be written as given (a header with a line break, or a value that
    has no bytes): the caller's input, refused before anything is sent."""


def tls_context(verify: bool = True, ca_file: str | None = None) -> ssl.SSLContext:
    """The client context for ``https://`` upstreams: the system's trust store or ``ca_file``,
    host names checked; ``verify=False`` accepts any certificate (testing only)."""
    ctx = ssl.create_default_context(cafile=ca_file)
    if not verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


class _Body:
    """``async for piece in response.iter_any()``: whatever arrived since the last piece."""

    __slots__ = ("_conn", "_exchange")

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._exchange = conn.exchanges

    def __aiter__(self) -> _Body:
        return self

    async def __anext__(self) -> bytes:
        conn = self._conn
        while True:
            if conn.exchanges != self._exchange:
                raise RuntimeError("response body read after its connection was released")
            if conn.pieces:
                return conn.take()
            if conn.body_done:
                raise StopAsyncIteration
            if conn.exc is not None:
                raise conn.exc
            await conn.wait()


class UpstreamResponse:
    """A response whose head has arrived; the body is read with :meth:`read` or
    :meth:`iter_any`, and :meth:`release` (or leaving ``async with``) ends the exchange."""

    __slots__ = ("_body", "_client", "_conn", "_released", "headers", "reason", "status")

    def __init__(
        self,
        client: UpstreamClient,
        conn: Connection,
        status: int,
        reason: str,
        headers: CIMultiDictProxy[str],
    ) -> None:
        self._client = client
        self._conn = conn
        self._released = False
        self._body: bytes | None = None
        self.status = status
        self.reason = reason
        self.headers = headers

    async def read(self) -> bytes:
        """The whole body, de-chunked (read once; later calls return the same bytes)."""
        if self._body is not None:
            return self._body
        if self._released:
            raise RuntimeError("response body read after release()")
        conn = self._conn
        if conn.body_done:  # the usual JSON answer: it came with its head
            body = conn.take() if conn.pieces else b""
        else:
            body = b"".join([piece async for piece in _Body(conn)])
        self._body = body
        return body

    def iter_any(self) -> AsyncIterator[bytes]:
        """Body pieces as they arrive, de-chunked; ends at the end of the body."""
        if self._released:
            raise RuntimeError("response body read after release()")
        return _Body(self._conn)

    def release(self) -> None:
        """Back to the pool when the body was received in full; otherwise close the
        connection (an engine aborts a request whose connection closes)."""
        if not self._released:
            self._released = True
            self._client._release(self._conn)

    def close(self) -> None:
        """Close the connection whatever state the body is in."""
        self._released = True
        self._conn.close()

    async def __aenter__(self) -> UpstreamResponse:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()


class UpstreamClient:
    """Pooled HTTP/1.1 connections to engine replicas, one event loop's worth."""

    def __init__(
        self,
        *,
        connect_timeout_s: float = 5.0,
        read_timeout_s: float = 300.0,
        total_timeout_s: float = 600.0,
        idle_timeout_s: float = 30.0,
        max_idle_per_host: int = 1024,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.total_timeout_s = total_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.max_idle_per_host = max_idle_per_host
        self._ssl_context = ssl_context  # None: the default one, made at the first https call
        self._targets: dict[str, Target] = {}  # by base URL
        self._by_address: dict[tuple[str, str, int], Target] = {}
        self._lines: dict[tuple[str, str], bytes] = {}
        self._conns: set[Connection] = set()
        self._closed = False
        self._all_gone: asyncio.Future[None] | None = None

    async def request(
        self,
        method: str,
        base_url: str,
        path: str,
        headers: Iterable[tuple[str, str]],
        body: bytes,
    ) -> UpstreamResponse:
        """Send ``method path`` to ``base_url`` and return once the response head is in.

        Raises :class:`UpstreamConnectError` when no response byte came back (connect
        refused or timed out, TLS handshake failed (:class:`UpstreamTLSError`), connection
        closed unanswered), :class:`UpstreamProtocolError` for a malformed or cut response
        head, :class:`TimeoutError` for a silent engine, :class:`UpstreamRequestError` for a
        header that cannot be written (a line break, a value with no bytes) and
        ``ValueError`` for a URL other than ``http[s]://host[:port]``. Cancellation closes
        the connection.
        """
        if self._closed:
            raise RuntimeError("UpstreamClient is closed")
        target = self._targets.get(base_url) or self._target(base_url)
        line = self._lines.get((method, path)) or self._line(method, path)
        head = b"%s%s%sContent-Length: %d\r\n\r\n" % (
            line,
            target.host_line,
            _encode_headers(headers),
            len(body),
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.total_timeout_s
        idle = target.idle
        if idle:
            conn = idle.pop()
            conn.pooled = False
            try:
                return await self._exchange(conn, head, body, method, deadline)
            except (UpstreamConnectError, UpstreamUnanswered) as exc:
                # Most likely closed by the server while idle: once more, on a fresh connection.
                # If even that cannot connect, the engine died: the first attempt may have
                # reached it, so the failure is reported as unanswered, never as retryable.
                try:
                    conn = await self._connect(target, deadline)
                except UpstreamConnectError as again:
                    raise UpstreamUnanswered(f"{exc}; reconnecting failed: {again}") from again
                return await self._exchange(conn, head, body, method, deadline)
        conn = await self._connect(target, deadline)
        return await self._exchange(conn, head, body, method, deadline)

    def connections(self) -> tuple[int, int]:
        """(open, idle) connections over all upstreams (for metrics and tests)."""
        return len(self._conns), sum(len(t.idle) for t in self._by_address.values())

    async def close(self) -> None:
        """Close every connection, pooled or in use, and wait until they are gone."""
        self._closed = True
        for target in self._by_address.values():
            while target.idle:
                target.idle.pop().pooled = False
        if not self._conns:
            return
        self._all_gone = asyncio.get_running_loop().create_future()
        for conn in list(self._conns):
            conn.close()
        await self._all_gone

    # -- internals -----------------------------------------------------------------------

    def _target(self, base_url: str) -> Target:
        try:
            scheme, host, port = split_upstream_url(base_url)
        except ValueError as exc:  # the settings refuse such URLs; said again for other callers
            raise ValueError(f"upstream URL {exc}") from None
        target = self._by_address.get((scheme, host, port))
        if target is None:  # one pool per (scheme, host, port), however the URL spells it
            shown = f"[{host}]" if ":" in host else host
            line = f"Host: {shown}:{port}\r\n".encode("ascii")
            target = Target(host, port, line, tls=scheme == "https")
            self._by_address[(scheme, host, port)] = target
        self._targets[base_url] = target
        return target

    def _tls(self) -> ssl.SSLContext:
        if self._ssl_context is None:
            self._ssl_context = tls_context()
        return self._ssl_context

    def _line(self, method: str, path: str) -> bytes:
        if not method.isalpha() or not path.startswith("/") or any(c in path for c in " \r\n"):
            raise ValueError(f"bad request line: {method!r} {path!r}")
        if len(self._lines) >= _MAX_CACHED_LINES:
            self._lines.clear()
        line = f"{method} {path} HTTP/1.1\r\n".encode("latin-1")
        self._lines[(method, path)] = line
        return line

    async def _connect(self, target: Target, deadline: float) -> Connection:
        loop = asyncio.get_running_loop()
        at = min(loop.time() + self.connect_timeout_s, deadline)
        where = f"{target.host}:{target.port}"
        made: list[Connection] = []

        def factory() -> Connection:
            made.append(Connection(loop, target, self._lost))
            return made[-1]

        try:
            async with asyncio.timeout_at(at):  # the TLS handshake included
                if target.tls:
                    _, conn = await loop.create_connection(
                        factory,
                        target.host,
                        target.port,
                        ssl=self._tls(),
                        server_hostname=target.host,
                        ssl_shutdown_timeout=_TLS_SHUTDOWN_S,
                    )
                else:
                    _, conn = await loop.create_connection(factory, target.host, target.port)
        except BaseException as exc:
            # A timeout or cancellation landing just as the connection was made must not
            # leave it open and unowned.
            for made_conn in made:
                made_conn.close()
            if isinstance(exc, TimeoutError):
                raise UpstreamConnectError(f"connect to {where} timed out") from exc
            if isinstance(exc, ssl.SSLError):  # an OSError: told apart, it is a setup problem
                why = getattr(exc, "verify_message", None) or exc.reason or exc
                raise UpstreamTLSError(f"TLS handshake with {where} failed: {why}") from exc
            if isinstance(exc, OSError):
                raise UpstreamConnectError(f"connect to {where} failed: {exc}") from exc
            raise
        self._conns.add(conn)
        if self._closed:  # closed while connecting
            conn.close()
            raise UpstreamConnectError("UpstreamClient closed while connecting")
        return conn

    async def _exchange(
        self, conn: Connection, head: bytes, body: bytes, method: str, deadline: float
    ) -> UpstreamResponse:
        conn.send(head, body, method == "HEAD", self.read_timeout_s, deadline)
        while conn.state == HEAD and conn.exc is None:
            await conn.wait()
        if conn.exc is not None and conn.state == HEAD:
            conn.close()
            raise conn.exc
        assert conn.headers is not None
        return UpstreamResponse(self, conn, conn.status, conn.reason, conn.headers)

    def _release(self, conn: Connection) -> None:
        if conn.state != DONE or not conn.keep_alive or conn.closing or self._closed:
            conn.close()
            return
        idle = conn.target.idle
        if len(idle) >= self.max_idle_per_host:
            conn.close()
            return
        conn.park(self.idle_timeout_s)
        idle.append(conn)

    def _lost(self, conn: Connection) -> None:
        """Called by a connection once closed: forget it (and wake :meth:`close`)."""
        self._conns.discard(conn)
        if not self._conns and self._all_gone is not None and not self._all_gone.done():
            self._all_gone.set_result(None)


def _encode_headers(headers: Iterable[tuple[str, str]]) -> bytes:
    """``Name: value\\r\\n`` lines, each value the bytes it was received as (aiohttp decodes
    header bytes as UTF-8 with ``surrogateescape``; encoding the same way restores them, and
    costs what latin-1 does for ASCII). A line break inside a header is refused (it would let
    a header smuggle another one, or a second request), as is a value with no bytes (a
    surrogate aiohttp never makes)."""
    lines = [
        f"{k}: {v}\r\n"
        for k, v in headers
        if len(k) not in _RESERVED_LENGTHS or k.lower() not in _RESERVED
    ]
    text = "".join(lines)
    if text.count("\n") != len(lines) or text.count("\r") != len(lines):
        raise UpstreamRequestError("header names and values must not contain line breaks")
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError as exc:
        raise UpstreamRequestError(
            f"a header value holds {text[exc.start : exc.end]!r}, which has no bytes"
        ) from None

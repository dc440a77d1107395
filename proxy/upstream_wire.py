"""One upstream HTTP/1.1 connection: an ``asyncio.Protocol`` that parses responses as bytes
arrive, for :mod:`proxy.upstream`.

Role: write a request, parse the response head (``bytes.find`` over the received bytes), then
de-frame the body (``Content-Length``, chunked with extensions and trailers, or until close)
into pieces a consumer takes; keep the read, total and idle timeouts with one timer handle.

Invariants:
- ``state`` moves IDLE → HEAD → body state → DONE → IDLE (back in the pool) and never skips
  the parse: bytes arriving in IDLE or DONE (a server talking out of turn, a pipelined extra
  response) are dropped and the connection is marked not reusable;
- ``exc`` is set at most once per exchange, by the first failure (timeout, malformed bytes,
  loss of the connection); pieces that arrived before it are still handed out first;
- ``wait`` is the only suspension point; a cancelled wait closes the connection, so a
  half-read exchange can never be pooled;
- while more than ``HIGH_WATER`` bytes wait unread, reading is paused (and the read timeout
  does not run: the silence is ours);
- a line may end in a bare LF as well as in CRLF (RFC 9112 §2.2 lets a recipient accept it), in
  the head, chunk-size lines, chunk ends and trailers alike: such an answer is parsed as soon
  as it is in, never left waiting for a CRLF that will not come.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import cast

from multidict import CIMultiDict, CIMultiDictProxy

IDLE, HEAD, LENGTH, CHUNK_SIZE, CHUNK_DATA, CHUNK_CRLF, TRAILER, EOF, DONE = range(9)
HIGH_WATER = 1 << 20  # unread body bytes before reading pauses
_MAX_HEAD = 64 * 1024
_MAX_LINE = 8 * 1024  # a chunk-size line or a trailer line
_SLACK = 0.001  # timers may fire up to the loop's clock resolution early
_HEX = b"0123456789abcdefABCDEF"


class UpstreamConnectError(ConnectionError):
    """No response byte came back: refused, connect timeout, or closed or reset unanswered.
    The engine never answered, so the call is safe to retry on another replica."""


class UpstreamProtocolError(Exception):
    """A malformed response, or the connection lost after the response had begun."""


class UpstreamTLSError(UpstreamConnectError):
    """The TLS handshake failed (certificate not trusted, wrong host name, not a TLS server):
    nothing was sent, so it is as safe to retry as a refused connection, but it is a
    configuration problem rather than a dead engine."""


class UpstreamUnanswered(UpstreamProtocolError):
    """The connection closed after the request was written and before any response byte.
    The engine may have read the call (and died on it), so it must not be replayed elsewhere."""


class Target:
    """One upstream ``(scheme, host, port)``: its ``Host`` line, whether it speaks TLS, and its
    idle connections (LIFO)."""

    __slots__ = ("host", "host_line", "idle", "port", "tls")

    def __init__(self, host: str, port: int, host_line: bytes, tls: bool = False) -> None:
        self.host = host
        self.port = port
        self.host_line = host_line
        self.tls = tls
        self.idle: deque[Connection] = deque()


class Connection(asyncio.Protocol):
    """One keep-alive connection, carrying one exchange at a time."""

    __slots__ = (
        "body_done",
        "buffered",
        "closing",
        "deadline",
        "exc",
        "exchanges",
        "got_bytes",
        "headers",
        "idle_since",
        "idle_timeout",
        "is_head",
        "keep_alive",
        "last_rx",
        "loop",
        "on_lost",
        "paused",
        "pieces",
        "pooled",
        "read_timeout",
        "reason",
        "remaining",
        "rest",
        "state",
        "status",
        "target",
        "timer",
        "timer_at",
        "transport",
        "waiter",
    )

    def __init__(
        self, loop: asyncio.AbstractEventLoop, target: Target, on_lost: Callable[[Connection], None]
    ) -> None:
        self.loop = loop
        self.target = target
        self.on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self.state = IDLE
        self.exchanges = 0  # exchanges begun: a body reader of an older one must stop
        self.rest = b""  # received bytes not parsed yet (a partial head or framing line)
        self.pieces: list[bytes] = []
        self.buffered = 0
        self.paused = False
        self.body_done = False
        self.keep_alive = True
        self.closing = False
        self.pooled = False
        self.got_bytes = False
        self.is_head = False
        self.remaining = 0
        self.exc: BaseException | None = None
        self.status = 0
        self.reason = ""
        self.headers: CIMultiDictProxy[str] | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.timer_at = 0.0
        self.last_rx = 0.0
        self.deadline = 0.0
        self.read_timeout = 0.0
        self.idle_since = 0.0
        self.idle_timeout = 0.0

    # -- the consumer's side -------------------------------------------------------------

    def send(
        self, head: bytes, body: bytes, is_head: bool, read_timeout: float, deadline: float
    ) -> None:
        """Start an exchange: write the request and arm the read/total timeout."""
        transport = self.transport
        if self.closing or transport is None or transport.is_closing():
            self.close()
            raise UpstreamConnectError("connection closed before the request was sent")
        self.state = HEAD
        self.exchanges += 1
        self.body_done = False
        self.keep_alive = True
        self.got_bytes = False
        self.is_head = is_head
        self.exc = None
        self.headers = None
        if len(body) <= 65536:
            transport.write(head + body)  # one segment for the usual small JSON call
        else:
            transport.write(head)
            transport.write(body)
        now = self.loop.time()
        self.last_rx = now
        self.read_timeout = read_timeout
        self.deadline = deadline
        self._arm(min(now + read_timeout, deadline))

    async def wait(self) -> None:
        """Until the protocol has news (bytes, end, failure); cancellation closes."""
        fut = self.loop.create_future()
        self.waiter = fut
        try:
            await fut
        except asyncio.CancelledError:
            self.waiter = None
            self.close()
            raise

    def take(self) -> bytes:
        """Every piece received and not yet taken, as one bytes object."""
        pieces = self.pieces
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        pieces.clear()
        self.buffered = 0
        if self.paused:
            self.paused = False
            self.last_rx = self.loop.time()
            if self.transport is not None:
                self.transport.resume_reading()
        return data

    def park(self, idle_timeout: float) -> None:
        """Back in the pool after a complete exchange."""
        self.state = IDLE
        self.pieces.clear()
        self.buffered = 0
        self.pooled = True
        now = self.loop.time()
        self.idle_since = now
        self.idle_timeout = idle_timeout
        self._arm(now + idle_timeout)

    def close(self) -> None:
        """Close now (idempotent); an unfinished exchange fails with a protocol error."""
        if self.pooled:
            self.pooled = False
            self.target.idle.remove(self)
        if self.closing:
            return
        self.closing = True
        self.keep_alive = False
        if self.exc is None and self.state not in (IDLE, DONE):
            self.exc = UpstreamProtocolError("upstream connection closed by the proxy")
        if self.transport is not None:
            self.transport.close()

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, but have its methods.
        self.transport = cast(asyncio.Transport, transport)
        if self.closing:  # closed by a connect that was cancelled meanwhile
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.closing = True
        if self.pooled:
            self.pooled = False
            self.target.idle.remove(self)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        state = self.state
        err: BaseException | None = None
        if state == HEAD:
            why = f": {exc}" if exc else ""
            if self.got_bytes:
                err = UpstreamProtocolError(f"upstream connection lost in the response head{why}")
            else:
                err = UpstreamUnanswered(f"upstream closed the connection unanswered{why}")
        elif state == EOF and exc is None and self.exc is None:
            self._finish()  # a body without length ends with its connection (not ours)
        elif state not in (IDLE, DONE):
            why = f": {exc}" if exc else ""
            err = UpstreamProtocolError(f"upstream connection lost mid-response{why}")
        if err is not None and self.exc is None:
            self.exc = err
        self._wake()
        self.on_lost(self)

    def data_received(self, data: bytes) -> None:
        state = self.state
        if state == IDLE or state == DONE or self.closing:
            # Out of turn: never parse it into an exchange; this connection is done for.
            self.keep_alive = False
            if state == IDLE:
                self.close()
            return
        self.last_rx = self.loop.time()
        self.got_bytes = True
        if self.rest:
            data = self.rest + data
            self.rest = b""
        try:
            self._feed(data)
        except (UpstreamProtocolError, ValueError) as exc:
            self._fail(
                exc if isinstance(exc, UpstreamProtocolError) else UpstreamProtocolError(str(exc))
            )
            return
        if self.state != HEAD:
            self._wake()

    # -- parsing -------------------------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        """Parse ``data``; the body bytes it holds become one piece (pushed even when a
        parse error follows them)."""
        out: list[bytes] = []
        try:
            self._parse(data, out)
        finally:
            if out:
                self._push(out[0] if len(out) == 1 else b"".join(out))

    def _parse(self, data: bytes, out: list[bytes]) -> None:
        pos = 0
        n = len(data)
        while pos < n:
            state = self.state
            if state == CHUNK_SIZE:
                eol = data.find(b"\n", pos)
                if eol < 0:
                    return self._keep(data, pos, _MAX_LINE, "chunk-size line")
                line = data[pos : eol - 1 if eol > pos and data[eol - 1] == 13 else eol]
                if not line or line.lstrip(_HEX):  # extensions, blanks or garbage
                    line = line.split(b";", 1)[0].strip(b" \t")  # extensions: ignored
                    if not line or line.lstrip(_HEX):
                        raise UpstreamProtocolError(f"malformed chunk size {data[pos:eol][:40]!r}")
                size = int(line, 16)
                pos = eol + 1
                if not size:
                    self.state = TRAILER
                    continue
                end = pos + size
                if end + 2 <= n:  # the whole chunk is here (an SSE event, usually)
                    if data[end : end + 2] == b"\r\n":
                        out.append(data[pos:end])
                        pos = end + 2
                        continue
                    if data[end] != 10:
                        raise UpstreamProtocolError("chunk data not followed by CRLF")
                    out.append(data[pos:end])
                    pos = end + 1
                else:
                    self.remaining = size
                    self.state = CHUNK_DATA
            elif state == LENGTH or state == CHUNK_DATA:
                left = n - pos
                take = self.remaining if self.remaining < left else left
                out.append(data if take == n else data[pos : pos + take])
                pos += take
                self.remaining -= take
                if not self.remaining:
                    if state == LENGTH:
                        self._finish()
                    else:
                        self.state = CHUNK_CRLF
            elif state == CHUNK_CRLF:
                if data[pos] == 10:  # a bare LF
                    pos += 1
                    self.state = CHUNK_SIZE
                    continue
                if n - pos < 2:
                    return self._keep(data, pos, 2, "chunk end")
                if data[pos : pos + 2] != b"\r\n":
                    raise UpstreamProtocolError("chunk data not followed by CRLF")
                pos += 2
                self.state = CHUNK_SIZE
            elif state == HEAD:
                # The head ends at its first empty line: "\n\r\n" (the tail of "\r\n\r\n"),
                # or "\n\n" where lines end in bare LFs.
                end = data.find(b"\n\r\n", pos)
                bare = data.find(b"\n\n", pos, end if end >= 0 else n)
                if bare >= 0:
                    self._parse_head(data[pos:bare])
                    pos = bare + 2
                    continue
                if end < 0:
                    return self._keep(data, pos, _MAX_HEAD, "response head")
                self._parse_head(data[pos:end])
                pos = end + 3
            elif state == TRAILER:
                eol = data.find(b"\n", pos)
                if eol < 0:
                    return self._keep(data, pos, _MAX_LINE, "trailer line")
                if eol == pos or (eol == pos + 1 and data[pos] == 13):
                    self._finish()
                pos = eol + 1  # a trailer field: dropped (engines send none)
            elif state == EOF:
                out.append(data if pos == 0 else data[pos:])
                return
            else:  # DONE: bytes after the response (a pipelined extra): not ours to parse
                self.keep_alive = False
                return
        return

    def _keep(self, data: bytes, pos: int, limit: int, what: str) -> None:
        if n_left := len(data) - pos:
            if n_left > limit:
                raise UpstreamProtocolError(f"{what} longer than {limit} bytes")
            self.rest = data[pos:] if pos else data

    def _parse_head(self, head: bytes) -> None:
        text = head.decode("latin-1")
        if text.endswith("\r"):
            text = text[:-1]
        lines = text.split("\r\n")
        if len(lines) - 1 != text.count("\n"):  # some lines end in a bare LF
            lines = [line.removesuffix("\r") for line in text.split("\n")]
        parts = lines[0].split(" ", 2)
        version = parts[0]
        if (
            len(parts) < 2
            or version not in ("HTTP/1.1", "HTTP/1.0")
            or len(parts[1]) != 3
            or not parts[1].isdecimal()
        ):
            raise UpstreamProtocolError(f"malformed status line {lines[0][:100]!r}")
        status = int(parts[1])
        if status < 200:
            if status < 100 or status == 101:
                raise UpstreamProtocolError(f"unexpected status {status}")
            return  # interim (100 Continue, 103 Early Hints): the final head follows
        fields: list[tuple[str, str]] = []
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not name or name[0] in " \t" or name[-1] in " \t":
                raise UpstreamProtocolError(f"malformed header line {line[:100]!r}")
            fields.append((name, value.strip(" \t")))
        headers = CIMultiDictProxy(CIMultiDict(fields))
        self.status = status
        self.reason = parts[2] if len(parts) > 2 else ""
        self.headers = headers
        keep = version == "HTTP/1.1"
        connection = headers.get("Connection")
        if connection is not None:
            tokens = connection.lower()
            if "close" in tokens:
                keep = False
            elif "keep-alive" in tokens:
                keep = True
        self.keep_alive = keep
        lengths = headers.getall("Content-Length", [])
        te = headers.get("Transfer-Encoding")
        if self.is_head or status == 204 or status == 304:
            self._finish()
        elif te is not None:
            if lengths:  # both framings: trust chunked, but never reuse this connection
                self.keep_alive = False
            if te.lower().rstrip(" \t").endswith("chunked"):
                self.state = CHUNK_SIZE
            else:
                self.state = EOF
                self.keep_alive = False
        elif lengths:
            value = lengths[0]
            if any(v != value for v in lengths) or not value.isdecimal():
                raise UpstreamProtocolError(f"bad Content-Length {lengths!r}")
            self.remaining = int(value)
            self.state = LENGTH
            if not self.remaining:
                self._finish()
        else:
            self.state = EOF
            self.keep_alive = False

    def _push(self, piece: bytes) -> None:
        self.pieces.append(piece)
        self.buffered += len(piece)
        if self.buffered > HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def _finish(self) -> None:
        self.state = DONE
        self.body_done = True

    # -- waking and timing ---------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self.exc is None:
            self.exc = exc
        self.close()
        self._wake()

    def _arm(self, at: float) -> None:
        """Make sure the timer fires no later than ``at`` (an earlier firing re-arms)."""
        if self.timer is not None:
            if self.timer_at <= at:
                return
            self.timer.cancel()
        self.timer_at = at
        self.timer = self.loop.call_at(at, self._on_timer)

    def _on_timer(self) -> None:
        self.timer = None
        if self.closing:
            return
        now = self.loop.time() + _SLACK
        state = self.state
        if state == IDLE:
            due = self.idle_since + self.idle_timeout
            if now >= due:
                self.close()
                return
        elif state == DONE:
            return  # the body is in; a slow consumer is not a slow upstream
        else:
            if self.paused:
                self.last_rx = now  # reading is paused by us: the silence is ours
            due = min(self.last_rx + self.read_timeout, self.deadline)
            if now >= due:
                what = "total" if due == self.deadline else "read"
                self._fail(TimeoutError(f"upstream {what} timeout"))
                return
        self.timer_at = due
        self.timer = self.loop.call_at(due, self._on_timer)

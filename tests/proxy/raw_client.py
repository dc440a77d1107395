"""A raw-socket HTTP/1.1 client for tests that send what no client library would (any bytes in
a path or header, a broken request line, half a request), and an OpenAI error-shape check."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

import orjson


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> Any:
        return orjson.loads(self.body)


def request_bytes(
    method: str, path: bytes, body: bytes = b"", headers: list[tuple[bytes, bytes]] | None = None
) -> bytes:
    lines = [b"%s %s HTTP/1.1" % (method.encode(), path), b"Host: 127.0.0.1", b"Connection: close"]
    if method != "GET" or body:
        lines += [b"Content-Type: application/json", b"Content-Length: %d" % len(body)]
    lines += [b"%s: %s" % (k, v) for k, v in headers or []]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def exchange(port: int, data: bytes, timeout: float = 10.0) -> RawResponse:
    """Send ``data``, read the answer until the proxy closes (every request says close)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = _dechunk(body)
    return RawResponse(status, headers, body)


def _dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if not size:
            break
        out += data[:size]
        data = data[size + 2 :]
    return out


def assert_openai_error(resp: RawResponse, status: int | None = None) -> dict[str, Any]:
    """``resp`` is an OpenAI-shaped JSON error (of ``status`` if given); its ``error``."""
    assert status is None or resp.status == status, (resp.status, resp.body[:300])
    assert resp.headers.get("content-type", "").startswith("application/json"), resp.headers
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and isinstance(err["code"], str)
    return dict(err)

"""Loopback ports for processes this machine starts (engines, proxies, test servers).

Invariant: the port was free when asked; a caller that binds it later can still lose a race,
so callers that start a process retry or report the bind failure themselves.
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port the kernel just handed out on ``host`` and released."""
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port

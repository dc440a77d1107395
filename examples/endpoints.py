"""Where the example agents send each model's calls, and how they tag a workflow request.

Role: one ``AsyncOpenAI`` client per distinct base URL (all models behind one proxy share one;
emulated engines on separate ports get their own), and ``tagged`` to derive a per-request client
carrying ``X-Scepsy-Workflow`` and a fresh ``X-Scepsy-Request-Id``, as a user would with the
plain ``openai`` SDK. No imports of the Scepsy packages.
"""

from __future__ import annotations

import argparse
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from openai import AsyncOpenAI

WORKFLOW_HEADER = "X-Scepsy-Workflow"
REQUEST_HEADER = "X-Scepsy-Request-Id"


@dataclass
class Endpoints:
    """``base_url`` for every model unless ``model_urls`` names another one."""

    base_url: str
    model_urls: Mapping[str, str] = field(default_factory=dict)
    api_key: str = "EMPTY"
    timeout_s: float = 600.0
    max_retries: int = 2
    _clients: dict[str, AsyncOpenAI] = field(default_factory=dict)

    def client(self, model: str) -> AsyncOpenAI:
        url = self.model_urls.get(model, self.base_url)
        if url not in self._clients:
            self._clients[url] = AsyncOpenAI(
                base_url=url,
                api_key=self.api_key,
                timeout=self.timeout_s,
                max_retries=self.max_retries,
            )
        return self._clients[url]

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()
        self._clients.clear()


def new_request_id() -> str:
    return uuid.uuid4().hex


def tagged(client: AsyncOpenAI, workflow: str, request_id: str) -> AsyncOpenAI:
    """A client whose every call says which workflow request it belongs to."""
    return client.with_options(
        default_headers={WORKFLOW_HEADER: workflow, REQUEST_HEADER: request_id}
    )


def add_endpoint_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--base-url",
        default="http://127.0.0.1:8080/v1",
        help="OpenAI-compatible base URL for every model (the Scepsy proxy)",
    )
    p.add_argument(
        "--model-url",
        action="append",
        default=[],
        metavar="MODEL=URL",
        help="a different base URL for one model (repeatable)",
    )
    p.add_argument("--api-key", default="EMPTY", help="API key sent as a bearer token")


def endpoints_from(args: argparse.Namespace) -> Endpoints:
    return Endpoints(args.base_url, parse_model_urls(args.model_url), api_key=args.api_key)


def parse_model_urls(items: Sequence[str]) -> dict[str, str]:
    out = {}
    for item in items:
        model, sep, url = item.partition("=")
        if not sep or not model or not url:
            raise SystemExit(f"--model-url expects MODEL=URL, got {item!r}")
        out[model] = url
    return out

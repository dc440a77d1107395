"""Workflow identity (DESIGN §3.1): every source, its precedence, and what goes upstream."""

from __future__ import annotations

import aiohttp
import pytest

from proxy.identity import SESSION_HEADERS, identify, normalise, trace_id
from proxy.routes import RoutedPath, Routes
from tests.proxy.conftest import ProxyHandle
from tests.proxy.fake_engine import FakeEngine

TP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
CHAT = RoutedPath("/v1/chat/completions", None, None)
ROUTES = Routes()


def test_headers_win_over_everything() -> None:
    ident = identify(
        ROUTES.resolve("/w/pathwf/r/pathid/v1/chat/completions"),
        {
            "X-Scepsy-Workflow": "hw",
            "X-Scepsy-Request-Id": "hid",
            "x-session-id": "s",
            "traceparent": TP,
        },
        {"vllm_xargs": {"agentic_context": "ctx"}},
        "default",
    )
    assert (ident.workflow, ident.request_id, ident.source) == ("hw", "hid", "header")
    assert ident.upstream_path == CHAT.route


def test_path_prefix() -> None:
    ident = identify(ROUTES.resolve("/w/beam/r/42/v1/chat/completions"), {}, {}, "default")
    assert (ident.workflow, ident.request_id, ident.source) == ("beam", "42", "path")
    assert ROUTES.resolve("/w/rag/v1/embeddings") == RoutedPath("/v1/embeddings", "rag", None)
    assert ROUTES.resolve("/v1/embeddings") == RoutedPath("/v1/embeddings", None, None)


def test_identity_values_are_valid_utf8_and_bounded() -> None:
    ident = identify(
        CHAT, {"X-Scepsy-Workflow": "w\udcff" + "x" * 999, "x-session-id": "é" * 300}, {}, None
    )
    assert ident.workflow == "w\ufffd" + "x" * 254
    assert ident.request_id == "é" * 256
    assert identify(CHAT, {"X-Scepsy-Request-Id": "a" * 40}, {}, None, max_chars=16).request_id == (
        "a" * 16
    )
    assert normalise("") is None and normalise("plain") == "plain"


def test_default_workflow_and_no_request_id() -> None:
    ident = identify(CHAT, {}, {}, "sidecar")
    assert (ident.workflow, ident.request_id, ident.source) == ("sidecar", None, "none")
    assert identify(CHAT, {}, {}, None).workflow is None


@pytest.mark.parametrize("header", SESSION_HEADERS)
def test_each_session_header(header: str) -> None:
    ident = identify(CHAT, {header: "sess-1", "traceparent": TP}, {}, None)
    assert (ident.request_id, ident.source) == ("sess-1", header.lower())


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"vllm_xargs": {"agentic_context": "root-7"}}, "root-7"),
        ({"vllm_xargs": {"agentic_context": {"root_id": "root-8", "parent": "x"}}}, "root-8"),
        ({"metadata": {"litellm_session_id": "ll-1"}}, "ll-1"),
        ({"litellm_session_id": "ll-2"}, "ll-2"),
    ],
)
def test_body_session_fields(body: dict[str, object], expected: str) -> None:
    assert identify(CHAT, {"traceparent": TP}, body, None).request_id == expected


def test_traceparent_trace_id() -> None:
    assert (
        identify(CHAT, {"traceparent": TP}, {}, None).request_id
        == "4bf92f3577b34da6a3ce929d0e0e4736"
    )
    assert trace_id("00-" + "0" * 32 + "-00f067aa0ba902b7-01") is None
    assert trace_id("garbage") is None


async def test_identity_reaches_the_store_and_private_headers_stay_home(
    proxy: ProxyHandle, engine: FakeEngine
) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    async with aiohttp.ClientSession() as s:
        for path, headers in [
            ("/w/beam/r/r1/v1/chat/completions", {}),
            ("/w/beam/v1/chat/completions", {"Helicone-Session-Id": "h1"}),
            ("/v1/chat/completions", {"traceparent": TP, "X-Scepsy-Workflow": "rag"}),
            ("/v1/chat/completions", {}),
        ]:
            async with s.post(proxy.url + path, json=body, headers=headers) as r:
                assert r.status == 200, await r.text()
    assert [c.path for c in engine.calls] == [CHAT.route] * 4
    assert engine.calls[2].headers["traceparent"] == TP
    assert all("X-Scepsy-Workflow" not in c.headers for c in engine.calls)
    recs = await proxy.records()
    assert [(r["workflow"], r["request_id"]) for r in recs] == [
        ("beam", "r1"),
        ("beam", "h1"),
        ("rag", "4bf92f3577b34da6a3ce929d0e0e4736"),
        ("wf0", None),
    ]

"""The project's own hostile-input suite (issue 22): generated bodies, headers, paths and
identity values thrown at a real proxy on loopback, mixed with valid calls.

Invariants checked after every exchange and at the end:
- no client input gets a 5xx; every 4xx is an OpenAI-shaped error with a JSON content type;
- every valid call is answered 200 and is in the store once the recorder has flushed (each
  valid call carries its own ``Idempotency-Key``, which becomes its ``call_id``);
- the recorder refused nothing, and ``/metrics`` answers 200 and stays under a size bound
  however many distinct workflow names the clients invent.

Requests go out on raw sockets (any bytes in a path or header); hypothesis runs in a thread
next to the proxy's loop, with bounded examples so the suite takes seconds.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any
from urllib.parse import quote

import aiohttp
import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.keys import RECORDER
from tests.proxy.conftest import ProxyHandle
from tests.proxy.fake_engine import FakeEngine
from tests.proxy.raw_client import RawResponse, assert_openai_error, exchange, request_bytes

METRICS_BOUND = 256 * 1024  # bytes of /metrics, whatever the clients did
_ids = itertools.count()

# -- what a hostile client sends -------------------------------------------------------------

_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)  # what orjson writes
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
_FIELDS = (
    "model",
    "messages",
    "stream",
    "stream_options",
    "prompt",
    "input",
    "vllm_xargs",
    "metadata",
    "litellm_session_id",
    "max_tokens",
    "api_key",
    "refresh_token",
)


def _with_field(field: str, value: Any) -> bytes:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    body[field] = value
    return orjson.dumps(body)


def _deep(levels: int) -> bytes:
    return b'{"model": "m", "messages": [], "x": ' + b"[" * levels + b"]" * levels + b"}"


_bodies = st.one_of(
    st.binary(max_size=64),
    _json.map(lambda v: orjson.dumps(v)),
    st.tuples(st.sampled_from(_FIELDS), _json).map(lambda fv: _with_field(*fv)),
    st.integers(150, 1020).map(_deep),
    st.just(b'{"model": "m", "stream": true, "stream_options": [1], "messages": []}'),
)
# Paths: route-ish segments, separators and escapes in every place.
_segment = st.one_of(
    st.sampled_from(
        [
            "v1",
            "chat",
            "completions",
            "w",
            "r",
            "..",
            ".",
            "",
            "%2F",
            "%2f",
            "%2E%2E",
            "%20",
            "%ff",
            "%00",
            "admin",
            "load_lora_adapter",
            "embeddings",
            "a%2Fb",
            "x?y=1",
            "%",
        ]
    ),
    st.text(
        st.characters(min_codepoint=33, max_codepoint=126, exclude_characters="?#"), max_size=6
    ),
)
_paths = st.lists(_segment, min_size=1, max_size=7).map(
    lambda segs: ("/" + "/".join(segs)).encode()
)
_HEADER_NAMES = (
    "X-Scepsy-Workflow",
    "X-Scepsy-Request-Id",
    "x-session-id",
    "Idempotency-Key",
    "traceparent",
    "x-stainless-retry-count",
    "Helicone-Session-Id",
    "Content-Type",
)
_header_values = st.one_of(
    st.binary(max_size=300).filter(lambda b: b"\r" not in b and b"\n" not in b),
    st.text(max_size=300)
    .map(lambda s: s.encode("utf-8", "surrogatepass"))
    .filter(lambda b: b"\r" not in b and b"\n" not in b),
)
# Identity values as clients might send them: any text but controls (refused: a 400 in a
# header, a 404 in a path) and the names `.` and `..` (refused in a path), up to 400 characters.
_identity = st.text(
    st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=400
).filter(lambda v: v.strip(" \t") not in ("", ".", ".."))


def _valid(where: str, workflow: str, rid: str) -> tuple[bytes, list[tuple[bytes, bytes]], str]:
    """A valid chat call naming ``workflow``/``rid`` in the path or in headers; its call id."""
    call_id = f"valid-{next(_ids)}"
    headers = [(b"Idempotency-Key", call_id.encode())]
    if where == "path":
        # A / or \ cannot be in a path segment (escaped, it is refused: 404); the header can.
        workflow, rid = workflow.replace("/", "_").replace("\\", "_"), rid.replace("/", "_")
        rid = rid.replace("\\", "_")
        path = f"/w/{quote(workflow, safe='')}/r/{quote(rid, safe='')}/v1/chat/completions"
    else:
        path = "/v1/chat/completions"
        headers += [
            (b"X-Scepsy-Workflow", workflow.encode()),
            (b"X-Scepsy-Request-Id", rid.encode()),
        ]
    return path.encode(), headers, call_id


CHAT = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
_ops = st.one_of(
    st.tuples(st.just("valid"), st.sampled_from(["path", "header"]), _identity, _identity),
    st.tuples(st.just("body"), _bodies),
    st.tuples(st.just("path"), _paths),
    st.tuples(st.just("header"), st.sampled_from(_HEADER_NAMES), _header_values),
)


def _check(resp: RawResponse, what: object) -> None:
    assert resp.status < 500, (what, resp.status, resp.body[:300])
    if resp.status >= 400:
        assert_openai_error(resp)


async def test_hostile_input_mixed_with_valid_calls(proxy: ProxyHandle, engine: FakeEngine) -> None:
    valid: list[str] = []
    port = proxy.port

    @settings(
        max_examples=200,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(ops=st.lists(_ops, min_size=1, max_size=6))
    def prop(ops: list[tuple[Any, ...]]) -> None:
        for op in ops:
            kind = op[0]
            if kind == "valid":
                path, headers, call_id = _valid(op[1], op[2], op[3])
                resp = exchange(port, request_bytes("POST", path, CHAT, headers))
                assert resp.status == 200, (op, resp.body[:300])
                valid.append(call_id)
            elif kind == "body":
                resp = exchange(port, request_bytes("POST", b"/v1/chat/completions", op[1]))
                _check(resp, op)
            elif kind == "path":
                resp = exchange(port, request_bytes("POST", op[1], CHAT))
                _check(resp, op)
            else:
                headers = [(op[1].encode(), op[2])]
                resp = exchange(port, request_bytes("POST", b"/v1/chat/completions", CHAT, headers))
                _check(resp, op)

    await asyncio.to_thread(prop)
    assert len(valid) >= 50, len(valid)  # the mix really held valid calls
    recs = await proxy.records()
    assert proxy.app[RECORDER].write_errors == 0 and proxy.app[RECORDER].dropped == 0
    stored = {r["call_id"] for r in recs}
    assert set(valid) <= stored, set(valid) - stored
    for rec in recs:  # identity as stored: bounded (proxy.identity_max_chars)
        assert all(len(rec[k] or "") <= 256 for k in ("workflow", "request_id", "call_id"))
    async with aiohttp.ClientSession() as s, s.get(f"{proxy.url}/metrics") as r:
        assert r.status == 200 and len(await r.read()) < METRICS_BOUND


async def test_metrics_stay_bounded_under_many_workflow_names(proxy: ProxyHandle) -> None:
    """1,500 distinct long workflow names: /metrics keeps at most ``metrics_max_workflows``
    (50) of them, plus the default and ``other``, and stops growing once those are taken."""
    sizes: list[int] = []
    async with aiohttp.ClientSession() as s:

        async def one(i: int) -> None:
            headers = {"X-Scepsy-Workflow": f"wf-{i}-" + "x" * 200}
            async with s.post(f"{proxy.url}/v1/chat/completions", data=CHAT, headers=headers) as r:
                assert r.status == 200

        for start in range(0, 1500, 100):
            await asyncio.gather(*(one(i) for i in range(start, start + 100)))
            if start in (500, 1400):
                async with s.get(f"{proxy.url}/metrics") as r:
                    assert r.status == 200
                    text = (await r.read()).decode()
                    sizes.append(len(text))
    labels = {
        line.split('workflow="', 1)[1].split('"', 1)[0]
        for line in text.splitlines()
        if 'workflow="' in line
    }
    assert len(labels) <= 52 and "other" in labels, len(labels)
    assert sizes[1] <= sizes[0] * 1.02, sizes  # 900 more names, (almost) no more bytes
    assert len(await proxy.records()) == 1500

"""Prefill-only routes of the emulator: embeddings, rerank, score and pooling.

Role: answer vLLM's pooling-style APIs with deterministic vectors and relevance scores
(``sim.vectors``) after running every input through the engine core as a prefill-only request
(``output_tokens=0``), so their latency follows the same performance model as generation.

Which model kind serves what (as vLLM's tasks do): ``embed`` serves ``/v1/embeddings``,
``/pooling`` and ``/score`` (cosine similarity); ``rerank`` serves ``/rerank`` (all three
paths), ``/score`` and ``/pooling``; ``generate`` serves ``/score`` and ``/pooling`` as
prefill-only calls (pooling answers a process-reward pair ``[P("-"), P("+")]``).

Invariants: results are pure functions of (texts, model, emulator seed); rerank results are
sorted by ``relevance_score`` descending, ties by index, and cut to ``top_n`` when positive.
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

import numpy as np
from aiohttp import web

from sim.serving import (
    ApiError,
    EmulatedEngine,
    created,
    engine_of,
    get_int,
    get_texts,
    json_response,
    new_id,
    read_body,
)
from sim.text import BOS, prm_probability, render_chat, token_ids
from sim.vectors import cosine, embed, relevance

_SEP = "</s></s>"  # cross-encoders see "query </s></s> document"


def _inputs(body: Mapping[str, Any]) -> list[str]:
    """``input`` (text, texts, token ids, lists of token ids) or chat ``messages``."""
    if "messages" in body and body.get("input") is None:
        messages = body["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
            raise ApiError("messages must be a list of objects", param="messages")
        return [render_chat(messages, add_generation_prompt=False)]
    value = body.get("input")
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return [" ".join(map(str, value))]
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        return [" ".join(map(str, v)) for v in value]
    return get_texts(value, "input")


def _usage(tokens: int) -> dict[str, int]:
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}


def _vector(engine: EmulatedEngine, text: str, dims: int | None) -> list[float]:
    vec = embed(text, engine.spec.hidden, seed=engine.config.seed)
    if dims is not None and dims < len(vec):  # Matryoshka-style truncation, renormalised
        vec = vec[:dims] / np.float32(np.linalg.norm(vec[:dims]) or 1.0)
    return [float(x) for x in vec]


async def embeddings(request: web.Request) -> web.Response:
    engine = engine_of(request)
    body = await read_body(request)
    engine.check_model(body)
    engine.check_kind("embed", route="/v1/embeddings")
    texts = _inputs(body)
    dims = get_int(body, "dimensions", None, lo=1)
    fmt = body.get("encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise ApiError("encoding_format must be 'float' or 'base64'", param="encoding_format")
    tokens = await _prefill(engine, texts)
    data = []
    for i, text in enumerate(texts):
        vec = _vector(engine, text, dims)
        encoded: Any = vec
        if fmt == "base64":
            encoded = base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode()
        data.append({"index": i, "object": "embedding", "embedding": encoded})
    return json_response(
        {
            "id": new_id("embd"),
            "object": "list",
            "created": created(),
            "model": engine.name,
            "data": data,
            "usage": _usage(tokens),
        }
    )


async def _prefill(engine: EmulatedEngine, texts: list[str]) -> int:
    prompts = [token_ids(BOS + t) for t in texts]
    for p in prompts:
        engine.check_context(len(p))
    return await engine.prefill(prompts)


def _pair_score(engine: EmulatedEngine, a: str, b: str) -> float:
    seed = engine.config.seed
    if engine.spec.kind == "embed":
        return cosine(a, b, engine.spec.hidden, seed=seed)
    return relevance(a, b, seed=seed)


async def rerank(request: web.Request) -> web.Response:
    engine = engine_of(request)
    body = await read_body(request)
    engine.check_model(body)
    engine.check_kind("rerank", route="/rerank")
    query = body.get("query")
    if not isinstance(query, str):
        raise ApiError("query must be a string", param="query")
    docs = get_texts(body.get("documents"), "documents")
    top_n = get_int(body, "top_n", 0, lo=0) or len(docs)
    tokens = await _prefill(engine, [f"{query}{_SEP}{d}" for d in docs])
    scored = sorted(
        ((_pair_score(engine, query, d), i) for i, d in enumerate(docs)),
        key=lambda si: (-si[0], si[1]),
    )
    with_docs = body.get("return_documents", True) is not False
    results = []
    for score, i in scored[:top_n]:
        item: dict[str, Any] = {"index": i, "relevance_score": score}
        if with_docs:
            item["document"] = {"text": docs[i]}
        results.append(item)
    return json_response(
        {
            "id": new_id("rerank"),
            "model": engine.name,
            "usage": {"total_tokens": tokens},
            "results": results,
        }
    )


def _pairs(body: Mapping[str, Any]) -> list[tuple[str, str]]:
    left, right = body.get("text_1", body.get("queries")), body.get("text_2", body.get("documents"))
    a, b = get_texts(left, "text_1"), get_texts(right, "text_2")
    if isinstance(left, str) or len(a) == 1:
        return [(a[0], d) for d in b]
    if len(a) != len(b):
        raise ApiError(
            "text_1 and text_2 must have the same length when both are lists", param="text_2"
        )
    return list(zip(a, b, strict=True))


async def score(request: web.Request) -> web.Response:
    engine = engine_of(request)
    body = await read_body(request)
    engine.check_model(body)
    pairs = _pairs(body)
    if engine.spec.kind == "embed":  # bi-encoder: each text is embedded on its own
        tokens = await _prefill(engine, [t for pair in pairs for t in pair])
    else:
        tokens = await _prefill(engine, [f"{a}{_SEP}{b}" for a, b in pairs])
    data = [
        {"index": i, "object": "score", "score": _pair_score(engine, a, b)}
        for i, (a, b) in enumerate(pairs)
    ]
    return json_response(
        {
            "id": new_id("score"),
            "object": "list",
            "created": created(),
            "model": engine.name,
            "data": data,
            "usage": _usage(tokens),
        }
    )


async def pooling(request: web.Request) -> web.Response:
    engine = engine_of(request)
    body = await read_body(request)
    engine.check_model(body)
    texts = _inputs(body)
    tokens = await _prefill(engine, texts)
    seed = engine.config.seed
    data = []
    for i, text in enumerate(texts):
        if engine.spec.kind == "embed":
            out: list[float] = _vector(engine, text, None)
        elif engine.spec.kind == "rerank":
            query, _, doc = text.partition(_SEP)  # a pair if the caller joined one
            out = [relevance(query, doc or query, seed=seed)]
        else:
            p_plus = prm_probability(text, seed=seed)
            out = [1.0 - p_plus, p_plus]
        data.append({"index": i, "object": "pooling", "data": out})
    return json_response(
        {
            "id": new_id("pool"),
            "object": "list",
            "created": created(),
            "model": engine.name,
            "data": data,
            "usage": _usage(tokens),
        }
    )

"""Retrieval-augmented generation with a reranker (after FlashRAG).

Role: an agent app as a user writes it, with the plain ``openai`` SDK: embed the question
(e5 style, ``"query: "`` prefix), search a local passage index with numpy (top 20 by cosine),
rerank those 20 with a cross-encoder (``POST /rerank``, top 5), then answer with a chat model
from the 5 passages (``max_tokens=32``, greedy). Every call of one question carries
``X-Scepsy-Workflow: rag`` and one fresh request id.

    python -m examples.rag_rerank --base-url http://127.0.0.1:8080/v1 [--question "..."]

Invariants: per request exactly one embedding, one rerank and one chat call, in that order;
the index is built once (calls tagged ``rag-index``) and is not part of any request.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from examples.endpoints import (
    Endpoints,
    add_endpoint_args,
    endpoints_from,
    new_request_id,
    tagged,
)
from examples.passages import passages, questions

WORKFLOW = "rag"
SYSTEM_PROMPT = (
    "Answer the question based on the given documents. Only give me the answer and do not "
    "output any other words.\n\nThe following are given documents.\n\n"
)


@dataclass(frozen=True)
class RagConfig:
    """FlashRAG's published setting (workloads.md)."""

    embedder: str = "e5-base-v2"
    reranker: str = "bge-reranker-base"
    generator: str = "llama-3-8b"
    retrieve: int = 20
    keep: int = 5
    max_tokens: int = 32


@dataclass(frozen=True)
class RagResult:
    request_id: str
    answer: str
    passages: list[int]  # indices of the passages given to the generator, best first
    latency_s: float


class PassageIndex:
    """Unit-normalised passage embeddings; search is one matrix-vector product."""

    def __init__(self, texts: list[str], vectors: npt.NDArray[np.float32]) -> None:
        self.texts = texts
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        self.vectors = vectors / np.where(norms == 0, 1, norms)

    def search(self, query: npt.NDArray[np.float32], k: int) -> list[int]:
        scores = self.vectors @ (query / (np.linalg.norm(query) or 1.0))
        k = min(k, len(self.texts))
        top = np.argpartition(-scores, k - 1)[:k]
        return [int(i) for i in top[np.argsort(-scores[top])]]


async def build_index(
    endpoints: Endpoints, cfg: RagConfig, texts: list[str], *, batch: int = 256
) -> PassageIndex:
    """Embed every passage (``"passage: "`` prefix, as e5 expects)."""
    client = tagged(endpoints.client(cfg.embedder), "rag-index", new_request_id())
    parts: list[list[float]] = []
    for start in range(0, len(texts), batch):
        chunk = [f"passage: {t}" for t in texts[start : start + batch]]
        resp = await client.embeddings.create(model=cfg.embedder, input=chunk)
        parts.extend(d.embedding for d in sorted(resp.data, key=lambda d: d.index))
    return PassageIndex(texts, np.asarray(parts, dtype=np.float32))


async def answer(
    endpoints: Endpoints,
    index: PassageIndex,
    question: str,
    cfg: RagConfig = RagConfig(),
    *,
    request_id: str | None = None,
) -> RagResult:
    """Run one RAG workflow request: embed, search, rerank, generate."""
    rid = request_id or new_request_id()
    started = time.monotonic()
    emb = await tagged(endpoints.client(cfg.embedder), WORKFLOW, rid).embeddings.create(
        model=cfg.embedder, input=f"query: {question}"
    )
    hits = index.search(np.asarray(emb.data[0].embedding, dtype=np.float32), cfg.retrieve)
    ranked: Any = await tagged(endpoints.client(cfg.reranker), WORKFLOW, rid).post(
        "/rerank",
        cast_to=object,
        body={
            "model": cfg.reranker,
            "query": question,
            "documents": [index.texts[i] for i in hits],
            "top_n": cfg.keep,
        },
    )
    chosen = [hits[r["index"]] for r in ranked["results"][: cfg.keep]]
    docs = "\n".join(f"Doc {k + 1}: {index.texts[i]}" for k, i in enumerate(chosen))
    chat = await tagged(endpoints.client(cfg.generator), WORKFLOW, rid).chat.completions.create(
        model=cfg.generator,
        max_tokens=cfg.max_tokens,
        temperature=0.0,
        messages=[
            {"role": "system", "content": SYSTEM_PROMPT + docs},
            {"role": "user", "content": f"Question: {question}"},
        ],
    )
    return RagResult(rid, chat.choices[0].message.content or "", chosen, time.monotonic() - started)


def add_rag_args(p: argparse.ArgumentParser) -> None:
    d = RagConfig()
    p.add_argument("--embedder", default=d.embedder, help="embedding model name")
    p.add_argument("--reranker", default=d.reranker, help="reranker model name")
    p.add_argument("--rag-generator", default=d.generator, help="answering model name")
    p.add_argument("--passages", type=int, default=2000, help="generated passages to index")


def rag_config_from(args: argparse.Namespace) -> RagConfig:
    return RagConfig(embedder=args.embedder, reranker=args.reranker, generator=args.rag_generator)


async def _main(args: argparse.Namespace) -> None:
    endpoints = endpoints_from(args)
    cfg = rag_config_from(args)
    try:
        index = await build_index(endpoints, cfg, passages(args.passages, seed=args.seed))
        question = args.question or questions(1, seed=args.seed)[0].text
        result = await answer(endpoints, index, question, cfg)
    finally:
        await endpoints.close()
    print(json.dumps({"question": question, **result.__dict__}, indent=2))


def main() -> None:
    p = argparse.ArgumentParser(description="RAG with a reranker, once.")
    add_endpoint_args(p)
    add_rag_args(p)
    p.add_argument("--question", default=None, help="the question (default: a generated one)")
    p.add_argument("--seed", type=int, default=0)
    asyncio.run(_main(p.parse_args()))


if __name__ == "__main__":
    main()

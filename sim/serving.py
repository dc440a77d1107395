"""The serving state of one emulated engine and the request vocabulary its routes share.

Role: ``EmulatorConfig`` (what the CLI decides), ``EmulatedEngine`` (the spec, the real-time
driver, the metrics, the seeds: everything a route handler needs), and the small helpers that
turn a JSON body into checked values or into an OpenAI-style ``ApiError``.

Invariants: every client error is an ``ApiError`` (HTTP status + OpenAI error body), raised
before anything is submitted to the engine core; a request submitted to the core is either
awaited to its end or aborted (``prefill`` aborts what it submitted when cancelled).
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from sim.engine_driver import EngineDriver, Ticket, Update
from sim.engine_metrics import EngineMetrics
from sim.perf import ModelSpec
from sim.text import LengthModel

FINGERPRINT = "scepsy-emulated"
EMULATED_HEADER = "X-Scepsy-Emulated"


@dataclass(frozen=True)
class EmulatorConfig:
    """One emulated engine: which model on which (share of a) GPU, and how fast to run."""

    model: str
    gpu: str = "a100"
    tp: int = 1
    share: float = 1.0
    speedup: float = 1.0
    seed: int = 0
    served_model_name: str | None = None
    api_key: str | None = None  # as vLLM's --api-key: /v1 routes then need this bearer token
    lengths: LengthModel = field(default_factory=LengthModel)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # engines on the same GPUs contend through boards in this folder (None: it runs alone)
    gpu_board: Path | None = None
    gpu_ids: tuple[int, ...] = (0,)

    @property
    def name(self) -> str:
        return self.served_model_name or self.model


class ApiError(Exception):
    """A client-visible error, rendered as ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type_: str = "BadRequestError",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.status,
            }
        }

    def response(self) -> web.Response:
        return json_response(self.body(), status=self.status)


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


async def read_body(request: web.Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError as exc:
        raise ApiError(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError("request body must be a JSON object")
    return body


def get_int(
    body: Mapping[str, Any], key: str, default: int | None, *, lo: int = 0, hi: int | None = None
) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(f"{key} must be an integer", param=key)
    if value < lo or (hi is not None and value > hi):
        bound = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
        raise ApiError(f"{key} must be {bound}, got {value}", param=key)
    return value


def get_float(body: Mapping[str, Any], key: str, default: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ApiError(f"{key} must be a number", param=key)
    return float(value)


def get_stops(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise ApiError("stop must be a string or a list of strings", param="stop")


def get_texts(value: Any, key: str) -> list[str]:
    """A string or a list of strings (Cohere-style ``{"text": ...}`` objects accepted)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        out = []
        for item in value:
            if isinstance(item, str):
                out.append(item)
            elif isinstance(item, Mapping) and isinstance(item.get("text"), str):
                out.append(item["text"])
            else:
                raise ApiError(f"{key} must hold strings", param=key)
        return out
    raise ApiError(f"{key} must be a string or a non-empty list of strings", param=key)


@dataclass
class EmulatedEngine:
    """Everything the routes of one emulator share."""

    config: EmulatorConfig
    spec: ModelSpec
    driver: EngineDriver
    metrics: EngineMetrics
    draws: itertools.count[int] = field(default_factory=itertools.count)

    @property
    def name(self) -> str:
        return self.config.name

    def check_model(self, body: Mapping[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model != self.name:
            raise ApiError(
                f"The model `{model}` does not exist.",
                status=404,
                type_="NotFoundError",
                param="model",
            )

    def check_kind(self, *kinds: str, route: str) -> None:
        if self.spec.kind not in kinds:
            raise ApiError(f"model {self.name} ({self.spec.kind}) does not serve {route}")

    def check_context(self, prompt_tokens: int, max_tokens: int = 0) -> None:
        limit = self.spec.max_context
        if prompt_tokens + max_tokens > limit:
            raise ApiError(
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the "
                f"messages, {max_tokens} in the completion).",
                param="max_tokens",
            )

    def sampling_key(self, body: Mapping[str, Any], temperature: float) -> int:
        """The request's seed; greedy decoding needs none; otherwise a fresh draw."""
        seed = get_int(body, "seed", None, lo=-(2**63))
        if seed is not None:
            return seed
        return 0 if temperature == 0 else -1 - next(self.draws)

    def submit(
        self,
        rid: str,
        prompt: Sequence[int],
        output_tokens: int,
        sink: asyncio.Queue[Update],
        index: int,
        *,
        every_token: bool = False,
    ) -> Ticket:
        """Hand one request to the driver; the core's refusal becomes a 400."""
        try:
            return self.driver.submit(
                rid, prompt, output_tokens, sink, index, every_token=every_token
            )
        except ValueError as exc:
            raise ApiError(str(exc)) from exc

    async def prefill(self, prompts: Sequence[Sequence[int]]) -> int:
        """Run prompts through the core as prefill-only requests; the prompt tokens used."""
        base = new_id("pool")
        sink: asyncio.Queue[Update] = asyncio.Queue()
        rids = [f"{base}-{i}" for i in range(len(prompts))]
        pending = set(range(len(prompts)))
        try:
            for i, (rid, prompt) in enumerate(zip(rids, prompts, strict=True)):
                self.submit(rid, prompt, 0, sink, i)
            while pending:
                update = await sink.get()
                if update.finished:
                    pending.discard(update.choice)
        finally:
            for i in pending:
                self.driver.abort(rids[i])
        for _ in prompts:
            self.metrics.count_finished("stop")
        return sum(len(p) for p in prompts)


ENGINE = web.AppKey("engine", EmulatedEngine)


def engine_of(request: web.Request) -> EmulatedEngine:
    return request.app[ENGINE]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def created() -> int:
    return int(time.time())

"""``/v1/chat/completions`` and ``/v1/completions`` of the emulator, streaming or not.

Role: parse a generate request in vLLM's dialect, plan each choice's output with
``sim.text`` (length decided up front), submit one engine request per choice to the real-time
driver, and answer with the choices as the driver reports their tokens: Server-Sent Events
token by token, or one JSON body when all choices finished.

Invariants:
- every response carries ``system_fingerprint: "scepsy-emulated"``;
- streamed deltas of a choice join to exactly the non-streamed text of the same request;
- a usage event (``choices: []``) is sent last, before ``[DONE]``, iff ``stream_options``
  is given and its ``include_usage`` is not false (vLLM treats ``{}`` as include);
- a 1-token request asking for logprobs is answered as a process-reward verdict: the token
  is "+" or "-", and ``top_logprobs`` holds both with a deterministic P("+");
- if the handler ends early (client gone, error), every unfinished choice is aborted in the core.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from sim.engine_driver import Update
from sim.serving import (
    FINGERPRINT,
    ApiError,
    EmulatedEngine,
    created,
    engine_of,
    get_float,
    get_int,
    get_stops,
    json_response,
    new_id,
    read_body,
)
from sim.text import (
    BOS,
    Generation,
    GenerationRequest,
    alternatives,
    digest,
    plan_generation,
    prm_probability,
    prm_top_logprobs,
    render_chat,
    token_ids,
)


@dataclass(frozen=True)
class Call:
    """One parsed generate request: its prompts and what each choice will emit."""

    chat: bool
    rid: str
    prompts: list[list[int]]  # token ids per prompt
    choices: list[Generation]  # prompt-major: choice i belongs to prompt i // n
    top_logprobs: int | None  # None: no logprobs asked
    stream: bool
    include_usage: bool


def _prompts(body: Mapping[str, Any], chat: bool) -> list[str]:
    if chat:
        messages = body.get("messages")
        if (
            not isinstance(messages, list)
            or not messages
            or not all(isinstance(m, Mapping) for m in messages)
        ):
            raise ApiError("messages must be a non-empty list of objects", param="messages")
        cont = bool(body.get("continue_final_message", False))
        add = bool(body.get("add_generation_prompt", True))  # vLLM's default
        if cont and add:
            raise ApiError(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                param="continue_final_message",
            )
        return [render_chat(messages, add_generation_prompt=add, continue_final_message=cont)]
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, int) for p in prompt):
            return [" ".join(map(str, prompt))]  # token ids: their text stands in for them
        if all(isinstance(p, list) for p in prompt):
            return [" ".join(map(str, p)) for p in prompt]
    raise ApiError("prompt must be a string, a list of strings or token ids", param="prompt")


def parse_call(engine: EmulatedEngine, body: Mapping[str, Any], chat: bool) -> Call:
    """Check a request and plan its choices (no engine work yet)."""
    engine.check_kind("generate", route="chat/completions" if chat else "completions")
    texts = _prompts(body, chat)
    n = get_int(body, "n", 1, lo=1, hi=128) or 1
    if chat:
        wants = bool(body.get("logprobs", False))
        k = get_int(body, "top_logprobs", 0, lo=0, hi=20) if wants else None
    else:
        k = get_int(body, "logprobs", None, lo=0, hi=20)
    temperature = get_float(body, "temperature", 1.0)
    key = engine.sampling_key(body, temperature)
    stops = get_stops(body)
    # Completions prompts get the BOS token the tokenizer adds; chat templates start with it.
    prompts = [token_ids(t if chat else BOS + t) for t in texts]
    default_max = None if chat else 16
    asked = get_int(body, "max_completion_tokens", None, lo=1)
    asked = asked if asked is not None else get_int(body, "max_tokens", default_max, lo=1)
    choices: list[Generation] = []
    for text, ids in zip(texts, prompts, strict=True):
        count = len(ids)
        max_tokens = asked if asked is not None else max(1, engine.spec.max_context - count)
        engine.check_context(count, max_tokens)
        req = GenerationRequest(
            prompt=text,
            max_tokens=max_tokens,
            stop=stops,
            sampling_key=key,
            ignore_eos=bool(body.get("ignore_eos", False)),
            min_tokens=get_int(body, "min_tokens", 0) or 0,
            include_stop_str_in_output=bool(body.get("include_stop_str_in_output", False)),
        )
        for i in range(n):
            if k is not None and max_tokens == 1:
                choices.append(_verdict(engine, text))
            else:
                choices.append(
                    plan_generation(req, i, seed=engine.config.seed, lengths=engine.config.lengths)
                )
    options = body.get("stream_options")
    include_usage = isinstance(options, Mapping) and options.get("include_usage", True) is not False
    return Call(
        chat,
        new_id("chatcmpl" if chat else "cmpl"),
        prompts,
        choices,
        k,
        bool(body.get("stream", False)),
        include_usage,
    )


def _verdict(engine: EmulatedEngine, prompt: str) -> Generation:
    p_plus = prm_probability(prompt, seed=engine.config.seed)
    token = "+" if p_plus >= 0.5 else "-"
    lp = math.log(0.98 * (p_plus if token == "+" else 1 - p_plus))
    return Generation((token,), (token,), token, "length", None, (lp,), verdict=p_plus)


def _top(call: Call, gen: Generation, pos: int) -> list[tuple[str, float]]:
    k = call.top_logprobs or 0
    if gen.verdict is not None:
        return prm_top_logprobs(gen.verdict, k)
    return alternatives(gen.tokens[pos], gen.logprobs[pos], k, digest(gen.logprobs[pos], pos))


def _logprobs(call: Call, gen: Generation, lo: int, hi: int) -> Any:
    """Logprobs of tokens [lo, hi) in the chat or the completions shape."""
    if call.top_logprobs is None:
        return None
    if call.chat:
        return {
            "content": [
                {
                    "token": gen.tokens[p],
                    "logprob": gen.logprobs[p],
                    "bytes": list(gen.tokens[p].encode()),
                    "top_logprobs": [
                        {"token": t, "logprob": lp, "bytes": list(t.encode())}
                        for t, lp in _top(call, gen, p)
                    ],
                }
                for p in range(lo, hi)
            ]
        }
    offset = sum(len(t) for t in gen.tokens[:lo])
    offsets = []
    for p in range(lo, hi):
        offsets.append(offset)
        offset += len(gen.tokens[p])
    return {
        "tokens": list(gen.tokens[lo:hi]),
        "token_logprobs": list(gen.logprobs[lo:hi]),
        "top_logprobs": [dict(_top(call, gen, p)) for p in range(lo, hi)],
        "text_offset": offsets,
    }


def _usage(call: Call, cached: int) -> dict[str, Any]:
    # Every choice prefills its prompt in the core, but vLLM reports the prompt once per prompt.
    prompt = sum(len(p) for p in call.prompts)
    completion = sum(len(g.tokens) for g in call.choices)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _envelope(call: Call, engine: EmulatedEngine, chunk: bool) -> dict[str, Any]:
    obj = (
        "text_completion"
        if not call.chat
        else ("chat.completion.chunk" if chunk else "chat.completion")
    )
    return {
        "id": call.rid,
        "object": obj,
        "created": created(),
        "model": engine.name,
        "system_fingerprint": FINGERPRINT,
    }


class _Run:
    """The choices of one call in flight in the engine core."""

    def __init__(self, engine: EmulatedEngine, call: Call) -> None:
        self.engine, self.call = engine, call
        self.sink: asyncio.Queue[Update] = asyncio.Queue()
        self.rids = [f"{call.rid}-{i}" for i in range(len(call.choices))]
        self.pending = set(range(len(call.choices)))
        self.cached = 0

    def start(self) -> None:
        """Submit every choice (ApiError if the core refuses one; the caller then stops)."""
        per_prompt = len(self.call.choices) // len(self.call.prompts)
        for i, gen in enumerate(self.call.choices):
            ticket = self.engine.submit(
                self.rids[i],
                self.call.prompts[i // per_prompt],
                len(gen.tokens),
                self.sink,
                i,
                every_token=self.call.stream,
            )
            ticket.on_cached = self._add_cached

    def _add_cached(self, tokens: int) -> None:
        self.cached = max(self.cached, tokens)

    async def next(self) -> Update:
        update = await self.sink.get()
        if update.finished:
            self.pending.discard(update.choice)
            self.engine.metrics.count_finished(self.call.choices[update.choice].finish_reason)
        return update

    def stop(self) -> None:
        """Abort whatever has not finished (client gone, or an error)."""
        for i in self.pending:
            self.engine.driver.abort(self.rids[i])
        self.pending.clear()


def _choice_json(call: Call, gen: Generation, index: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "index": index,
        "logprobs": _logprobs(call, gen, 0, len(gen.tokens)),
        "finish_reason": gen.finish_reason,
        "stop_reason": gen.stop_reason,
    }
    if call.chat:
        out["message"] = {"role": "assistant", "content": gen.text, "tool_calls": []}
    else:
        out["text"] = gen.text
    return out


async def _answer(engine: EmulatedEngine, call: Call) -> web.Response:
    run = _Run(engine, call)
    try:
        run.start()
        while run.pending:
            await run.next()
    finally:
        run.stop()
    body = _envelope(call, engine, chunk=False)
    body["choices"] = [_choice_json(call, g, i) for i, g in enumerate(call.choices)]
    body["usage"] = _usage(call, run.cached)
    return json_response(body)


def _sse(data: Any) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


def _delta_chunk(
    call: Call, engine: EmulatedEngine, index: int, lo: int, hi: int, last: bool
) -> dict[str, Any]:
    gen = call.choices[index]
    text = "".join(gen.deltas[lo:hi])
    choice: dict[str, Any] = {
        "index": index,
        "logprobs": _logprobs(call, gen, lo, hi),
        "finish_reason": gen.finish_reason if last else None,
    }
    if last:
        choice["stop_reason"] = gen.stop_reason
    if call.chat:
        choice["delta"] = {"content": text}
    else:
        choice["text"] = text
    chunk = _envelope(call, engine, chunk=True)
    chunk["choices"] = [choice]
    return chunk


async def _stream(request: web.Request, engine: EmulatedEngine, call: Call) -> web.StreamResponse:
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    run = _Run(engine, call)
    sent = [0] * len(call.choices)
    try:
        run.start()
        await resp.prepare(request)
        if call.chat:  # vLLM opens every choice with the assistant role before any token
            for i in range(len(call.choices)):
                chunk = _envelope(call, engine, chunk=True)
                chunk["choices"] = [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
                await resp.write(_sse(chunk))
        while run.pending:
            update = await run.next()
            i, upto = update.choice, update.emitted
            # One event per token, as vLLM streams; the last one carries the finish reason.
            for pos in range(sent[i], upto):
                last = update.finished and pos == upto - 1
                await resp.write(_sse(_delta_chunk(call, engine, i, pos, pos + 1, last)))
            if update.finished and sent[i] >= upto:  # all tokens went out before the finish
                await resp.write(_sse(_delta_chunk(call, engine, i, upto, upto, True)))
            sent[i] = max(sent[i], upto)
        if call.include_usage:
            chunk = _envelope(call, engine, chunk=True)
            chunk["choices"] = []
            chunk["usage"] = _usage(call, run.cached)
            await resp.write(_sse(chunk))
    except (ConnectionResetError, asyncio.CancelledError, ApiError):
        raise
    except Exception as exc:  # after the headers went out, errors travel in the stream
        await resp.write(
            _sse(
                ApiError(
                    f"emulated engine error: {exc}", status=500, type_="InternalServerError"
                ).body()
            )
        )
    finally:
        run.stop()
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def _handle(request: web.Request, engine: EmulatedEngine, chat: bool) -> web.StreamResponse:
    body = await read_body(request)
    engine.check_model(body)
    call = parse_call(engine, body, chat)
    if call.stream:
        return await _stream(request, engine, call)
    return await _answer(engine, call)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, engine_of(request), chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _handle(request, engine_of(request), chat=False)

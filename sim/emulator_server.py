"""Emulated engines started inside the current event loop, on loopback ports.

Role: what tests, benchmarks and demos use to stand up one or several emulators without
subprocesses: ``async with serving(config) as server`` gives a running ``scepsy-engine`` app
on ``127.0.0.1`` (port 0 = a free one) and tears it down (driver task included) on exit;
``serving_many`` does the same for one engine per model.

Invariants: on exit nothing of the server is left running (the runner's cleanup cancels the
driver task); ``base_url`` ends in ``/v1`` as OpenAI clients expect.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from aiohttp import web

from sim.emulator import make_app
from sim.serving import ENGINE, EmulatedEngine, EmulatorConfig


@dataclass(frozen=True)
class RunningEmulator:
    config: EmulatorConfig
    app: web.Application
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def engine(self) -> EmulatedEngine:
        return self.app[ENGINE]


Observer = Callable[[web.Request], None]


@contextlib.asynccontextmanager
async def serving(
    config: EmulatorConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    observe: Observer | None = None,
) -> AsyncIterator[RunningEmulator]:
    """Serve one emulator; ``observe`` sees every request as its response starts."""
    app = make_app(config)
    if observe is not None:
        hook = observe

        async def seen(request: web.Request, response: web.StreamResponse) -> None:
            hook(request)

        app.on_response_prepare.append(seen)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0][1]
        yield RunningEmulator(config, app, host, int(bound))
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def serving_many(
    configs: Sequence[EmulatorConfig],
    *,
    host: str = "127.0.0.1",
    observe: Observer | None = None,
) -> AsyncIterator[dict[str, RunningEmulator]]:
    """One emulator per config, keyed by served model name."""
    async with contextlib.AsyncExitStack() as stack:
        out = {}
        for config in configs:
            out[config.name] = await stack.enter_async_context(
                serving(config, host=host, observe=observe)
            )
        yield out

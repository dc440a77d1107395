"""Benchmark: what proxy routing buys a beam-search workflow (issue 26, item 5), emulated.

``python -m bench.proxy.routing [--quick] [--out FILE] [--rate R]`` prints one JSON object
(and writes it to FILE).

Set-up, fresh for every configuration (so no configuration inherits another's prefix cache):
two emulated replicas of the beam example's generator and two of its verifier
(``python -m sim.cli``, one process each, the same ``--seed`` so a prompt gets the same text
on any replica) behind one or two ``scepsy-proxy`` processes (``python -m proxy.cli --config``,
the routing policy in ``proxy.routing.policy``). The load is ``examples.beam_search.solve`` on
the plain ``openai`` SDK, started at Poisson arrivals by ``examples.load.poisson`` in this
process. With two proxies the calls are split **per call**: every HTTP request the SDK sends
goes to the next proxy in turn (:class:`PerCallSplit`), as an L7 gateway spreading calls
over proxy replicas would, so the calls of one workflow request land on both proxies.

Configurations (:data:`CONFIGS`): one proxy ``prefix_affinity``; two proxies
``prefix_affinity``; two ``consistent_hash``; two ``round_robin``; one ``consistent_hash``.
Each runs the same seeded load: the same arrival times, problems, request ids
(``routing-<seed>-<n>``, which ``X-Scepsy-Request-Id`` carries and ``consistent_hash`` hashes)
and sampling seeds. Measured per configuration: prefix-hit rate (sum of
``vllm:prefix_cache_hits`` over sum of ``vllm:prefix_cache_queries`` over all engines,
scraped before the first arrival and after the last completion), workflow-request latency
(mean, p50, p90; wall seconds, and model seconds = wall x speed-up), completed and failed
requests. The arrival rate comes from a short probe (:func:`probe`) unless ``--rate`` names it.

Invariants: every figure is from emulated engines and labelled so (``"emulated": true``);
every process a configuration starts is stopped before the next starts, on errors too
(:class:`optimizer.demo.run.Stack`); the product never imports this module.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from tempfile import TemporaryDirectory
from typing import Any

import httpx2
import yaml
from openai import AsyncOpenAI

from bench.speed.emulator_lag import _Child, _ready, lag_over, reexec_single_threaded, scrape
from examples.beam_search import PROBLEMS, BeamConfig, solve
from examples.endpoints import Endpoints
from examples.load import Request, Tally, poisson
from optimizer.demo.run import Stack
from shared.ports import free_port

LABEL = "emulated"
NOTE = (
    "emulated: every figure comes from scepsy-engine emulators (sim.cli) on CPU, not GPUs; "
    "latencies are wall seconds on a small shared machine (noisy) and model seconds "
    "(wall x speed-up); ratios between configurations are the result, not absolute values"
)
HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"


@dataclass(frozen=True)
class Config:
    name: str
    proxies: int
    policy: str


CONFIGS = (
    Config("one_proxy_prefix_affinity", 1, "prefix_affinity"),
    Config("two_proxies_prefix_affinity", 2, "prefix_affinity"),
    Config("two_proxies_consistent_hash", 2, "consistent_hash"),
    Config("two_proxies_round_robin", 2, "round_robin"),
    Config("one_proxy_consistent_hash", 1, "consistent_hash"),
)


@dataclass(frozen=True)
class Shape:
    """The engines and the load; rates are workflow requests per wall second."""

    duration_s: float = 90.0  # wall seconds of arrivals per configuration
    replicas: int = 2  # per model
    gpu: str = "a6000"
    share: float = 0.5
    speedup: float = 1.0
    max_num_seqs: int = 256
    beam: tuple[int, int, int] = (4, 2, 8)  # beams, width, iterations
    seed: int = 0
    probe_rates: tuple[float, ...] = (1.0, 1.25, 1.5, 1.75, 2.0, 2.25)
    probe_s: float = 30.0
    idle_requests: int = 4
    target_slowdown: float = 2.0  # the probe picks the highest rate with mean <= this x idle

    def beam_config(self) -> BeamConfig:
        n, width, iterations = self.beam
        return BeamConfig(n=n, width=width, iterations=iterations)


FULL = Shape()
QUICK = Shape(duration_s=10.0, probe_rates=(1.0, 2.0), probe_s=8.0, idle_requests=2)


class PerCallSplit(httpx2.AsyncBaseTransport):
    """Send each HTTP request to the next of ``ports`` on the request's host, in turn."""

    def __init__(self, ports: Sequence[int]) -> None:
        self._ports = itertools.cycle(ports)
        self._inner = httpx2.AsyncHTTPTransport(
            limits=httpx2.Limits(max_connections=1000, max_keepalive_connections=200)
        )

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        request.url = request.url.copy_with(port=next(self._ports))
        request.headers["Host"] = request.url.netloc.decode("ascii")
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()


@dataclass
class SplitEndpoints(Endpoints):
    """Every model behind the proxies at ``ports`` (loopback), each call to the next one."""

    ports: tuple[int, ...] = ()

    def client(self, model: str) -> AsyncOpenAI:
        if self.base_url not in self._clients:
            http = httpx2.AsyncClient(transport=PerCallSplit(self.ports), timeout=self.timeout_s)
            self._clients[self.base_url] = AsyncOpenAI(
                base_url=self.base_url,
                api_key=self.api_key,
                max_retries=self.max_retries,
                http_client=http,
            )
        return self._clients[self.base_url]


def beam_requests(endpoints: Endpoints, shape: Shape, seed: int) -> Request:
    """Request ``n``: problem ``n`` mod 8, request id ``routing-<seed>-<n>``, seed ``seed + n``."""
    cfg = shape.beam_config()

    async def one(number: int) -> object:
        problem = PROBLEMS[number % len(PROBLEMS)]
        rid = f"routing-{seed}-{number}"
        return await solve(endpoints, problem, cfg, request_id=rid, seed=seed + number)

    return one


@dataclass
class RoutingStack:
    """Emulated replicas of both beam models behind ``config.proxies`` proxy processes."""

    workdir: Path
    shape: Shape
    config: Config
    engines: list[tuple[str, str]] = field(default_factory=list)  # (model, url)
    proxy_ports: list[int] = field(default_factory=list)
    _stack: Stack | None = None

    def _engine_argv(self, model: str, port: int) -> list[str]:
        s = self.shape
        flags = {"--model": model, "--gpu": s.gpu, "--share": s.share, "--port": port}
        flags |= {"--speedup": s.speedup, "--seed": s.seed, "--max-num-seqs": s.max_num_seqs}
        return [sys.executable, "-m", "sim.cli", *(str(x) for kv in flags.items() for x in kv)]

    def _proxy_settings(self, k: int, port: int) -> dict[str, Any]:
        return {
            "store": {"path": str(self.workdir / f"store-{k}"), "flush_interval_s": 1.0},
            "proxy": {
                "listen": f"127.0.0.1:{port}",
                "proxy_id": f"routing-{k}",
                "workers": 1,  # one process: prefix_affinity's table is per process
                "shutdown_grace_s": 2.0,
                "upstreams": [{"model": m, "url": u} for m, u in self.engines],
                "routing": {"policy": self.config.policy},
            },
        }

    async def __aenter__(self) -> RoutingStack:
        """Start engines, then proxies; a start that fails (a port taken between asking and
        binding, on a machine others use too) is stopped and tried once more."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        for attempt in range(2):
            self._stack = Stack(self.workdir)
            try:
                await self._start(self._stack)
                return self
            except RuntimeError:  # a child exited or never answered: stop all, maybe retry
                await self._stack.close()
                self.engines, self.proxy_ports = [], []
                if attempt:
                    raise
            except BaseException:
                await self._stack.close()
                raise
        raise AssertionError("unreachable")

    async def _start(self, stack: Stack) -> None:
        cfg = self.shape.beam_config()
        models = [m for m in (cfg.generator, cfg.verifier) for _ in range(self.shape.replicas)]
        ports = distinct_ports(len(models) + self.config.proxies)

        def launch(name: str, argv: list[str], port: int) -> _Child:
            url = f"http://127.0.0.1:{port}"
            return _Child(name, stack.spawn(name, argv), url, stack.run / f"{name}.log")

        engines = [
            launch(f"engine-{m}-{i % self.shape.replicas}", self._engine_argv(m, port), port)
            for i, (m, port) in enumerate(zip(models, ports, strict=False))
        ]
        self.engines = [(m, c.url) for m, c in zip(models, engines, strict=True)]
        await asyncio.gather(*(_ready(c) for c in engines))
        proxies = []
        for k, port in enumerate(ports[len(models) :]):
            path = self.workdir / f"proxy-{k}.yaml"
            path.write_text(yaml.safe_dump(self._proxy_settings(k, port), sort_keys=False))
            argv = [sys.executable, "-m", "proxy.cli", "--config", str(path)]
            proxies.append(launch(f"proxy-{k}", [*argv, "--log-level", "WARNING"], port))
        self.proxy_ports = list(ports[len(models) :])
        await asyncio.gather(*(_ready(c) for c in proxies))

    async def __aexit__(self, *exc: object) -> None:
        if self._stack is not None:
            await self._stack.close()

    def endpoints(self) -> SplitEndpoints:
        url = f"http://127.0.0.1:{self.proxy_ports[0]}/v1"
        return SplitEndpoints(url, ports=tuple(self.proxy_ports))

    async def scrape(self) -> list[dict[str, float]]:
        return list(await asyncio.gather(*(scrape(u) for _, u in self.engines)))


def distinct_ports(count: int) -> list[int]:
    """``count`` loopback ports free when asked, no two alike."""
    ports: list[int] = []
    while len(ports) < count:
        if (port := free_port()) not in ports:
            ports.append(port)
    return ports


def hit_rate(before: Sequence[dict[str, float]], after: Sequence[dict[str, float]]) -> float:
    """Sum of prefix-cache hits over sum of queries, all engines, between two scrapes."""
    pairs = list(zip(before, after, strict=True))
    hits = sum(a.get(HITS, 0.0) - b.get(HITS, 0.0) for b, a in pairs)
    queries = sum(a.get(QUERIES, 0.0) - b.get(QUERIES, 0.0) for b, a in pairs)
    return hits / queries if queries else 0.0


async def load(stack: RoutingStack, rate: float, duration_s: float, seed: int) -> dict[str, Any]:
    """The seeded Poisson load for ``duration_s``; the driver's report, the hit rate, engines."""
    endpoints = stack.endpoints()
    tally = Tally()
    try:
        before = await stack.scrape()
        started = time.monotonic()
        await poisson(
            beam_requests(endpoints, stack.shape, seed), rate, duration_s, tally, seed=seed
        )
        window = time.monotonic() - started
        after = await stack.scrape()
    finally:
        await endpoints.close()
    report = tally.report(rate)
    s = stack.shape.speedup
    report["latency_model_s"] = {k: v * s for k, v in report["latency_s"].items()}
    engines = {
        f"{m}/{i % stack.shape.replicas}": lag_over(b, a, s)
        for i, ((m, _), b, a) in enumerate(zip(stack.engines, before, after, strict=True))
    }
    for name, (b, a) in zip(engines, zip(before, after, strict=True), strict=True):
        engines[name]["prefix_cache_queries"] = a.get(QUERIES, 0.0) - b.get(QUERIES, 0.0)
    return report | {
        "prefix_hit_rate": hit_rate(before, after),
        "window_s": window,
        "engines": engines,
    }


async def idle_latency(stack: RoutingStack, requests: int, seed: int) -> float:
    """Mean latency of ``requests`` workflow requests run one at a time (nothing else loaded)."""
    endpoints = stack.endpoints()
    make = beam_requests(endpoints, stack.shape, seed)
    took = []
    try:
        for n in range(requests):
            t = time.monotonic()
            await make(n)
            took.append(time.monotonic() - t)
    finally:
        await endpoints.close()
    return sum(took) / len(took)


async def probe(shape: Shape, workdir: Path) -> dict[str, Any]:
    """Idle latency, then each of ``shape.probe_rates`` for ``probe_s`` (one proxy,
    prefix_affinity, seeds unlike the measured runs'); the rate picked is the highest whose
    mean latency stays within ``target_slowdown`` x idle with every request completed."""
    async with RoutingStack(workdir, shape, CONFIGS[0]) as stack:
        idle = await idle_latency(stack, shape.idle_requests, seed=10_000)
        steps = []
        for k, rate in enumerate(shape.probe_rates):
            r = await load(stack, rate, shape.probe_s, seed=20_000 + 1000 * k)
            mean = r["latency_s"].get("mean", float("inf"))
            steps.append({"rate_rps": rate, "mean_s": mean, "p90_s": r["latency_s"].get("p90"),
                          "completed": r["completed"], "failed": r["failed"],
                          "slowdown": mean / idle})  # fmt: skip
            if r["failed"] or mean > shape.target_slowdown * idle:
                break
    fits = [
        s["rate_rps"] for s in steps if not s["failed"] and s["slowdown"] <= shape.target_slowdown
    ]
    rate = max(fits) if fits else shape.probe_rates[0]
    return {"idle_mean_s": idle, "steps": steps, "rate_rps": rate}


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def comparisons(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The ratios issue 26 asks for, and whether its targets held."""

    def fig(name: str, key: str) -> float | None:
        run = runs.get(name, {})
        return run.get("prefix_hit_rate") if key == "hit" else run.get("latency_s", {}).get("mean")

    ch2, pa1, rr2 = (
        "two_proxies_consistent_hash",
        "one_proxy_prefix_affinity",
        "two_proxies_round_robin",
    )
    hit_vs_pa, lat_vs_pa = (
        ratio(fig(ch2, "hit"), fig(pa1, "hit")),
        ratio(fig(ch2, "lat"), fig(pa1, "lat")),
    )
    hit_vs_rr, lat_vs_rr = (
        ratio(fig(ch2, "hit"), fig(rr2, "hit")),
        ratio(fig(ch2, "lat"), fig(rr2, "lat")),
    )
    return {
        "two_proxy_consistent_hash_vs_one_proxy_prefix_affinity": {
            "hit_rate_ratio": hit_vs_pa,
            "mean_latency_ratio": lat_vs_pa,
            "target": "both within 5% (hit rate >= 0.95x, mean latency <= 1.05x)",
            "met": hit_vs_pa is not None and lat_vs_pa is not None
            and hit_vs_pa >= 0.95 and lat_vs_pa <= 1.05,
        },
        "two_proxy_consistent_hash_vs_two_proxy_round_robin": {
            "hit_rate_ratio": hit_vs_rr,
            "mean_latency_ratio": lat_vs_rr,
            "target": "better on both (hit rate ratio > 1, mean latency ratio < 1)",
            "met": hit_vs_rr is not None and lat_vs_rr is not None
            and hit_vs_rr > 1 and lat_vs_rr < 1,
        },
    }  # fmt: skip


def summary(run: dict[str, Any]) -> dict[str, Any]:
    lat, model = run["latency_s"], run["latency_model_s"]
    return {
        "prefix_hit_rate": run["prefix_hit_rate"],
        "mean_latency_s": lat.get("mean"),
        "p90_latency_s": lat.get("p90"),
        "mean_latency_model_s": model.get("mean"),
        "p90_latency_model_s": model.get("p90"),
        "completed": run["completed"],
        "failed": run["failed"],
    }


async def run_benchmark(
    shape: Shape, workdir: Path, rate: float | None = None, configs: Sequence[Config] = CONFIGS
) -> dict[str, Any]:
    """The probe (unless ``rate`` is given), then every configuration on a fresh stack."""
    started = time.monotonic()
    probed = None if rate is not None else await probe(shape, workdir / "probe")
    chosen = rate if rate is not None else probed["rate_rps"] if probed else 0.0
    runs: dict[str, dict[str, Any]] = {}
    for c in configs:
        async with RoutingStack(workdir / c.name, shape, c) as stack:
            runs[c.name] = {"proxies": c.proxies, "policy": c.policy}
            runs[c.name] |= await load(stack, chosen, shape.duration_s, shape.seed)
    return {
        "emulated": True,
        "label": LABEL,
        "note": NOTE,
        "split": "per call: with two proxies each HTTP call goes to the next proxy in turn, so a "
        "workflow request's calls land on both (as behind an L7 gateway)",
        "shape": asdict(shape),
        "beam": asdict(shape.beam_config()),
        "rate_rps": chosen,
        "probe": probed,
        "summary": {name: summary(r) for name, r in runs.items()},
        "comparisons": comparisons(runs),
        "runs": runs,
        "machine": {"cpu_count": os.cpu_count(), "load_average_end": os.getloadavg()},
        "wall_s": time.monotonic() - started,
    }


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="What proxy routing buys beam search (emulated).")
    p.add_argument("--quick", action="store_true", help="short runs (a smoke check, not a result)")
    p.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    p.add_argument("--rate", type=float, default=None, help="workflow requests/s (skip the probe)")
    p.add_argument("--speedup", type=float, default=None, help="emulator speed-up (1)")
    p.add_argument("--keep", type=Path, default=None, help="run in this folder and keep its logs")
    args = p.parse_args(argv)
    given = list(sys.argv[1:] if argv is None else argv)
    reexec_single_threaded("bench.proxy.routing", given)
    shape = QUICK if args.quick else FULL
    if args.speedup is not None:
        shape = replace(shape, speedup=args.speedup)
    with TemporaryDirectory(prefix="scepsy-routing-") as tmp:
        result = asyncio.run(run_benchmark(shape, args.keep or Path(tmp), args.rate))
    result["command"] = " ".join(["python -m bench.proxy.routing", *given])
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

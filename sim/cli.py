"""``scepsy-engine``: start one emulated LLM engine (vLLM dialect) on a port.

Role: parse flags into an ``EmulatorConfig`` and serve ``sim.emulator.make_app`` until
SIGINT/SIGTERM (aiohttp's graceful shutdown runs the app's cleanup, which stops the driver).
Bad flags exit with status 2 and one line naming the problem, never a traceback.

    scepsy-engine --model llama-3-8b --gpu a6000 --tp 1 --share 1.0 --port 8000 --speedup 10
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from aiohttp import web

from shared import logs
from shared.version import add_version_argument
from sim.emulator import make_app
from sim.perf import GPUS, MODELS
from sim.serving import EmulatorConfig
from sim.text import LengthModel


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="scepsy-engine",
        description="An emulated LLM engine speaking vLLM's OpenAI-compatible API. Its "
        "timings come from Scepsy's performance model, not from a GPU.",
    )
    p.add_argument("--model", required=True, choices=sorted(MODELS), help="model spec name")
    p.add_argument("--gpu", default="a100", choices=sorted(GPUS), help="GPU type (a100)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (1)")
    p.add_argument("--share", type=float, default=1.0, help="fraction of each GPU, 0-1 (1.0)")
    p.add_argument("--host", default="127.0.0.1", help="listen address (127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="listen port (8000)")
    p.add_argument(
        "--speedup", type=float, default=1.0, help="model seconds per wall second (1.0 = real time)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of generated text and vectors (0)")
    p.add_argument(
        "--served-model-name", default=None, help="name clients use in `model` (default: --model)"
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require this bearer token on /v1 routes, as vLLM's --api-key",
    )
    p.add_argument(
        "--step-median-tokens",
        type=float,
        default=60.0,
        help="median tokens per generation step before its stop string (assumption, default 60)",
    )
    p.add_argument(
        "--step-sigma",
        type=float,
        default=0.7,
        help="log-sigma of the step length distribution (assumption, default 0.7)",
    )
    p.add_argument(
        "--eos-probability",
        type=float,
        default=0.1,
        help="chance a step ends the sequence instead of its stop string (assumption, default 0.1)",
    )
    p.add_argument(
        "--gpu-board",
        type=Path,
        default=None,
        help="folder of the GPU boards engines on the same GPUs share, to contend for the "
        "GPU as simulated replicas do (default: none, the engine runs alone)",
    )
    p.add_argument(
        "--gpu-ids",
        type=_gpu_ids,
        default=(0,),
        help="the GPUs (indices on this node) the engine runs on, comma-separated (0)",
    )
    p.add_argument("--max-num-seqs", type=int, default=256, help="batch size bound (256)")
    p.add_argument(
        "--max-num-batched-tokens", type=int, default=8192, help="tokens per step bound (8192)"
    )
    logs.add_arguments(p, "WARNING")
    add_version_argument(p)
    return p


def config_from(args: argparse.Namespace) -> EmulatorConfig:
    return EmulatorConfig(
        model=args.model,
        gpu=args.gpu,
        tp=args.tp,
        share=args.share,
        speedup=args.speedup,
        seed=args.seed,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        lengths=LengthModel(args.step_median_tokens, args.step_sigma, args.eos_probability),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_board=args.gpu_board,
        gpu_ids=args.gpu_ids,
    )


def _gpu_ids(text: str) -> tuple[int, ...]:
    try:
        ids = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"a comma-separated list of GPU indices, got {text!r}"
        ) from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"GPU indices must be >= 0, got {text!r}")
    return ids


def main(argv: Sequence[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    logs.configure_from_args(args)
    try:
        if args.speedup <= 0:
            raise ValueError("--speedup must be positive")
        if not 0 <= args.port <= 65535:
            raise ValueError(f"--port must be in 0-65535, got {args.port}")
        app = make_app(config_from(args))
    except ValueError as exc:
        p.exit(2, f"scepsy-engine: error: {exc}\n")
    banner = (
        f"scepsy-engine (EMULATED {args.model} on {args.tp}x{args.gpu} share "
        f"{args.share}, speedup {args.speedup}) on http://{args.host}:{args.port}"
    )

    def listening(_: str) -> None:  # aiohttp calls this once the socket is bound
        print(banner, file=sys.stderr, flush=True)

    try:
        web.run_app(app, host=args.host, port=args.port, print=listening, handler_cancellation=True)
    except OSError as exc:  # address in use, unknown host: one line, not a traceback
        p.exit(1, f"scepsy-engine: error: cannot listen on {args.host}:{args.port}: {exc}\n")


if __name__ == "__main__":
    main()

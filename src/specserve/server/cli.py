"""`specserve serve`: load the model, then serve the OpenAI-compatible API with uvicorn.

    specserve serve --model demo --speculative-algorithm NGRAM --port 30000
    python -m specserve.server.cli --config serve.yaml --port 30001

SIGTERM (or Ctrl-C): stop accepting connections, give in-flight requests --shutdown-timeout seconds to
finish, abort the rest, exit 0.
"""

from __future__ import annotations

import argparse
import logging
import math
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specserve.cli_args import run_parsed
from specserve.server.serve_config import ServeConfig, add_serve_arguments, mark_defaults, serve_config_from_args


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `serve` to the `specserve` command's subparsers."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "serve", help="serve an OpenAI-compatible HTTP API (plain or speculative decoding)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_flags(p)
    return p


def _add_flags(p: argparse.ArgumentParser) -> None:
    add_serve_arguments(p)
    mark_defaults(p)
    p.set_defaults(func=serve_from_args)


def serve_from_args(args: argparse.Namespace) -> int:
    """The `func` of `specserve serve`: defaults < --config file < flags, then `run_server`."""
    return run_server(serve_config_from_args(args))


def run_server(cfg: ServeConfig) -> int:
    """Load the model of `cfg` and serve it until SIGTERM/Ctrl-C; 0 after a graceful shutdown, 1 if never up."""
    import uvicorn

    from specserve.engine.batch import BatchEngine
    from specserve.engine.llm import LLM
    from specserve.server.app import create_app
    from specserve.server.batch_serving import BatchServingEngine
    from specserve.server.threads import run_in_passing_thread

    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def load() -> tuple[LLM, BatchEngine]:
        llm = LLM(cfg.model, device=cfg.device, dtype=cfg.dtype, quantization=cfg.quantization,
                  speculative=cfg.speculative,
                  draft_dtype=cfg.draft_dtype)
        profile, trace = cfg.speculative_adaptive_profile, cfg.speculative_adaptive_trace
        return llm, llm.make_engine(cfg.engine, adaptive=cfg.speculative_adaptive,
                                    profile_path=Path(profile) if profile else None,
                                    trace_path=Path(trace) if trace else None, warm_compiled=True)

    # not on the main thread, which would keep an idle OpenMP team beside the engine thread's (threads.py)
    llm, engine = run_in_passing_thread(load)
    app = create_app(BatchServingEngine(llm, engine, cfg.max_queue, overlap=cfg.overlap_schedule), cfg)
    server = uvicorn.Server(uvicorn.Config(
        app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
        timeout_graceful_shutdown=math.ceil(cfg.shutdown_timeout), lifespan="on",
    ))
    # uvicorn shuts down gracefully on SIGTERM, then re-raises the signal to the handler that was in place
    # before it started: make that one a no-op, so a graceful shutdown ends with exit code 0.
    signal.signal(signal.SIGTERM, lambda _sig, _frame: None)
    server.run()
    if not server.started:
        print(f"specserve serve: could not serve on {cfg.host}:{cfg.port}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m specserve.server.cli ARGS` = `specserve serve ARGS`: the same flags, messages and exit codes
    (a parser of its own, so that the server does not import the `specserve` command above it)."""
    parser = argparse.ArgumentParser(prog="specserve serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_flags(parser)
    return run_parsed(parser.parse_args(argv), "specserve serve")


if __name__ == "__main__":
    sys.exit(main())

"""`specserve serve`: load the model, then serve the OpenAI-compatible API with uvicorn.

    specserve serve --model demo --speculative-algorithm NGRAM --port 30000
    python -m specserve.server.cli --config serve.yaml --port 30001

Start-up: the address is checked first (a port in use fails at once, exit 1), then the model loads, the decode
steps compile and the adaptive profile is measured, each with a progress bar; only then does the server listen,
so /health answers 200 from its first answer, and a `ready` line names the address and the start-up time. A model
or flag that cannot be used is one `error:` line and exit 2.

SIGTERM (or Ctrl-C): stop accepting connections, give in-flight requests --shutdown-timeout seconds to
finish, abort the rest, exit 0.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import socket
import sys
import time
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
    t0 = time.perf_counter()
    busy = address_problem(cfg.host, cfg.port)
    if busy is not None:
        print(f"specserve serve: error: cannot listen on {cfg.host}:{cfg.port} ({busy}); stop what holds the port "
              "or pick another --port", file=sys.stderr)
        return 1
    print(f"specserve serve: loading {cfg.model}", file=sys.stderr, flush=True)

    def load() -> tuple[LLM, BatchEngine]:
        llm = LLM(cfg.model, device=cfg.device, dtype=cfg.dtype, quantization=cfg.quantization,
                  speculative=cfg.speculative,
                  draft_dtype=cfg.draft_dtype)
        profile, trace = cfg.speculative_adaptive_profile, cfg.speculative_adaptive_trace
        return llm, llm.make_engine(cfg.engine, adaptive=cfg.speculative_adaptive,
                                    profile_path=Path(profile) if profile else None,
                                    trace_path=Path(trace) if trace else None, warm_compiled=True,
                                    background=cfg.background_compile)

    # not on the main thread, which would keep an idle OpenMP team beside the engine thread's (threads.py)
    llm, engine = run_in_passing_thread(load)

    def ready() -> None:
        print(f"specserve serve: ready on http://{cfg.host}:{cfg.port} serving {cfg.model_name!r} "
              f"(start-up {time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)

    app = create_app(BatchServingEngine(llm, engine, cfg.max_queue, overlap=cfg.overlap_schedule), cfg, ready)
    server = uvicorn.Server(uvicorn.Config(
        app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
        timeout_graceful_shutdown=math.ceil(cfg.shutdown_timeout), lifespan="on",
    ))
    # uvicorn shuts down gracefully on SIGTERM, then re-raises the signal to the handler that was in place
    # before it started: make that one a no-op, so a graceful shutdown ends with exit code 0.
    signal.signal(signal.SIGTERM, lambda _sig, _frame: None)
    server.run()
    code = 0 if server.started else 1
    if not server.started:
        print(f"specserve serve: could not serve on {cfg.host}:{cfg.port}", file=sys.stderr)
    if engine.warmup is not None and engine.warmup.running:
        # The drain is over, but the compile thread is inside inductor's C++: the interpreter's finalization would
        # run C++ destructors beside it (std::terminate, SIGABRT). Nothing is left to save: end the process here.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def address_problem(host: str, port: int) -> str | None:
    """Why (host, port) cannot be listened on now, or None (checked before minutes of loading)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        return f"the host does not resolve: {e}"
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            return e.strerror or str(e)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m specserve.server.cli ARGS` = `specserve serve ARGS`: the same flags, messages and exit codes
    (a parser of its own, so that the server does not import the `specserve` command above it)."""
    parser = argparse.ArgumentParser(prog="specserve serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_flags(parser)
    return run_parsed(parser.parse_args(argv), "specserve serve")


if __name__ == "__main__":
    sys.exit(main())

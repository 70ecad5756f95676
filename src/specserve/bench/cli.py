"""`specserve bench serving`, `compare`, `tune`, `trace` and `peers`.

The main CLI wires these in with `add_bench_parsers(bench_subparsers)`; every parser sets
`func`, a handler taking the parsed namespace and returning the exit code.

Exit codes of `bench serving`: see serving_cli.py. `bench compare`: 0 on success, 2 when an input
cannot be read or recognised. `bench tune`: see tune.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from specserve.bench.peers_cli import add_peers_parser
from specserve.bench.serving_cli import add_serving_parser, cmd_serving, concurrency_list
from specserve.bench.trace import add_trace_parser
from specserve.bench.tune import add_engine_args, cmd_tune
from specserve.models.quantize import QUANTIZATIONS


def add_bench_parsers(subparsers: Any) -> None:
    """Adds `serving`, `compare`, `tune`, `trace` and `peers` to the `specserve bench` subparsers (an argparse
    _SubParsersAction)."""
    add_serving_parser(subparsers)
    add_trace_parser(subparsers)
    add_peers_parser(subparsers)

    c = subparsers.add_parser("compare", help="markdown tables and a plot from serving/acceptance run JSONs")
    c.add_argument("runs", nargs="+", type=Path, help="run JSONs; the first is the baseline")
    c.add_argument("--labels", default=None, help="comma-separated names for the runs (default: file names)")
    c.add_argument("--out", required=True, type=Path, help="markdown report to write")
    c.add_argument("--plot", type=Path, default=None, help="PNG to write")
    c.set_defaults(func=cmd_compare)

    t = subparsers.add_parser("tune", help="serve each grid configuration, sweep it, name the winner per concurrency")
    t.add_argument("--model", default="demo",
                   help="`demo`, `smollm2`, a .gguf file or a checkpoint directory (served and benchmarked)")
    t.add_argument("--device", default="auto", help="the servers' --device")
    t.add_argument("--dtype", default="auto", help="the servers' --dtype")
    t.add_argument("--quantization", default="auto", choices=QUANTIZATIONS, help="the servers' --quantization")
    t.add_argument("--grid", required=True,
                   help='e.g. "EAGLE3:steps=3,5;topk=1,4;draft=4,8 DFLASH:tree=ddtree;draft=8,16 NGRAM:draft=8,12 '
                        'NONE"; keys steps, topk, draft, block, tree, path; NONE is always the baseline')
    t.add_argument("--concurrency", type=concurrency_list, default=[1, 8, 32], help="levels, e.g. 1,8,32")
    t.add_argument("--num-prompts", type=int, default=64, help="requests sent at every level")
    t.add_argument("--dataset", default="coding", help="coding | random | FILE.jsonl")
    t.add_argument("--random-input-len", type=int, default=128, help="words per prompt of --dataset random")
    t.add_argument("--output-len", type=int, default=128, help="max_tokens of every request")
    t.add_argument("--temperature", type=float, default=0.0)
    t.add_argument("--seed", type=int, default=None, help="shuffles the dataset and is sent as the sampling seed")
    t.add_argument("--ignore-eos", action="store_true", help="ask for exactly --output-len tokens")
    t.add_argument("--server-timeout", type=float, default=600.0, help="seconds a server gets to answer /health")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument("--out-dir", required=True, type=Path, help="run JSONs, server logs, tune.json and tune.md")
    add_engine_args(t)
    t.set_defaults(func=cmd_tune)


def cmd_compare(args: argparse.Namespace) -> int:
    from specserve.bench.compare import write_report
    from specserve.bench.runs import load_runs

    labels = [x.strip() for x in args.labels.split(",")] if args.labels else None
    try:
        runs = load_runs(args.runs, labels)
        write_report(runs, args.out, args.plot)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}" + (f" and {args.plot}" if args.plot else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m specserve.bench.cli serving|compare|tune ...` (the same as `specserve bench ...`)."""
    parser = argparse.ArgumentParser(prog="specserve bench")
    add_bench_parsers(parser.add_subparsers(dest="bench_command", required=True))
    args = parser.parse_args(argv)
    if args.func is cmd_serving:
        return cmd_serving(args, argv=None if argv is None else ["specserve", "bench", *argv])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

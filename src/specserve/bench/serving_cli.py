"""`specserve bench serving`: a concurrency sweep against an OpenAI-compatible server, written as a run JSON.

Its own module (beside acceptance_cli.py) because both `bench/cli.py` and `bench tune` use it: tune runs
`cmd_serving` once per served configuration.

Exit codes: 0 when the sweep finished and every level had at least one successful request (failed
requests are counted in the JSON, not fatal); 1 when the sweep finished but some level had no
successful request at all (the JSON is still written); 2 for unusable input (bad flags, a dataset
without a usable line, an unwritable --out).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

SCHEMA_VERSION = 1


def concurrency_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,4,16, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"concurrency levels must be integers >= 1, got {text!r}")
    return values


def add_serving_parser(subparsers: Any) -> None:
    """Adds `serving` to the `specserve bench` subparsers (an argparse _SubParsersAction)."""
    s = subparsers.add_parser("serving", help="concurrency sweep against an OpenAI-compatible server")
    s.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:30000 (a trailing /v1 is accepted)")
    s.add_argument("--model", required=True, help="model name the server serves (see GET /v1/models)")
    s.add_argument("--concurrency", type=concurrency_list, default=[1, 4, 16], help="levels, e.g. 1,4,16,30,64")
    s.add_argument("--num-prompts", type=int, default=64,
                   help="requests sent at every level (conversation datasets: conversations)")
    s.add_argument("--dataset", default="coding",
                   help="coding | random | agentic (multi-turn, over installed packages' source) | FILE.jsonl "
                        '(lines with "turns" are conversations)')
    s.add_argument("--agentic-file-chars", type=int, default=3000,
                   help="characters of each source file an agentic conversation shows as a tool result")
    s.add_argument("--random-input-len", type=int, default=128, help="words per prompt of --dataset random")
    s.add_argument("--output-len", type=int, default=128, help="max_tokens of every request")
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--seed", type=int, default=None, help="shuffles the dataset and is sent as the sampling seed")
    s.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    s.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="count a chunk's tokens by re-tokenizing its text, as SGLang's bench_serving does, when the "
                        "server sends neither usage nor logprobs per chunk (a checkpoint directory or 'demo'; "
                        "default: the served model's, where /server_info names a local checkpoint; 'none': one "
                        "token a chunk)")
    s.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    s.add_argument("--ignore-eos", action="store_true", help="ask for exactly --output-len tokens, if accepted")
    s.add_argument("--continuous-usage", action="store_true",
                   help="ask for usage in every chunk (exact tokens per chunk for ITL on vLLM-like servers)")
    s.add_argument("--request-timeout", type=float, default=600.0, help="seconds without progress before failing")
    s.add_argument("--no-warmup", action="store_true", help="skip the warm-up request")
    s.add_argument("--no-progress", action="store_true", help="no progress bars")
    s.add_argument("--out", required=True, type=Path, help="run JSON to write")
    s.set_defaults(func=cmd_serving)



def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _level_line(level: dict[str, Any]) -> str:
    def p50(key: str) -> float | None:
        stats = level[key]
        return stats["p50"] if stats else None

    line = (f"concurrency {level['concurrency']}: {level['completed']}/{level['num_requests']} ok, "
            f"{_fmt(level['request_throughput'], '.2f')} req/s, {_fmt(level['output_throughput'])} out tok/s, "
            f"TTFT p50 {_fmt(p50('ttft_ms'))} ms, TPOT p50 {_fmt(p50('tpot_ms'))} ms, "
            f"ITL p50 {_fmt(p50('itl_ms'))} ms, accept length {_fmt(level['accept_length'], '.2f')}")
    if "ttft_first_turn_ms" in level:  # a conversation level
        cache = level["prefix_cache"] or {}
        line += (f", TTFT p50 first/later turns {_fmt(p50('ttft_first_turn_ms'))}/"
                 f"{_fmt(p50('ttft_later_turns_ms'))} ms, prefix hit rate {_fmt(cache.get('hit_rate'), '.2f')}")
    return line


def chunk_counter(tokenizer: str | None, base_url: str, api_key: str | None) -> Callable[[str], int] | None:
    """Tokens of a chunk's text with `tokenizer`, else with the served model's tokenizer when `/server_info` names a
    checkpoint on this machine; None when neither is at hand (chunks then count 1). ValueError: a bad --tokenizer."""
    from specserve.models.loader import resolve_model_path
    from specserve.tokenizer import Tokenizer

    if tokenizer == "none":
        return None
    path = tokenizer
    if path is None:
        try:
            headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
            info = httpx.get(base_url.rstrip("/") + "/server_info", headers=headers, timeout=5).json()
            path = info.get("model_path") if isinstance(info, dict) else None
        except (httpx.HTTPError, ValueError):
            return None
        if not isinstance(path, str) or not Path(path, "tokenizer.json").is_file():
            return None
    try:
        tok = Tokenizer(resolve_model_path(path))
    except (OSError, ValueError) as e:
        raise ValueError(f"--tokenizer {path}: {e}") from None
    return lambda text: len(tok.encode(text))


def cmd_serving(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    from specserve.bench.datasets import load_dataset, sample_conversations, sample_prompts
    from specserve.bench.serving import run_sweep
    from specserve.bench.serving_client import ServingConfig

    try:
        cfg = ServingConfig(base_url=args.base_url, model=args.model, endpoint=args.endpoint,
                            output_len=args.output_len, temperature=args.temperature, seed=args.seed,
                            api_key=args.api_key, ignore_eos=args.ignore_eos, continuous_usage=args.continuous_usage,
                            request_timeout_s=args.request_timeout,
                            count_tokens=chunk_counter(args.tokenizer, args.base_url, args.api_key))
        seed = 0 if args.seed is None else args.seed
        dataset = load_dataset(args.dataset, args.num_prompts, seed, args.random_input_len, args.agentic_file_chars)
        conversations = sample_conversations(dataset, args.num_prompts, seed) if dataset.conversations else []
        prompts = [] if conversations else sample_prompts(dataset, args.num_prompts, seed)
    except ValueError as e:  # DatasetError included
        return _error(str(e))
    try:  # find an unusable --out before the sweep, not after it
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.touch()
    except OSError as e:
        return _error(f"--out {args.out}: cannot write ({e.strerror})")
    for problem in dataset.errors:
        print(f"warning: skipped dataset line {problem}", file=sys.stderr)
    started = datetime.now(timezone.utc).isoformat()
    result = asyncio.run(run_sweep(cfg, prompts, args.concurrency, warmup=not args.no_warmup,
                                   progress=not args.no_progress, conversations=conversations))
    run = {
        "kind": "serving",
        "schema_version": SCHEMA_VERSION,
        "command_line": argv if argv is not None else list(sys.argv),
        "started_at": started,
        "finished_at": datetime.now(timezone.utc).isoformat(),
        "config": {
            "base_url": cfg.base_url, "model": cfg.model, "endpoint": cfg.endpoint, "concurrency": args.concurrency,
            "num_prompts": args.num_prompts, "output_len": cfg.output_len, "temperature": cfg.temperature,
            "seed": args.seed, "ignore_eos": cfg.ignore_eos, "continuous_usage": cfg.continuous_usage,
            "request_timeout_s": cfg.request_timeout_s,
        },
        "dataset": {"name": dataset.name, "prompts_available": len(dataset.prompts),
                    "skipped_lines": len(dataset.errors), "errors": list(dataset.errors),
                    **({"conversations_available": len(dataset.conversations),
                        "turns_sent_per_level": sum(c.num_turns for c in conversations),
                        "agentic_file_chars": args.agentic_file_chars} if conversations else {})},
        **result,
    }
    try:
        args.out.write_text(json.dumps(run, indent=2) + "\n", encoding="utf-8")
    except OSError as e:
        return _error(f"--out {args.out}: cannot write ({e.strerror})")
    if result["warmup"] and result["warmup"]["note"]:
        print(f"warning: {result['warmup']['note']}", file=sys.stderr)
    for level in result["levels"]:
        print(_level_line(level))
        for message in level["error_messages"]:
            print(f"  error: {message}", file=sys.stderr)
    print(f"wrote {args.out}")
    dead = [lv["concurrency"] for lv in result["levels"] if lv["completed"] == 0]
    if dead:
        print(f"error: no request succeeded at concurrency {', '.join(map(str, dead))}", file=sys.stderr)
        return 1
    return 0

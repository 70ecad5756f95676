"""`specserve bench peers`: the flags of `bench/peers.py`'s run. Exit 0 on success, 2 on a bad flag or a failed
llama.cpp step (fetch, build, convert, a tool's run)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from specserve.bench.peers import PEERS, PeersConfig


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


D = PeersConfig()  # the flags' defaults are the config's


def add_peers_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("peers", help="llama.cpp, transformers and specserve on the same prompts, interleaved")
    p.add_argument("--model", default=D.model, help="`demo`, a Hugging Face checkpoint directory, `smollm2` or "
                   "FILE.gguf (with --dtype int4: llama.cpp runs the file, specserve its int4 quantization)")
    p.add_argument("--dtype", action="append", default=None,
                   help="float32 | bfloat16 | int4 (a GGUF model) (repeatable; default float32 and bfloat16)")
    p.add_argument("--threads", type=_ints, default=D.threads, help="thread counts, e.g. 1,2")
    p.add_argument("--batch", type=_ints, default=D.batches, help="batch sizes, e.g. 1,16")
    p.add_argument("--peers", default=",".join(D.peers), help=f"comma-separated subset of {','.join(PEERS)}")
    p.add_argument("--prompts", type=int, default=D.prompts, help="prompts decoded one by one at batch 1, per round")
    p.add_argument("--new-tokens", type=int, default=D.new_tokens)
    p.add_argument("--rounds", type=int, default=D.rounds)
    p.add_argument("--speculative", default=",".join(D.speculative),
                   help="speculative methods at batch 1, comma-separated: ngram (every peer's n-gram lookup) and "
                   "specserve's suffix, eagle3, dflash, standalone")
    p.add_argument("--no-speculative", action="store_true", help="plain decoding only (no speculative arms)")
    p.add_argument("--lookup-draft", type=int, default=D.lookup_draft, help="llama-lookup's --spec-draft-n-max")
    p.add_argument("--suite", default=D.suite,
                   help="prompts: coding10 | heldout-code | chat-coding (chat template applied) | FILE.jsonl")
    p.add_argument("--work", type=Path, default=D.work,
                   help="llama.cpp's sources and build (from the llama-cpp-python sdist on PyPI) and the GGUFs")
    p.add_argument("--out-dir", type=Path, required=True, help="peers.json, peers.md and peers.png")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_peers)


def cmd_peers(args: argparse.Namespace) -> int:
    from specserve.bench.llama_cpp import LlamaCppError
    from specserve.bench.peers import run

    try:
        cfg = PeersConfig(model=args.model, dtypes=tuple(args.dtype or D.dtypes), threads=args.threads,
                          batches=args.batch, peers=tuple(x.strip() for x in args.peers.split(",")),
                          prompts=args.prompts, new_tokens=args.new_tokens, rounds=args.rounds,
                          speculative=() if args.no_speculative else tuple(
                              m.strip().lower() for m in args.speculative.split(",") if m.strip()),
                          lookup_draft=args.lookup_draft, suite=args.suite,
                          work=args.work)
        report = run(cfg, args.out_dir, progress=not args.no_progress)
    except (ValueError, LlamaCppError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: report[k] for k in ("tokenizer_check", "matmul_floor_ms", "summary")}, indent=2))
    print(f"wrote {args.out_dir / 'peers.json'}, peers.md and peers.png", file=sys.stderr)
    return 0

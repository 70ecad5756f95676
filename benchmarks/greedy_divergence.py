"""How often greedy output of the batched engine differs from offline plain greedy decoding, per dtype.

    python benchmarks/greedy_divergence.py --model demo --dtype bfloat16 --config NGRAM --config EAGLE3 \\
        --config DFLASH --concurrency 16 --num-prompts 32 --output-len 64

In float32 (the CPU default) every path is exact, and the tests hold it to that. In bfloat16 a matrix
product over many rows (a verify forward, a batch) can round differently from a one-row product and flip a
near-tie argmax, after which the two outputs go separate ways: this counts how often, for plain batched
decoding (NONE) and each speculative configuration, in the engine's default (padded batch) mode and in its
batch-invariant mode (`--enable-deterministic-inference`: one row per forward). The reference is
`generate_plain` on each prompt alone, in the same dtype. Requests: the `coding` prompts (shuffled with seed
0, cycled), all submitted at once with at most --concurrency running, --output-len tokens each (ignore_eos),
every step verifying the full draft width (no adaptive policy: it would decide which steps verify at all).

Prints ONE JSON object: per configuration and mode, the number of requests identical to the reference, and
for the others the index of the first differing token (median, min).
A --config is `ALGO key=value ...` as in benchmarks/speculative.py.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys

import torch
from speculative import parse_config  # benchmarks/speculative.py (this script's folder is on sys.path)

from specserve.bench.datasets import load_dataset, sample_prompts
from specserve.engine.batch import BatchEngine
from specserve.engine.engine_config import EngineConfig
from specserve.engine.llm import LLM
from specserve.engine.plain import generate_plain
from specserve.types import SamplingParams


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def run_engine(llm: LLM, prompts: list[list[int]], params: SamplingParams, concurrency: int,
               batch_invariant: bool) -> list[list[int]]:
    config = EngineConfig(max_num_seqs=concurrency, batch_invariant=batch_invariant)
    eng = BatchEngine(llm.model, llm.eos_ids, llm.tokenizer.decode, config, llm.drafter_builder)
    tokens: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        eng.add_request(str(i), p, params)
        tokens[str(i)] = []
    while eng.has_unfinished:
        for out in eng.step():
            tokens[out.request_id] += out.new_token_ids
    return [tokens[str(i)] for i in range(len(prompts))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--config", action="append", default=[], help="e.g. 'NGRAM draft=12' (repeatable)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--modes", default="padded,invariant")
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    params = SamplingParams(max_new_tokens=a.output_len, ignore_eos=True)
    base = LLM(a.model, device="cpu", dtype=a.dtype)
    texts = [p.text for p in sample_prompts(load_dataset("coding", a.num_prompts, 0), a.num_prompts, 0)]
    prompts = [base.encode(t) for t in texts]
    reference = [generate_plain(base.model, [p], params, base.eos_ids, base.tokenizer.decode)[0].token_ids
                 for p in prompts]
    results: list[dict[str, object]] = []
    for text in ["NONE", *a.config]:
        llm = base if text == "NONE" else LLM(a.model, device="cpu", dtype=a.dtype,
                                               speculative=parse_config(text, a.model))
        for mode in a.modes.split(","):
            got = run_engine(llm, prompts, params, a.concurrency, batch_invariant=mode == "invariant")
            firsts = [d for d in (first_difference(g, r) for g, r in zip(got, reference, strict=True))
                      if d is not None]
            row: dict[str, object] = {
                "config": text, "mode": mode, "identical": f"{len(prompts) - len(firsts)}/{len(prompts)}",
                "first_difference_median": statistics.median(firsts) if firsts else None,
                "first_difference_min": min(firsts) if firsts else None,
            }
            print(json.dumps(row), file=sys.stderr)
            results.append(row)
    print(json.dumps({
        "benchmark": "greedy_divergence", "model": a.model, "dtype": str(base.dtype).removeprefix("torch."),
        "concurrency": a.concurrency, "num_prompts": len(prompts), "output_len": a.output_len,
        "threads": torch.get_num_threads(), "torch": torch.__version__, "machine": platform.machine(),
        "command_line": sys.argv, "results": results,
    }, indent=2))


if __name__ == "__main__":
    main()

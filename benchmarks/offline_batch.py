"""Offline generation: a batch of prompts vs the same prompts one by one, and the engine vs the old offline path.

    python benchmarks/offline_batch.py --model demo --config NONE --config NGRAM --config EAGLE3 \
        --config "DFLASH tree=ddtree draft=16" --rounds 3

Per config and round, interleaved, the order of the arms reversed every other round:
  batch    : `LLM.generate(prompts)`, the prompts as one continuous batch of the serving engine
  one_by_one: `LLM.generate([p])` for each prompt
  oracle   : the test oracles of `tests/reference_decoding.py` one by one (contiguous KV, one request at a
             time: what offline generation ran before it moved onto the serving engine)
on held-out real code (`heldout-pip`, greedy). Outputs must be identical across arms (printed per config).
Ratios are to the plain arm of the same kind in the same round (batch/one_by_one/oracle of NONE).
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from speculative import parse_config  # benchmarks/speculative.py (this script's folder is on sys.path)

from specserve.bench.acceptance import task_prompt
from specserve.bench.suites import load_suite
from specserve.engine.llm import LLM
from specserve.types import GenerationResult, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from reference_decoding import generate_plain, generate_speculative


def arms(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict[str, Any]:
    def oracle() -> list[GenerationResult]:
        b = llm.drafter_builder
        if b is None:
            return [generate_plain(llm.model, [p], params, llm.eos_ids, llm.tokenizer.decode)[0] for p in prompts]
        return [generate_speculative(llm.model, b.for_request, p, params, llm.eos_ids, b.max_tree_nodes,
                                     llm.tokenizer.decode) for p in prompts]

    return {
        "batch": lambda: llm.generate(prompts, params),
        "one_by_one": lambda: [llm.generate([p], params)[0] for p in prompts],
        "oracle": oracle,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo")
    ap.add_argument("--config", action="append", default=[], help="'NONE', 'NGRAM', 'DFLASH tree=ddtree draft=16'")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    configs = a.config or ["NONE", "NGRAM", "EAGLE3", "DFLASH tree=ddtree draft=16"]
    if "NONE" not in configs:
        configs = ["NONE", *configs]
    params = SamplingParams(max_new_tokens=a.max_new_tokens, ignore_eos=True)
    llms = {c: LLM(a.model, device="cpu", speculative=None if c == "NONE" else parse_config(c, a.model))
            for c in configs}
    tasks = load_suite("heldout-pip")[: a.num_prompts]
    prompts = [task_prompt(llms["NONE"], t) for t in tasks]
    runs = {c: arms(llm, prompts, SamplingParams(max_new_tokens=4, ignore_eos=True)) for c, llm in llms.items()}
    for fns in runs.values():  # warm-up: one-time allocations, RoPE tables, the engines' KV pools
        for fn in fns.values():
            fn()
    runs = {c: arms(llm, prompts, params) for c, llm in llms.items()}
    times: dict[str, dict[str, list[float]]] = {c: {k: [] for k in runs[c]} for c in configs}
    tokens: dict[str, dict[str, list[list[int]]]] = {c: {} for c in configs}
    accept: dict[str, float] = {}
    for r in range(a.rounds):
        order = configs if r % 2 == 0 else configs[::-1]
        for c in order:
            names = list(runs[c]) if r % 2 == 0 else list(runs[c])[::-1]
            for name in names:
                t0 = time.perf_counter()
                res = runs[c][name]()
                times[c][name].append(time.perf_counter() - t0)
                tokens[c][name] = [x.token_ids for x in res]
                if name == "batch":
                    steps = [n for x in res for n in x.accept_lengths]
                    accept[c] = sum(steps) / max(1, len(steps))
            print(f"round {r}: {c}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times[c].items()), file=sys.stderr)
    want = tokens["NONE"]["oracle"]
    n_tok = sum(len(t) for t in want)
    results = []
    for c in configs:
        med = {k: statistics.median(v) for k, v in times[c].items()}
        row: dict[str, Any] = {
            "config": c,
            "accept_length": round(accept[c], 4) if c != "NONE" else 1.0,
            "identical_to_plain_oracle": {k: v == want for k, v in tokens[c].items()},
            "tokens_per_s": {k: round(n_tok / v, 1) for k, v in med.items()},
            "batch_over_one_by_one": round(med["one_by_one"] / med["batch"], 3),
            "batch_over_one_by_one_rounds": [round(o / b, 3) for o, b in
                                             zip(times[c]["one_by_one"], times[c]["batch"], strict=True)],
            "one_by_one_over_oracle": round(med["oracle"] / med["one_by_one"], 3),
        }
        if c != "NONE":
            base = {k: statistics.median(v) for k, v in times["NONE"].items()}
            row["speedup_over_plain"] = {k: round(base[k] / med[k], 3) for k in med}
        results.append(row)
    print(json.dumps({
        "benchmark": "offline_batch", "model": a.model, "command_line": sys.argv, "num_prompts": len(prompts),
        "max_new_tokens": a.max_new_tokens, "rounds": a.rounds, "threads": torch.get_num_threads(),
        "torch": torch.__version__, "machine": platform.machine(), "results": results,
    }, indent=2))


if __name__ == "__main__":
    main()

"""Schema-constrained generation: plain vs each drafter, with and without forced-token drafts, and unconstrained.

    python benchmarks/grammar_speed.py --model demo --config NGRAM --config EAGLE3 --config DFLASH \
        --concurrency 1,16 --rounds 3

Per config and concurrency, interleaved, the order of the arms reversed every other round:
  constrained          : a strict JSON schema (compact JSON: keys and separators are forced tokens)
  constrained_noforced : the same without forced-token drafts (EngineConfig.grammar_forced_drafts off)
  unconstrained        : the same prompts without a grammar (other outputs: the drafter's cost without a mask)
  loose / loose_free   : printable-ASCII text (a grammar the demo's code satisfies) and no grammar: the same
                         outputs, so their ratio is what the masks cost where nothing is forced
The arms but constrained_noforced run on one engine (they differ only by request), so their ratios carry no
difference between two loaded copies of the model. The engines compile their decode steps (`engine/compiled.py`);
an untimed pass of every arm at every level builds them before the first round.
Concurrency 1 decodes the prompts one by one, concurrency C as batches of C (`LLM.generate`). Outputs of the two
constrained arms must be identical and equal plain constrained decoding's (greedy). Prints one JSON object with
tok/s per arm, ratios to plain constrained decoding, forced-draft speedup, accept length and mask time per token.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from typing import Any

import torch
from speculative import parse_config  # benchmarks/speculative.py (this script's folder is on sys.path)

from specserve.engine.engine_config import EngineConfig
from specserve.engine.llm import LLM
from specserve.types import GenerationResult, Grammar, SamplingParams

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "module": {"type": "string", "maxLength": 24},
    "kind": {"enum": ["function", "class", "constant"]},
    "args": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    "returns": {"type": "string", "maxLength": 16},
    "public": {"type": "boolean"},
    "line": {"type": "integer", "minimum": 1, "maximum": 9999},
}, "required": ["name", "module", "kind", "args", "returns", "public", "line"], "additionalProperties": False}
LOOSE = r"[\x20-\x7e\t\n]*"  # printable ASCII: binds nothing of the demo's code, yet masks every node
PROMPTS = [
    "def fizzbuzz(n):", "class Stack:", "import os\n", "def merge_sort(items):", "class LRUCache:",
    "def parse_args(argv):", "MAX_RETRIES = 3\n", "def read_config(path):", "class Node:", "def bfs(graph, start):",
    "def main():", "class Parser:", "def tokenize(text):", "TIMEOUT = 30\n", "def send(sock, data):", "class Tree:",
]


def run(llm: LLM, prompts: list[str], params: SamplingParams, c: int) -> list[GenerationResult]:
    out: list[GenerationResult] = []
    for i in range(0, len(prompts), c):
        out += llm.generate(prompts[i: i + c], params)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo")
    ap.add_argument("--config", action="append", default=[], help="'NGRAM', 'EAGLE3', 'DFLASH' (repeatable)")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    configs = ["NONE", *(a.config or ["NGRAM", "EAGLE3", "DFLASH"])]
    levels = [int(x) for x in a.concurrency.split(",")]
    grammar = Grammar("json_schema", json.dumps(SCHEMA), compact=True)
    constrained = SamplingParams(max_new_tokens=a.max_new_tokens, grammar=grammar)
    free = SamplingParams(max_new_tokens=a.max_new_tokens)
    loose = SamplingParams(max_new_tokens=a.max_new_tokens, grammar=Grammar("regex", LOOSE))
    arms: dict[str, tuple[LLM, SamplingParams]] = {}
    for cfg in configs:
        spec = None if cfg == "NONE" else parse_config(cfg, a.model)
        for forced in (True, False):
            if cfg == "NONE" and not forced:
                continue
            llm = LLM(a.model, device="cpu", speculative=spec,
                      engine_config=EngineConfig(kv_cache_gb=0.25, grammar_forced_drafts=forced))
            arms[f"{cfg} constrained" + ("" if forced else "_noforced")] = (llm, constrained)
        same = arms[f"{cfg} constrained"][0]  # one engine for the arms that differ only by request
        arms[f"{cfg} unconstrained"] = (same, free)
        arms[f"{cfg} loose"] = (same, loose)
        arms[f"{cfg} loose_free"] = (same, free)
    for llm, params in arms.values():  # warm-up: every compiled decode step the rounds meet is built here
        for c in levels:
            run(llm, PROMPTS, params, c)
    times: dict[tuple[str, int], list[float]] = {}
    outs: dict[tuple[str, int], list[GenerationResult]] = {}
    counted: dict[tuple[str, int], list[Any]] = {}
    for r in range(a.rounds):
        names = list(arms) if r % 2 == 0 else list(arms)[::-1]
        for c in levels:
            for name in names:
                llm, params = arms[name]
                cnt = next(iter(llm._engines.values())).counters
                before = (cnt.grammar_mask_s, cnt.forced_drafts)
                t0 = time.perf_counter()
                res = run(llm, PROMPTS, params, c)
                times.setdefault((name, c), []).append(time.perf_counter() - t0)
                outs[(name, c)] = res
                spent = counted.setdefault((name, c), [0.0, 0])  # this arm's share of its engine's counters
                spent[0] += cnt.grammar_mask_s - before[0]
                spent[1] += cnt.forced_drafts - before[1]
        print(f"round {r} done", file=sys.stderr)
    results: list[dict[str, Any]] = []
    for c in levels:
        want = [x.token_ids for x in outs[("NONE constrained", c)]]
        base = statistics.median(times[("NONE constrained", c)])
        for name in arms:
            res = outs[(name, c)]
            med = statistics.median(times[(name, c)])
            tokens = sum(x.num_tokens for x in res)
            steps = [n for x in res for n in x.accept_lengths]
            mask_s, forced = counted[(name, c)]
            row: dict[str, Any] = {
                "arm": name, "concurrency": c, "tokens": tokens, "tok_s": round(tokens / med, 1),
                "tok_s_rounds": [round(tokens / t, 1) for t in times[(name, c)]],
                "time_over_plain_constrained": round(med / base, 3),
                "accept_length": round(sum(steps) / max(1, len(steps)), 3),
                "mask_us_per_token": round(1e6 * mask_s / max(1, tokens * a.rounds), 1),
                "forced_drafts_per_round": forced // a.rounds,
            }
            if "constrained" in name and "unconstrained" not in name:
                row["identical_to_plain_constrained"] = [x.token_ids for x in res] == want
            if name.endswith(" loose"):
                twin = [x.token_ids for x in outs[(name + "_free", c)]]
                row["same_outputs_as_loose_free"] = sum(x.token_ids == y for x, y in zip(res, twin, strict=True))
            results.append(row)
    by = {(r["arm"], r["concurrency"]): r for r in results}
    summary = []
    for c in levels:
        for cfg in configs[1:]:
            f, n = by[(f"{cfg} constrained", c)], by[(f"{cfg} constrained_noforced", c)]
            u, p = by[(f"{cfg} unconstrained", c)], by[("NONE constrained", c)]
            lo, lf = by[(f"{cfg} loose", c)], by[(f"{cfg} loose_free", c)]
            summary.append({"config": cfg, "concurrency": c,
                            "forced_over_noforced": round(f["tok_s"] / n["tok_s"], 3),
                            "constrained_over_unconstrained": round(f["tok_s"] / u["tok_s"], 3),
                            "same_outputs_constrained_over_unconstrained": round(lo["tok_s"] / lf["tok_s"], 3),
                            "same_outputs_rounds": [round(x / y, 3) for x, y in
                                                    zip(lo["tok_s_rounds"], lf["tok_s_rounds"], strict=True)],
                            "forced_over_noforced_rounds": [round(x / y, 3) for x, y in
                                                            zip(f["tok_s_rounds"], n["tok_s_rounds"], strict=True)],
                            "same_outputs_prompts": f"{lo['same_outputs_as_loose_free']}/{len(PROMPTS)}",
                            # two arms of one engine with the same requests: the run's own A/A spread
                            "aa_unconstrained_over_loose_free": round(u["tok_s"] / lf["tok_s"], 3),
                            "constrained_over_plain_constrained": round(f["tok_s"] / p["tok_s"], 3)})
    print(json.dumps({"benchmark": "grammar_speed", "model": a.model, "command_line": sys.argv, "rounds": a.rounds,
                      "threads": torch.get_num_threads(), "torch": torch.__version__, "machine": platform.machine(),
                      "summary": summary, "results": results}, indent=2))


if __name__ == "__main__":
    main()

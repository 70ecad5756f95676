"""Compiled against eager decode steps, beside the matmul floor of the same weights.

    python benchmarks/decode_step.py --model demo --dtype float32 --dtype bfloat16 --config NGRAM --rounds 3

Per dtype, in one process: the floor (the target's projections and LM head at one row through `F.linear`, with the
weights as the engine stores them: `models/layout.py`); then, interleaved (the order reversed every other round),
greedy decoding of 128 tokens per prompt with compiled decode steps (`engine/compiled.py`) and with
--enforce-eager: plain at batch 1 (four prompts one by one), plain at batch 16 (one batch of 16), and each
`--config` drafter at batch 1. The compiled engines are built and warmed (every bucket the runs meet compiled)
before the first round; their compile seconds are reported. Outputs of the two arms are compared token for token.
Prints one JSON object: ms per token, tok/s, ratios compiled / eager and to the floor, batch-16 aggregate over
batch 1. `--device cuda` runs the same on a GPU (`benchmarks/gpu.sh`).
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

from specserve.bench.machine import cpu_info
from specserve.bench.peer_worker import matmul_floor_ms
from specserve.engine.engine_config import EngineConfig
from specserve.engine.llm import LLM
from specserve.types import SamplingParams

PROMPTS = ["def fizzbuzz(n):", "class Stack:", "import os\n", "def merge_sort(items):", "class LRUCache:",
           "def parse_args(argv):", "MAX_RETRIES = 3\n", "def read_config(path):", "class Node:",
           "def bfs(graph, start):", "def main():", "class Parser:", "def tokenize(text):", "TIMEOUT = 30\n",
           "def send(sock, data):", "class Tree:"]



def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo")
    ap.add_argument("--dtype", action="append", default=[], help="float32, bfloat16 (repeatable)")
    ap.add_argument("--config", action="append", default=[], help="a drafter at batch 1, e.g. 'NGRAM' (repeatable)")
    ap.add_argument("--quantization", default="none", help="none | int8 | int4 (weights)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cpu | cuda (compiled steps through inductor on either)")
    a = ap.parse_args()
    params = SamplingParams(max_new_tokens=a.max_new_tokens, ignore_eos=True)
    runs: list[dict[str, Any]] = []
    for dtype in a.dtype or ["float32"]:
        arms: dict[tuple[str, str], tuple[LLM, list[str], int]] = {}  # (workload, mode) -> llm, prompts, batch
        compile_s: dict[str, float] = {}
        for work in ["plain", *a.config]:
            spec = None if work == "plain" else parse_config(work, a.model)
            for mode in ("compiled", "eager"):
                llm = LLM(a.model, device=a.device, dtype=dtype, quantization=a.quantization, speculative=spec,
                          engine_config=EngineConfig(kv_cache_gb=0.25, enforce_eager=mode == "eager"))
                t0 = time.perf_counter()  # warm-up: compiles every bucket the runs meet
                llm.generate(PROMPTS, SamplingParams(max_new_tokens=a.max_new_tokens, ignore_eos=True))
                for p in PROMPTS[:4]:
                    llm.generate([p], params)
                if mode == "compiled":
                    compile_s[work] = round(time.perf_counter() - t0, 1)
                arms[(f"{work} c=1", mode)] = (llm, PROMPTS[:4], 1)
                if work == "plain":
                    arms[("plain c=16", mode)] = (llm, PROMPTS, 16)
        floor = matmul_floor_ms(arms[("plain c=1", "eager")][0].model)
        times: dict[tuple[str, str], list[float]] = {}
        tokens: dict[tuple[str, str], list[list[int]]] = {}
        for r in range(a.rounds):
            order = list(arms) if r % 2 == 0 else list(arms)[::-1]
            for key in order:
                llm, prompts, batch = arms[key]
                t0 = time.perf_counter()
                outs = [o for i in range(0, len(prompts), batch) for o in llm.generate(prompts[i:i + batch], params)]
                times.setdefault(key, []).append(time.perf_counter() - t0)
                tokens[key] = [o.token_ids for o in outs]
            print(f"{dtype}: round {r} done", file=sys.stderr)
        rows = []
        for work in dict.fromkeys(k for k, _ in arms):
            n_tok = sum(len(t) for t in tokens[(work, "eager")])
            per = {mode: [n_tok / t for t in times[(work, mode)]] for mode in ("compiled", "eager")}
            row: dict[str, Any] = {
                "workload": work,
                "tok_s": {m: round(statistics.median(v), 1) for m, v in per.items()},
                "tok_s_rounds": {m: [round(x, 1) for x in v] for m, v in per.items()},
                "compiled_over_eager": round(statistics.median(
                    [c / e for c, e in zip(per["compiled"], per["eager"], strict=True)]), 3),
                "same_tokens": tokens[(work, "compiled")] == tokens[(work, "eager")],
            }
            if work == "plain c=1":
                for m, v in per.items():
                    ms = 1e3 / statistics.median(v)
                    row[f"{m}_ms_per_token"] = round(ms, 3)
                    row[f"{m}_over_floor"] = round(ms / floor, 2)
            rows.append(row)
        by = {r["workload"]: r for r in rows}
        runs.append({"dtype": dtype, "matmul_floor_ms": round(floor, 3), "compile_s": compile_s,
                     "batch16_over_batch1": {m: round(by["plain c=16"]["tok_s"][m] / by["plain c=1"]["tok_s"][m], 2)
                                             for m in ("compiled", "eager")},
                     "results": rows})
    print(json.dumps({"benchmark": "decode_step", "model": a.model, "quantization": a.quantization,
                      "device": a.device, "cpu": cpu_info(),
                      "command_line": sys.argv, "rounds": a.rounds,
                      "threads": torch.get_num_threads(), "torch": torch.__version__, "machine": platform.machine(),
                      "runs": runs}, indent=2))


if __name__ == "__main__":
    main()

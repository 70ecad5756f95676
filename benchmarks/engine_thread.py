"""A plain decode step of the batched engine by where the model was loaded and where the steps run.

    python benchmarks/engine_thread.py --model demo --dtype bfloat16 --dtype float32 --threads 2

The server runs engine steps in a worker thread (the main thread serves HTTP). libgomp keeps an OpenMP team
for every thread that ran a parallel region, and with more OpenMP threads than cores it throttles its
spin-wait, so a model loaded on the main thread slows the worker's steps (`src/specserve/server/threads.py`).
Each placement runs in a fresh process (the teams live as long as their threads):
  main          load and steps on the main thread (offline `generate`, `bench acceptance`)
  worker        load on the main thread, steps in a worker thread (the server before the change)
  passing       load in a thread that ends, steps in a worker thread (the server now)
Per placement: --requests requests one after the other, each --output-len greedy tokens at batch 1 after a
3-step warm-up; the median step time over them. Placements run interleaved, --rounds times.
Prints ONE JSON object: per dtype and placement the median step (ms) per round, the median over rounds and
the ratio to `main`.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import threading
import time

PLACEMENTS = ("main", "worker", "passing")


def child(model: str, dtype: str, placement: str, requests: int, output_len: int, threads: int) -> float:
    import torch

    from specserve.bench.datasets import load_dataset, sample_prompts
    from specserve.engine.batch import BatchEngine
    from specserve.engine.engine_config import EngineConfig
    from specserve.engine.llm import LLM
    from specserve.server.threads import run_in_passing_thread
    from specserve.types import SamplingParams

    torch.set_num_threads(threads)

    def load() -> tuple[LLM, BatchEngine]:
        llm = LLM(model, device="cpu", dtype=dtype)
        return llm, BatchEngine(llm.model, llm.eos_ids, llm.tokenizer.decode, EngineConfig(max_num_seqs=1), None)

    steps_ms: list[float] = []

    def decode(llm: LLM, eng: BatchEngine) -> None:
        prompts = [llm.encode(p.text) for p in sample_prompts(load_dataset("coding", requests, 0), requests, 0)]
        for i, ids in enumerate(prompts):
            eng.add_request(str(i), ids, SamplingParams(max_new_tokens=output_len, ignore_eos=True))
            for _ in range(3):
                eng.step()
            while eng.has_unfinished:
                t = time.perf_counter()
                eng.step()
                steps_ms.append((time.perf_counter() - t) * 1e3)

    llm, eng = run_in_passing_thread(load) if placement == "passing" else load()
    if placement == "main":
        decode(llm, eng)
    else:
        worker = threading.Thread(target=decode, args=(llm, eng))
        worker.start()
        worker.join()
    return statistics.median(steps_ms)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--dtype", action="append", default=[], help="repeatable (default: bfloat16 and float32)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        dtype, placement = a.child.split(":")
        print(child(a.model, dtype, placement, a.requests, a.output_len, a.threads))
        return
    dtypes = a.dtype or ["bfloat16", "float32"]
    per: dict[str, dict[str, list[float]]] = {d: {p: [] for p in PLACEMENTS} for d in dtypes}
    for r in range(a.rounds):
        for d in dtypes:
            for p in PLACEMENTS:
                cmd = [sys.executable, __file__, "--model", a.model, "--threads", str(a.threads), "--requests",
                       str(a.requests), "--output-len", str(a.output_len), "--child", f"{d}:{p}"]
                ms = float(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.split()[-1])
                per[d][p].append(round(ms, 3))
                print(f"round {r + 1} {d} {p}: {ms:.2f} ms/step", file=sys.stderr)
    results = {}
    for d in dtypes:
        med = {p: statistics.median(v) for p, v in per[d].items()}
        results[d] = {p: {"step_ms_per_round": per[d][p], "step_ms": round(med[p], 3),
                          "ratio_to_main": round(med[p] / med["main"], 3)} for p in PLACEMENTS}
    print(json.dumps({"benchmark": "engine_thread", "model": a.model, "threads": a.threads,
                      "requests": a.requests, "output_len": a.output_len, "rounds": a.rounds,
                      "machine": platform.machine(), "command_line": sys.argv, "results": results}, indent=2))


if __name__ == "__main__":
    main()

"""Closed-loop concurrency levels against engines held in one process: the served benchmark without HTTP.

    python benchmarks/inprocess_levels.py --model demo --config NGRAM --modes fixed,adaptive \
        --concurrency 1,4 --num-prompts 32 --output-len 64 --rounds 3

`serving_concurrency.py` runs a server per configuration, one after the other, so the machine's drift (±20-35%
between minutes on a 2-core CPU) lands on one configuration and not the other; a policy change worth 5% is lost
in it. Here every engine (plain, and each --config fixed and/or adaptive, as `specserve serve` builds them) lives
in one process and the levels run interleaved: in each round, each level runs on every engine in turn. A level
keeps `c` requests in flight (a finished one is replaced at once, as the served benchmark's clients do) until
max(--num-prompts, 2c) requests of the coding prompts (shuffled with seed 0, cycled) have produced --output-len
tokens each (ignore_eos). No HTTP, no tokenization: what is left is the engine's own work, prefills included.
Adaptive engines keep their policy's state across levels and rounds, as a server does.

Prints ONE JSON object: per engine and level the output tok/s of every round, their median, and the median
over rounds of the per-round ratio to plain decoding; the share of decode steps that speculated; and per draft
width (0 = plain) the decode passes at the level's full batch and their median milliseconds (from each engine's
pass log): what a width costs in an engine that keeps to it against one that switches.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from speculative import parse_config  # benchmarks/speculative.py (this script's folder is on sys.path)

from specserve.bench.datasets import load_dataset, sample_prompts
from specserve.engine.batch import BatchEngine
from specserve.engine.engine_config import EngineConfig
from specserve.engine.llm import LLM
from specserve.engine.pass_log import PassLog, read_pass_log
from specserve.server.batch_serving import build_batch_engine
from specserve.types import SamplingParams


def run_level(eng: BatchEngine, prompts: list[list[int]], concurrency: int, output_len: int,
              temperature: float, tag: str) -> tuple[float, float]:
    """Output tok/s of a closed-loop level, and the share of its decode steps that speculated."""
    queue = list(enumerate(prompts))
    inflight = 0
    produced = 0
    steps0, spec0 = eng.counters.steps, eng.counters.spec_steps
    t0 = time.perf_counter()
    while queue or inflight:
        while queue and inflight < concurrency:
            i, p = queue.pop(0)
            params = SamplingParams(max_new_tokens=output_len, ignore_eos=True, temperature=temperature, seed=0)
            eng.add_request(f"{tag}-{i}", p, params)
            inflight += 1
        for out in eng.step():
            produced += len(out.new_token_ids)
            if out.finish_reason is not None:
                inflight -= 1
    seconds = time.perf_counter() - t0
    steps = eng.counters.steps - steps0
    return produced / seconds, (eng.counters.spec_steps - spec0) / max(steps, 1)


def measure(engines: dict[str, BatchEngine], encoded: dict[int, list[list[int]]], rounds: int, output_len: int,
            temperature: float) -> dict[str, object]:
    """Every level (a key of `encoded`: its prompts) on every engine, interleaved, `rounds` times; the report."""
    levels = list(encoded)
    for eng in engines.values():  # warm-up: one short level each
        run_level(eng, encoded[levels[0]][:2], 1, 8, temperature, "warm")
    tps: dict[str, dict[int, list[float]]] = {n: {c: [] for c in levels} for n in engines}
    spec: dict[str, dict[int, list[float]]] = {n: {c: [] for c in levels} for n in engines}
    passes: dict[str, dict[int, dict[int, list[float]]]] = {n: {c: {} for c in levels} for n in engines}
    with tempfile.TemporaryDirectory() as tmp:
        logs = [Path(tmp) / f"{i}.jsonl" for i in range(len(engines))]
        for eng, path in zip(engines.values(), logs, strict=True):
            eng.pass_log = PassLog(path)
        seen = dict.fromkeys(engines, 0)  # decode passes of each log already read
        for r in range(rounds):
            for c in levels:
                for (name, eng), path in zip(engines.items(), logs, strict=True):
                    rate, share = run_level(eng, encoded[c], c, output_len, temperature, f"r{r}c{c}")
                    tps[name][c].append(rate)
                    spec[name][c].append(share)
                    new = read_pass_log(path)[seen[name]:]
                    seen[name] += len(new)
                    for p in new:
                        if p["batch"] == c:
                            passes[name][c].setdefault(int(p["width"]), []).append(p["seconds"])
        for eng in engines.values():
            assert eng.pass_log is not None
            eng.pass_log.close()
            eng.pass_log = None
    out: dict[str, object] = {"rounds": rounds, "output_len": output_len, "temperature": temperature}
    for name in engines:
        out[name] = {f"c={c}": {
            "tok_s": [round(x, 1) for x in tps[name][c]],
            "median_tok_s": round(statistics.median(tps[name][c]), 1),
            "ratio": round(statistics.median(x / y for x, y in zip(tps[name][c], tps["NONE"][c], strict=True)), 3),
            "speculating": round(statistics.mean(spec[name][c]), 3),
            "pass_ms": {w: [len(t), round(1e3 * statistics.median(t), 2)] for w, t in sorted(passes[name][c].items())},
        } for c in levels}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--config", action="append", default=[], help="ALGO key=value ... (speculative.py's syntax)")
    ap.add_argument("--modes", default="adaptive", help="fixed, adaptive or both (comma-separated)")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    levels = [int(c) for c in a.concurrency.split(",")]
    modes = a.modes.split(",")
    if not levels or min(levels) < 1 or not set(modes) <= {"fixed", "adaptive"}:
        raise ValueError("--concurrency needs levels >= 1 (e.g. 1,4); --modes is fixed, adaptive or both")
    base = LLM(a.model)
    dataset = load_dataset("coding", a.num_prompts, 0)
    encoded = {c: [base.encode(p.text) for p in sample_prompts(dataset, max(a.num_prompts, 2 * c), 0)]
               for c in levels}
    engines = {"NONE": build_batch_engine(base, EngineConfig(), adaptive=False)}
    for cfg in a.config:
        llm = LLM(a.model, speculative=parse_config(cfg, a.model))
        for mode in modes:
            engines[f"{cfg} {mode}"] = build_batch_engine(llm, EngineConfig(),
                                                          adaptive=mode == "adaptive")
    print(json.dumps(measure(engines, encoded, a.rounds, a.output_len, a.temperature), indent=1))


if __name__ == "__main__":
    main()

"""The drafter's dtype: the same speculative configuration with its drafter in float32 and in bfloat16, same run.

    python benchmarks/draft_dtype.py --config DFLASH --config EAGLE3 --concurrency 1,16 --rounds 4

On CPU the target runs in float32 (the exact mode: a verify pass must round like plain decoding). The drafter only
proposes, so its dtype changes speed and, through rounding, maybe acceptance, never the output. On a CPU with
native bf16 matrix units (AMX), a product of a block or tree of rows runs 2-6x faster in bf16 than in float32,
and a one-row product ~2x slower. Engines (all in one process, `inprocess_levels.py`'s closed-loop levels with
--lockstep: every engine runs the level at once, one step each in turn, so the machine's drift is the same for
all): plain decoding, and per --config the drafter in float32 and in bfloat16, each verifying its full width
every step (`--no-speculative-adaptive`: the drafter drafts every step, so its cost is what differs).

Prints ONE JSON object: per engine and level the output tok/s of every round, their median, the median of the
per-round ratios to plain decoding, and the mean accept length (bonus token included) over the run; per --config
and level `bf16_over_fp32`, the median of the per-round ratios of the bf16 engine's tok/s to the float32 one's.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics

import torch
from inprocess_levels import measure  # benchmarks/inprocess_levels.py (this script's folder is on sys.path)
from speculative import parse_config

from specserve.bench.datasets import load_dataset, sample_prompts
from specserve.engine.batch import BatchEngine
from specserve.engine.engine_config import EngineConfig
from specserve.engine.llm import LLM, cpu_has_native_bf16
from specserve.server.batch_serving import build_batch_engine

DTYPES = ("float32", "bfloat16")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--config", action="append", default=[], help="ALGO key=value ... (speculative.py's syntax)")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    levels = [int(c) for c in a.concurrency.split(",")]
    configs = a.config or ["DFLASH"]
    base = LLM(a.model)
    dataset = load_dataset("coding", a.num_prompts, 0)
    encoded = {c: [base.encode(p.text) for p in sample_prompts(dataset, max(a.num_prompts, 2 * c), 0)]
               for c in levels}
    engines: dict[str, BatchEngine] = {"NONE": build_batch_engine(base, EngineConfig(), adaptive=False)}
    for cfg in configs:
        for dtype in DTYPES:
            llm = LLM(a.model, speculative=parse_config(cfg, a.model), draft_dtype=dtype)
            engines[f"{cfg} @{dtype}"] = build_batch_engine(llm, EngineConfig(), adaptive=False)
    report = measure(engines, encoded, a.rounds, a.output_len, a.temperature, lockstep=True)
    for name, eng in engines.items():
        c = eng.counters
        if c.verify_rounds:
            report[name]["accept_length"] = round(c.accept_sum / c.verify_rounds, 3)  # type: ignore[index]
    for cfg in configs:
        fp32, bf16 = (report[f"{cfg} @{d}"] for d in DTYPES)
        report[f"{cfg} bf16_over_fp32"] = {
            level: round(statistics.median(x / y for x, y in zip(bf16[level]["tok_s"], fp32[level]["tok_s"],  # type: ignore[index]
                                                                  strict=True)), 3)
            for level in fp32 if level.startswith("c=")  # type: ignore[union-attr]
        }
    report["machine"] = platform.processor() or platform.machine()
    report["native_bf16"] = cpu_has_native_bf16()
    report["threads"] = torch.get_num_threads()
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

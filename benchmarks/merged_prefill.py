"""Short prefill chunks in the decode forward (`BatchEngine._merges`) against a forward of their own, same run.

    python benchmarks/merged_prefill.py --config EAGLE3 --concurrency 16 --rounds 3 --modes fixed

Speculation desynchronises requests: each one finishes when its acceptance lets it, and its replacement (a
closed-loop client sends the next request at once) needs a prefill. Run alone, a prefill of the few tokens a
prefix-cache hit leaves costs a forward (6.5 ms for 6 tokens on the demo here, against 10.8 ms for a plain
decode pass of 16 requests); merged, its tokens join the decode forward (packed rows, `engine/runner.py`).
Two engines of one configuration, one with the merge and one without, run a closed-loop level in lockstep
(`inprocess_levels.measure` with lockstep: one step of each in turn, each timed over its own steps, the order
reversed every other round, beside plain decoding, which `measure` takes as the baseline), --rounds times;
the level sends 8 requests per concurrent client of the built-in coding prompts (their first KV block
prefix-cached after the first round, as served).

Prints ONE JSON object: plain decoding's tok/s per round; per engine the level's tok/s in every round and,
from the engines' pass logs, the separate prefill passes, the merged prefill chunks, the seconds of prefill
passes and of decode passes; and `merge_over_separate`, the per-round ratios of the two engines' tok/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from inprocess_levels import measure  # benchmarks/inprocess_levels.py (this script's folder is on sys.path)
from speculative import parse_config

from specserve.bench.datasets import load_dataset, sample_prompts
from specserve.engine.batch import BatchEngine
from specserve.engine.engine_config import EngineConfig
from specserve.engine.llm import LLM
from specserve.engine.pass_log import read_pass_log
from specserve.server.batch_serving import build_batch_engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--config", default="EAGLE3", help="ALGO key=value ... (speculative.py's syntax), or NONE")
    ap.add_argument("--modes", default="fixed", choices=("fixed", "adaptive"))
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    base = LLM(a.model)
    c = a.concurrency
    prompts = [base.encode(p.text) for p in sample_prompts(load_dataset("coding", 32, 0), 8 * c, 0)]
    llm = base if a.config.upper() == "NONE" else LLM(a.model, speculative=parse_config(a.config, a.model))
    engines: dict[str, BatchEngine] = {"NONE": build_batch_engine(base, EngineConfig(), adaptive=False)}
    for name in ("merge", "separate"):
        engines[name] = build_batch_engine(llm, EngineConfig(), adaptive=a.modes == "adaptive")
    engines["separate"]._merges = lambda plan: False  # type: ignore[method-assign]
    report: dict[str, object] = {"config": a.config, "mode": a.modes, "concurrency": c}
    with tempfile.TemporaryDirectory() as tmp:
        levels = measure(engines, {c: prompts}, a.rounds, a.output_len, 0.0, keep_logs=Path(tmp), lockstep=True)
        rates = {name: levels[name][f"c={c}"]["tok_s"] for name in engines}  # type: ignore[index]
        report["plain_tok_s"] = rates["NONE"]
        for i, name in enumerate(engines):
            if name == "NONE":
                continue
            passes = read_pass_log(Path(tmp) / f"{i:02d}-{name}.passes.jsonl", kind=None)
            prefills = [p for p in passes if p["kind"] == "prefill"]
            report[name] = {
                "tok_s": rates[name],
                "prefill_passes": sum(not p.get("merged") for p in prefills),
                "merged_chunks": sum(int(p["batch"]) for p in prefills if p.get("merged")),
                "prefill_s": round(sum(p["seconds"] for p in prefills), 3),
                "decode_s": round(sum(p["seconds"] for p in passes if p["kind"] == "decode"), 3),
            }
    ratios = [x / y for x, y in zip(rates["merge"], rates["separate"], strict=True)]
    report["merge_over_separate"] = [round(x, 3) for x in ratios]
    report["median_merge_over_separate"] = round(statistics.median(ratios), 3)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

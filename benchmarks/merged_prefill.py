"""Short prefill chunks in the decode forward (`BatchEngine._merges`) against a forward of their own, same run.

    python benchmarks/merged_prefill.py --config EAGLE3 --concurrency 16 --rounds 3 --modes fixed

Speculation desynchronises requests: each one finishes when its acceptance lets it, and its replacement (a
closed-loop client sends the next request at once) needs a prefill. Run alone, a prefill of the few tokens a
prefix-cache hit leaves costs a forward (6.5 ms for 6 tokens on the demo here, against 10.8 ms for a plain
decode pass of 16 requests); merged, its tokens join the decode forward (packed rows, `engine/runner.py`).
Two engines of one configuration, one with the merge and one without, run a closed-loop level in lockstep
(`inprocess_levels.run_lockstep`: one step of each in turn, each timed over its own steps), --rounds times;
the level sends 8 requests per concurrent client of the built-in coding prompts (their first KV block
prefix-cached after the first round, as served).

Prints ONE JSON object: per engine the level's tok/s in every round and, from the engines' pass logs, the
separate prefill passes, the merged prefill chunks, the seconds of prefill passes and of decode passes; and
`merge_over_separate`, the per-round ratios of the two engines' tok/s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from inprocess_levels import run_level, run_lockstep  # benchmarks/inprocess_levels.py
from speculative import parse_config

from specserve.bench.datasets import load_dataset, sample_prompts
from specserve.engine.engine_config import EngineConfig
from specserve.engine.llm import LLM
from specserve.engine.pass_log import PassLog, read_pass_log
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
    prompts = [base.encode(p.text) for p in sample_prompts(load_dataset("coding", 32, 0), 8 * a.concurrency, 0)]
    llm = base if a.config.upper() == "NONE" else LLM(a.model, speculative=parse_config(a.config, a.model))
    report: dict[str, object] = {"config": a.config, "mode": a.modes, "concurrency": a.concurrency}
    with tempfile.TemporaryDirectory() as tmp:
        engines = {}
        for name in ("merge", "separate"):
            eng = build_batch_engine(llm, EngineConfig(), adaptive=a.modes == "adaptive")
            if name == "separate":
                eng._merges = lambda plan: False  # type: ignore[method-assign]
            eng.pass_log = PassLog(Path(tmp) / f"{name}.jsonl")
            run_level(eng, prompts[:2], 1, 8, 0.0, "warm")
            engines[name] = eng
        rates: dict[str, list[float]] = {name: [] for name in engines}
        for r in range(a.rounds):
            results = run_lockstep(list(engines.values()), prompts, a.concurrency, a.output_len, 0.0, f"r{r}")
            for name, (rate, _) in zip(engines, results, strict=True):
                rates[name].append(rate)
        for name, eng in engines.items():
            assert eng.pass_log is not None
            eng.pass_log.close()
            passes = read_pass_log(Path(tmp) / f"{name}.jsonl", kind=None)
            prefills = [p for p in passes if p["kind"] == "prefill"]
            report[name] = {
                "tok_s": [round(x, 1) for x in rates[name]],
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

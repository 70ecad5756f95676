"""What padding tall products to a few heights costs a prefill (`layers/quant.py: padded_rows`).

    python benchmarks/prefill_heights.py --model smollm2 --lengths 40,100,257,300,600,1000 --rounds 5

One process, one eager engine without prefix cache: per prompt length, the time of a prefill (a request of
`max_new_tokens=1`) with the products padded (the default) and at their exact heights, each shape warmed first in
both modes, the two modes alternated and their order reversed every round. Prompts are the first L tokens of a
standard-library source file. Prints ONE JSON object: per length the median ms of each mode and the median of the
per-round ratios padded / exact.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time

from specserve.engine.llm import LLM
from specserve.layers import quant
from specserve.types import SamplingParams

EXACT = 1 << 30  # a threshold no product reaches: every product at its own height


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--lengths", default="40,100,257,300,600,1000")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    llm = LLM(args.model, enforce_eager=True, prefix_cache=False)
    text = inspect.getsource(argparse)
    ids = llm.encode(text)
    if len(ids) < max(lengths):
        ap.error(f"--lengths: the source text has {len(ids)} tokens, fewer than {max(lengths)}")
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    default = quant.EXACT_ROWS
    padded = {length: quant.padded_rows(length) for length in lengths}  # the height each prompt's products run at

    def prefill_ms(length: int, pad: bool) -> float:
        quant.EXACT_ROWS = default if pad else EXACT  # read by padded_rows at each product
        t0 = time.perf_counter()
        llm.generate([ids[:length]], params)
        return (time.perf_counter() - t0) * 1e3

    results = {}
    try:
        for length in lengths:
            prefill_ms(length, True), prefill_ms(length, False)  # warm both modes' oneDNN primitives
            times: dict[str, list[float]] = {"padded": [], "exact": []}
            for r in range(args.rounds):
                for mode in (("padded", "exact") if r % 2 == 0 else ("exact", "padded")):
                    times[mode].append(prefill_ms(length, mode == "padded"))
            ratios = [p / e for p, e in zip(times["padded"], times["exact"], strict=True)]
            results[length] = {"padded_rows": padded[length], "padded_ms": round(statistics.median(times["padded"]), 2),
                               "exact_ms": round(statistics.median(times["exact"]), 2),
                               "ratio_padded_over_exact": round(statistics.median(ratios), 3),
                               "ratios": [round(x, 3) for x in ratios]}
            print(json.dumps({length: results[length]}), file=sys.stderr, flush=True)
    finally:
        quant.EXACT_ROWS = default
    print(json.dumps({"model": args.model, "rounds": args.rounds, "lengths": results,
                      "command": " ".join(["python", *sys.argv])}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

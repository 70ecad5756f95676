"""Drawing tokens: `layers.sampling.sample` (inverse CDF) against `torch.multinomial`, same rows, same run.

    python benchmarks/sampling.py --vocab 8192 --rows 1,17,32 --threads 1

Rows are processed target distributions (softmax of random logits at --temperature, as `target_probs` gives):
1 row is a plain decoding step of one request, 17 the rows of a 16-node draft tree verified by sampling.
Each timing is the median of --repeats batches of --calls calls. Also checks the two agree in distribution
(total variation between their empirical frequencies on one row over --draws draws, reported, not asserted).

Prints ONE JSON object: per row count, microseconds per call of each and their ratio.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from specserve.layers.sampling import sample


def per_call_us(fn: Callable[[], object], calls: int, repeats: int) -> float:
    fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--rows", default="1,17,32")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--draws", type=int, default=20000)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(0)
    results = {}
    for n in (int(r) for r in a.rows.split(",")):
        probs = torch.softmax(torch.randn(n, a.vocab, generator=gen) / a.temperature, dim=-1)  # [n, V]
        ours = per_call_us(partial(sample, probs, gen), a.calls, a.repeats)
        base = per_call_us(partial(torch.multinomial, probs, 1, generator=gen), a.calls, a.repeats)
        results[str(n)] = {"sample_us": round(ours, 1), "multinomial_us": round(base, 1),
                           "speedup": round(base / ours, 2)}
    row = torch.softmax(torch.randn(1, 64, generator=gen) / a.temperature, dim=-1)  # a small vocabulary
    ours_f = torch.bincount(torch.cat([sample(row, gen) for _ in range(a.draws)]), minlength=64) / a.draws
    base_f = torch.bincount(torch.multinomial(row[0], a.draws, replacement=True, generator=gen), minlength=64) / a.draws
    print(json.dumps({
        "benchmark": "sampling", "vocab": a.vocab, "temperature": a.temperature, "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(), "torch": torch.__version__, "rows": results,
        "total_variation_64_tokens": round(0.5 * float((ours_f - base_f).abs().sum()), 4),
        "total_variation_each_vs_exact": [round(0.5 * float((f - row[0]).abs().sum()), 4) for f in (ours_f, base_f)],
    }, indent=1))


if __name__ == "__main__":
    main()

"""The SUFFIX drafter's shared cache under a stream of finished requests: the longest single `add` (a rebuild
must not stall the engine thread), the mean add, the cache's size.

    python benchmarks/suffix_cache.py --requests 2400 --max-cached 1000 --output-len 500

Random outputs over the demo's 8192 ids (the worst case for the automaton: few shared substrings). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from specserve.speculative.suffix_index import REBUILD_RATE, SuffixCache


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=2400)
    ap.add_argument("--max-cached", type=int, default=1000)
    ap.add_argument("--output-len", type=int, default=500)
    ap.add_argument("--vocab", type=int, default=8192)
    a = ap.parse_args()
    rng = random.Random(0)
    cache = SuffixCache(max_requests=a.max_cached)
    times = []
    t_all = time.perf_counter()
    for _ in range(a.requests):
        out = [rng.randrange(a.vocab) for _ in range(a.output_len)]
        t = time.perf_counter()
        cache.add(out)
        times.append(time.perf_counter() - t)
    times.sort()
    print(json.dumps({
        "benchmark": "suffix_cache", "command_line": sys.argv, "rebuild_rate": REBUILD_RATE,
        "live_tokens": cache.stats()["live_tokens"], "rebuilds": cache.generation,
        "max_add_s": round(times[-1], 3), "p99_add_ms": round(1e3 * times[int(0.99 * len(times))], 2),
        "mean_add_ms": round(1e3 * sum(times) / len(times), 2), "total_s": round(time.perf_counter() - t_all, 1),
        "cache_mb": round(cache.stats()["bytes"] / 2**20, 1),
    }, indent=2))


if __name__ == "__main__":
    main()

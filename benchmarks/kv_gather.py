"""Reading a batch's keys/values out of the paged KV pool: advanced indexing against `index_select`, same run.

    python benchmarks/kv_gather.py --threads 2

`PagedView.update` gathers, per layer, the K and V slots each row attends over: a [B, K] slot index into the
pool [S, Hkv, D]. For each (B, K) — one request at short and long contexts, 16 and 32 requests — the median
microseconds of `pool[index]` (advanced indexing) and of `pool.index_select(0, index.view(-1)).view(B, K, Hkv,
D)` (what the engine uses), alternated in --blocks blocks, and whether both return the same tensor.

Prints ONE JSON object: per shape both timings and their ratio (> 1: index_select is faster).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from timing import timed  # benchmarks/timing.py (this script's folder is on sys.path)

from specserve.config import ModelConfig
from specserve.models.loader import resolve_model_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--slots", type=int, default=116_496, help="pool size (the demo server's default pool)")
    ap.add_argument("--shapes", default="1x100,1x300,16x200,32x250,32x600", help="BxK, comma-separated")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--blocks", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    cfg = ModelConfig.from_file(resolve_model_path(a.model) / "config.json")
    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(a.slots + 1, cfg.num_key_value_heads, cfg.head_dim, generator=gen)
    out: dict[str, dict[str, float | bool]] = {}
    with torch.inference_mode():
        for shape in a.shapes.split(","):
            b, k = (int(x) for x in shape.split("x"))
            index = torch.randint(0, a.slots, (b, k), generator=gen)

            def advanced(index: torch.Tensor = index) -> torch.Tensor:
                return pool[index]

            def select(index: torch.Tensor = index, b: int = b, k: int = k) -> torch.Tensor:
                return pool.index_select(0, index.view(-1)).view(b, k, *pool.shape[1:])

            times: dict[str, list[float]] = {"advanced": [], "index_select": []}
            for _ in range(a.blocks):
                for name, fn in (("advanced", advanced), ("index_select", select)):
                    fn()
                    times[name].append(timed(fn, a.repeats))
            adv, sel = statistics.median(times["advanced"]), statistics.median(times["index_select"])
            out[shape] = {"advanced_us": round(adv * 1e6, 1), "index_select_us": round(sel * 1e6, 1),
                          "advanced_over_index_select": round(adv / sel, 3),
                          "equal": bool(torch.equal(advanced(), select()))}
    print(json.dumps({"benchmark": "kv_gather", "model": a.model, "threads": torch.get_num_threads(),
                      "pool_slots": a.slots, "shapes": out}, indent=1))


if __name__ == "__main__":
    main()

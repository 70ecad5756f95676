"""Projection products with the weight stored row-major (`nn.Linear`'s default) against column-major
(`specserve.models.layout.column_major_projections`, what the engine uses on CPU), same run, interleaved.

    python benchmarks/linear_layout.py --model demo --rows 1,17,32,160 --threads 2

For each distinct projection shape of --model (the fused qkv, o, fused gate/up and down projections, and the
LM head, which the engine keeps in both layouts and reads column-major for `layout.FEW_ROWS` rows: `--rows
1,2,3,4,8,12,16,17,24,32,64,160,256`) and each row count (1: a plain decode step of one request; 17: a
DDTree of 16 drafts; 160: 32 requests verifying 4 drafts), the median time of `F.linear` over --repeats
calls in both layouts, alternated in --blocks blocks so that a drift of the machine's speed hits both alike,
and whether the two results agree (max abs difference; the layouts sum in different orders).

Prints ONE JSON object: per shape and row count the microseconds of each layout and row/column (> 1: the
column-major product is faster).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics

import torch
import torch.nn.functional as F
from timing import timed  # benchmarks/timing.py (this script's folder is on sys.path)

from specserve.engine.llm import LLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--rows", default="1,17,32,160")
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--blocks", type=int, default=9)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    llm = LLM(a.model, device="cpu")
    shapes: dict[str, tuple[int, ...]] = {}
    for name, mod in llm.model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            shapes.setdefault(name.split(".")[-1], tuple(mod.weight.shape))
    rows = [int(r) for r in a.rows.split(",")]
    gen = torch.Generator().manual_seed(0)
    out: dict[str, dict[str, dict[str, float]]] = {}
    with torch.inference_mode():
        for name, (n, k) in shapes.items():
            w_row = torch.randn(n, k, generator=gen, dtype=llm.dtype)
            w_col = w_row.t().contiguous().t()
            out[f"{name} {k}->{n}"] = cell = {}
            for m in rows:
                x = torch.randn(m, k, generator=gen, dtype=llm.dtype)
                times: dict[str, list[float]] = {"row": [], "col": []}
                for _ in range(a.blocks):
                    for tag, w in (("row", w_row), ("col", w_col)):
                        F.linear(x, w)  # warm
                        times[tag].append(timed(lambda w=w, x=x: F.linear(x, w), a.repeats))
                r, c = statistics.median(times["row"]), statistics.median(times["col"])
                diff = float((F.linear(x, w_row) - F.linear(x, w_col)).abs().max())
                cell[str(m)] = {"row_us": round(r * 1e6, 1), "col_us": round(c * 1e6, 1),
                                "row_over_col": round(r / c, 3), "max_abs_diff": diff}
    print(json.dumps({"benchmark": "linear_layout", "model": a.model, "dtype": str(llm.dtype), "threads":
                      torch.get_num_threads(), "machine": platform.machine(), "torch": torch.__version__,
                      "shapes": out}, indent=1))


if __name__ == "__main__":
    main()

"""One DFlash drafting round (`propose` / `propose_many`): the LM head over the first LAZY_ROWS block rows
(and the rest only for trees that reach them) against the LM head over every row, same run, interleaved.

    python benchmarks/dflash_propose.py --batch 1,16 --threads 2

Each of --batch requests holds one of the bundled `heldout-code` contexts (real target states, captured by a
prefill of the demo target), roots at its greedy next token, and drafts a DDTree of the default budget with
the bundled drafter, greedily and at --temperature (drawn drafts). Also reports how many of the trees reached
row LAZY_ROWS (those pay a second LM-head product). Median of --repeats, after --warmup untimed rounds.

Prints ONE JSON object: per (batch, temperature), milliseconds per round of each and their ratio.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import specserve.speculative.dflash.drafter as dflash
from specserve.bench.suites import load_suite
from specserve.config import SpeculativeConfig
from specserve.engine.llm import LLM
from specserve.models.llama import CausalLM
from specserve.speculative.dflash.checkpoint import load_dflash
from specserve.types import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="1,16", help="comma-separated numbers of requests drafting together")
    ap.add_argument("--temperature", type=float, default=0.7, help="the sampled case (greedy is always measured)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10, help="untimed rounds first (allocations, caches)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    llm = LLM("demo")
    target = llm.model
    assert isinstance(target, CausalLM)
    spec = SpeculativeConfig.resolve("DFLASH", "demo-dflash")
    draft = load_dflash("demo-dflash", target.config, torch.device("cpu"), torch.float32)
    contexts = []
    with torch.inference_mode():
        for task in load_suite("heldout-code"):
            ids = llm.encode(task.prompt)
            out = target(torch.tensor([ids]), torch.arange(len(ids))[None], capture=draft.config.capture)
            contexts.append((ids, torch.cat(out.captured, dim=-1)[0], int(out.logits[0, -1].argmax())))
    lazy, full = dflash.LAZY_ROWS, draft.config.block_size - 1
    results = []
    for b in (int(x) for x in a.batch.split(",")):
        for temperature in (0.0, a.temperature):
            drafters = []
            for i in range(b):
                ids, hidden, _ = contexts[i % len(contexts)]
                params = SamplingParams(temperature=temperature, seed=i)
                d = dflash.DFlashDrafter(draft, target, spec, params, torch.Generator().manual_seed(i), len(ids) + 64)
                d.prefill(ids, hidden)
                drafters.append(d)
            roots = [contexts[i % len(contexts)][2] for i in range(b)]
            times: dict[str, list[float]] = {"lazy": [], "all_rows": []}
            deep = 0
            with torch.inference_mode():
                for _ in range(a.warmup):
                    if b == 1:
                        drafters[0].propose(roots[0])
                    else:
                        dflash.DFlashDrafter.propose_many(drafters, roots, [None] * b)
                for _ in range(a.repeats):
                    for name, rows in (("lazy", lazy), ("all_rows", full)):
                        dflash.LAZY_ROWS = rows
                        t0 = time.perf_counter()
                        trees = (drafters[0].propose(roots[0]) if b == 1 else
                                 dflash.DFlashDrafter.propose_many(drafters, roots, [None] * b))
                        times[name].append(time.perf_counter() - t0)
                        trees = trees if isinstance(trees, list) else [trees]
                        if name == "lazy":
                            deep += sum(int(t.depths.max()) >= lazy for t in trees)
            dflash.LAZY_ROWS = lazy
            ms = {k: round(statistics.median(v) * 1e3, 2) for k, v in times.items()}
            results.append({"batch": b, "temperature": temperature, "ms": ms,
                            "all_rows_over_lazy": round(ms["all_rows"] / ms["lazy"], 3),
                            "trees_reaching_lazy_rows": round(deep / (b * a.repeats), 3)})
    print(json.dumps({"kind": "dflash_propose", "lazy_rows": lazy, "threads": a.threads,
                      "machine": platform.processor() or platform.machine(), "results": results}, indent=1))


if __name__ == "__main__":
    main()

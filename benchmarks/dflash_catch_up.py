"""DFlash catch-up: a batch of drafters taking in the context queued while the engine decoded plainly.

    python benchmarks/dflash_catch_up.py --batch 16,32 --queued 8,64 --threads 2

Each of --batch drafters (the bundled demo drafter on the demo target, a 200-token context already cached)
has --queued target states waiting (one per plainly decoded token). Timed, same run, alternating: each
drafter projecting its own queue (`DFlashDrafter._flush`, one forward per request) and the whole batch in
one padded forward (`dflash._flush_many`, what a speculating step now does). Median of --repeats.

Prints ONE JSON object: per (batch, queued), milliseconds of each and their ratio.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from specserve.config import SpeculativeConfig
from specserve.models.llama import CausalLM
from specserve.models.loader import load_model
from specserve.speculative.dflash.checkpoint import load_dflash
from specserve.speculative.dflash.drafter import DFlashDrafter, _flush_many
from specserve.types import SamplingParams

CONTEXT = 200


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="16,32", help="comma-separated numbers of drafters")
    ap.add_argument("--queued", default="8,64", help="comma-separated queued tokens per drafter")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    target, cfg, _ = load_model("demo", torch.device("cpu"), torch.float32)
    assert isinstance(target, CausalLM)
    spec = SpeculativeConfig.resolve("DFLASH", "demo-dflash")
    draft = load_dflash("demo-dflash", cfg, torch.device("cpu"), torch.float32)
    width = draft.fc.weight.shape[1]  # n * H: the tapped target layers' states, concatenated
    results = []
    with torch.inference_mode():
        for b in (int(x) for x in a.batch.split(",")):
            drafters = [DFlashDrafter(draft, target, spec, SamplingParams(), None, CONTEXT + 512) for _ in range(b)]
            for d in drafters:
                d.prefill([1] * CONTEXT, torch.randn(CONTEXT, width))
            for t in (int(x) for x in a.queued.split(",")):
                states = torch.randn(b, t, width)  # [B, T, n*H]

                def queue(drafters: list[DFlashDrafter] = drafters, states: torch.Tensor = states) -> None:
                    for d, s in zip(drafters, states, strict=True):
                        d.length = CONTEXT
                        for row in s:
                            d.accept([1], row[None], 1)

                times: dict[str, list[float]] = {"one_by_one": [], "batched": []}
                for _ in range(a.repeats):
                    for name in times:
                        queue()
                        t0 = time.perf_counter()
                        if name == "batched":
                            _flush_many(drafters)
                        else:
                            for d in drafters:
                                d._flush()
                        times[name].append(time.perf_counter() - t0)
                ms = {k: round(statistics.median(v) * 1e3, 2) for k, v in times.items()}
                results.append({"batch": b, "queued": t, "ms": ms,
                                "one_by_one_over_batched": round(ms["one_by_one"] / ms["batched"], 2)})
    print(json.dumps({"kind": "dflash_catch_up", "threads": a.threads, "machine": platform.processor() or
                      platform.machine(), "context": CONTEXT, "results": results}, indent=1))


if __name__ == "__main__":
    main()

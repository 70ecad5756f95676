"""Plain decoding: specserve vs transformers.generate on the same prompts, same process, same dtype.

    python benchmarks/plain_vs_transformers.py --model demo --max-new-tokens 128 --dtype bfloat16

Prints one JSON object: tokens/s of each, the ratio, and whether the greedy tokens agree.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from specserve.bench.suites import coding_prompts
from specserve.engine.llm import LLM
from specserve.types import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    import transformers

    llm = LLM(a.model, device="cpu", dtype=a.dtype)
    ref = transformers.AutoModelForCausalLM.from_pretrained(llm.model_dir, dtype=llm.dtype).eval()
    prompts = [llm.encode(p) for _, p in coding_prompts()[: a.num_prompts]]
    params = SamplingParams(max_new_tokens=a.max_new_tokens, ignore_eos=True)

    def ours(ids: list[int]) -> list[int]:
        return llm.generate([ids], params)[0].token_ids

    @torch.inference_mode()
    def theirs(ids: list[int]) -> list[int]:
        out = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=a.max_new_tokens,
                           min_new_tokens=a.max_new_tokens, pad_token_id=0)
        return out[0, len(ids):].tolist()

    ours(prompts[0])  # warm-up both
    theirs(prompts[0])
    results = {}
    outputs = {}
    for name, fn in (("specserve", ours), ("transformers", theirs)):
        t0 = time.perf_counter()
        outputs[name] = [fn(p) for p in prompts]
        dt = time.perf_counter() - t0
        n = sum(len(o) for o in outputs[name])
        results[name] = {"tokens": n, "seconds": round(dt, 3), "tokens_per_s": round(n / dt, 1)}
    same = sum(a_ == b_ for a_, b_ in zip(outputs["specserve"], outputs["transformers"], strict=True))
    print(json.dumps({
        "benchmark": "plain_vs_transformers", "model": str(a.model), "dtype": a.dtype, "batch": 1,
        "max_new_tokens": a.max_new_tokens, "num_prompts": len(prompts),
        "threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__,
        "machine": platform.processor() or platform.machine(),
        **results,
        "ratio_specserve_over_transformers": round(
            results["specserve"]["tokens_per_s"] / results["transformers"]["tokens_per_s"], 3),
        "greedy_identical_prompts": f"{same}/{len(prompts)}",
    }, indent=2))


if __name__ == "__main__":
    main()

"""Peers in the same run: `transformers.generate` (plain, prompt lookup, assistant model) beside specserve.

    python benchmarks/peers_transformers.py --model demo
    python benchmarks/peers_transformers.py --model TARGET --assistant DRAFT \\
        --speculative-algorithm EAGLE3 --speculative-draft-model-path EAGLE_DRAFT

Views (greedy, batch 1, every output exactly the view's length, EOS ignored):
  coding10  the coding10 prompts, --max-new-tokens (default 128)
  heldout   the first --heldout-tasks contexts of heldout-code, --heldout-new-tokens (default 32)
Methods, all on the same target weights in one process:
  transformers_plain, transformers_prompt_lookup (`prompt_lookup_num_tokens`, transformers' n-gram),
  transformers_assistant (with --assistant: `assistant_model`, same tokenizer),
  specserve_plain, specserve_ngram (SGLang's NGRAM defaults), specserve_standalone (with --assistant:
  the same draft model), specserve_custom (with --speculative-algorithm other than NONE).
Prints one JSON object: per view and method tokens/s, the ratio to transformers_plain and to
specserve_plain, the accept length (specserve speculation) and how many outputs equal
transformers_plain's (greedy on both sides, so differences are numerics, not the method).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from specserve.bench.acceptance import task_prompt
from specserve.bench.suites import load_suite
from specserve.cli_args import add_model_args, add_speculative_args, speculative_from_args
from specserve.config import SpeculativeConfig
from specserve.engine.llm import LLM
from specserve.speculative.factory import DrafterBuilder, plan_drafter
from specserve.types import SamplingParams

# (prompt ids, new tokens) -> (generated ids, accept length per verify step; empty when not speculative)
Decode = Callable[[list[int], int], tuple[list[int], list[int]]]


def specserve_methods(llm: LLM, specs: dict[str, SpeculativeConfig]) -> dict[str, Decode]:
    def plain(ids: list[int], n: int) -> tuple[list[int], list[int]]:
        return llm.generate_plain([ids], SamplingParams(max_new_tokens=n, ignore_eos=True))[0].token_ids, []

    def speculative(builder: DrafterBuilder) -> Decode:
        def run(ids: list[int], n: int) -> tuple[list[int], list[int]]:
            [res] = llm.generate_with(builder, [ids], SamplingParams(max_new_tokens=n, ignore_eos=True))
            return res.token_ids, res.accept_lengths
        return run

    methods: dict[str, Decode] = {"specserve_plain": plain}
    for name, spec in specs.items():  # drafters share the loaded target
        builder = DrafterBuilder(plan_drafter(spec, llm.config), llm.model, llm.device, llm.dtype)
        methods[name] = speculative(builder)
    return methods


def transformers_methods(llm: LLM, a: argparse.Namespace) -> tuple[dict[str, Decode], dict[str, Any]]:
    import transformers

    load = transformers.AutoModelForCausalLM.from_pretrained
    target: Any = load(llm.model_dir, dtype=llm.dtype)
    target = target.to(llm.device).eval()
    pad = llm.eos_ids[0] if llm.eos_ids else 0

    def hf(**extra: Any) -> Decode:
        @torch.inference_mode()
        def run(ids: list[int], n: int) -> tuple[list[int], list[int]]:
            x = torch.tensor([ids], device=llm.device)  # [1, T]
            out = target.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=n,
                                  min_new_tokens=n, pad_token_id=pad, **extra)  # [1, T + n]
            return out[0, len(ids):].tolist(), []
        return run

    methods = {"transformers_plain": hf(),
               "transformers_prompt_lookup": hf(prompt_lookup_num_tokens=a.prompt_lookup_num_tokens)}
    settings: dict[str, Any] = {"prompt_lookup_num_tokens": a.prompt_lookup_num_tokens}
    if a.assistant:
        assistant: Any = load(a.assistant, dtype=llm.dtype)
        assistant = assistant.to(llm.device).eval()
        if a.num_assistant_tokens is not None:
            assistant.generation_config.num_assistant_tokens = a.num_assistant_tokens
        gc = assistant.generation_config
        settings.update(assistant=a.assistant, num_assistant_tokens=gc.num_assistant_tokens,
                        num_assistant_tokens_schedule=gc.num_assistant_tokens_schedule)
        methods["transformers_assistant"] = hf(assistant_model=assistant)
    return methods, settings


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_view(methods: dict[str, Decode], prompts: list[list[int]], n: int, device: torch.device) -> dict[str, Any]:
    outputs: dict[str, list[list[int]]] = {}
    results: dict[str, dict[str, Any]] = {}
    for name, decode in methods.items():
        decode(prompts[0], min(n, 4))  # warm-up: one-time allocations are not decoding speed
        steps: list[int] = []
        outputs[name] = []
        sync(device)
        t0 = time.perf_counter()
        for ids in prompts:
            tokens, accepted = decode(ids, n)
            outputs[name].append(tokens)
            steps.extend(accepted)
        sync(device)
        seconds = time.perf_counter() - t0
        count = sum(len(o) for o in outputs[name])
        results[name] = {"tokens": count, "seconds": round(seconds, 4), "tokens_per_s": round(count / seconds, 2),
                         "accept_length": round(sum(steps) / len(steps), 4) if steps else None}
    for name, r in results.items():
        for base in ("transformers_plain", "specserve_plain"):
            r[f"ratio_to_{base}"] = round(r["tokens_per_s"] / results[base]["tokens_per_s"], 4)
        same = sum(o == ref for o, ref in zip(outputs[name], outputs["transformers_plain"], strict=True))
        r["identical_to_transformers_plain"] = f"{same}/{len(prompts)}"
    return {"new_tokens": n, "num_prompts": len(prompts), "methods": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(ap)
    ap.add_argument("--assistant", default=None, help="draft model for transformers' assistant_model and STANDALONE")
    ap.add_argument("--num-assistant-tokens", type=int, default=None, help="default: the assistant's config")
    ap.add_argument("--prompt-lookup-num-tokens", type=int, default=10)
    ap.add_argument("--views", default="coding10,heldout")
    ap.add_argument("--num-prompts", type=int, default=10, help="coding10 prompts used")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="coding10 output length")
    ap.add_argument("--heldout-tasks", type=int, default=16)
    ap.add_argument("--heldout-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    add_speculative_args(ap)
    a = ap.parse_args()
    views = a.views.split(",")
    if unknown := set(views) - {"coding10", "heldout"}:
        ap.error(f"--views: unknown {', '.join(sorted(unknown))}; use coding10,heldout")
    if a.threads:
        torch.set_num_threads(a.threads)
    import transformers

    llm = LLM(a.model, device=a.device, dtype=a.dtype)
    specs = {"specserve_ngram": SpeculativeConfig.resolve("NGRAM")}
    if a.assistant:
        specs["specserve_standalone"] = SpeculativeConfig.resolve("STANDALONE", draft_model_path=a.assistant)
    custom = speculative_from_args(a)
    if custom.enabled:
        specs["specserve_custom"] = custom
    peers, settings = transformers_methods(llm, a)
    methods = {**peers, **specserve_methods(llm, specs)}
    suites = {"coding10": (load_suite("coding10")[: a.num_prompts], a.max_new_tokens),
              "heldout": (load_suite("heldout-code")[: a.heldout_tasks], a.heldout_new_tokens)}
    report: dict[str, Any] = {
        "benchmark": "peers_transformers", "model": a.model, "device": str(llm.device),
        "dtype": str(llm.dtype).removeprefix("torch."), "batch": 1, "greedy": True,
        "threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": transformers.__version__,
        "machine": platform.processor() or platform.machine(), "command_line": sys.argv,
        "transformers_settings": settings, "specserve_configs": {k: asdict(v) for k, v in specs.items()},
        "views": {},
    }
    for view in views:
        tasks, n = suites[view]
        prompts = [task_prompt(llm, t) for t in tasks]
        report["views"][view] = run_view(methods, prompts, n, llm.device)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

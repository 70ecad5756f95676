"""The real target (SmolLM2-135M-Instruct, Q4_1 GGUF) in every weight mode, beside transformers on the same weights.

    python benchmarks/real_target.py --rounds 2 > runs/real_target.json

Arms: float32 and bfloat16 (`--quantization none`: the GGUF dequantized), int8 and int4 (activations float32),
each with compiled decode steps (the engine's default), and transformers (the GGUF loaded by transformers,
float32, `generate` with its KV cache). Per arm, in one process and interleaved (the order reversed every other
round): greedy decoding of `--max-new-tokens` tokens, EOS ignored, on chat coding prompts at batch 1 (four
prompts one by one) and batch 16 (one batch). Then the verify-width cost curve: one target forward of Q new
tokens over a 128-token context (the engine's own pass, as the adaptive profile times it), best of 5, for
Q = 1, 2, 4, 8, 16, 32 and for 16 rows of one token; eager for every mode, compiled for `--compiled-curve` modes
(the per-width kernel table is `benchmarks/qkernel_widths.py`). And greedy agreement: each task decoded alone
(32 tokens) by every arm, against float32.
Prints one JSON object with the ratios the real-target goals name. `--agreement-only` runs the agreement part
alone, eager (a minute).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from typing import Any

import torch

from specserve.config import SpeculativeConfig
from specserve.engine.adaptive.measure import profile_forward, profile_slots
from specserve.engine.compiled import CompiledSteps
from specserve.engine.engine_config import EngineConfig
from specserve.engine.llm import LLM
from specserve.models.gguf_dir import smollm2_gguf
from specserve.types import SamplingParams

TASKS = ["Write a Python function that checks whether a string is a palindrome.",
         "Fix the bug: def mean(xs): return sum(xs) / len(xs) + 1",
         "Explain what a Python generator is, with a short example.",
         "Write a function that merges two sorted lists into one sorted list.",
         "Write a class Stack with push, pop and peek methods.",
         "How do I read a JSON file in Python and print its keys?",
         "Write a binary search over a sorted list of integers.",
         "Refactor into a list comprehension: out = []\nfor x in xs:\n    if x > 0:\n        out.append(x * 2)",
         "Write a function that counts the words in a text file.",
         "What does `if __name__ == '__main__':` do?",
         "Write a function that returns the n-th Fibonacci number iteratively.",
         "Write a Python function to flatten a nested list.",
         "Write a decorator that times a function call.",
         "Write a function that removes duplicates from a list while keeping order.",
         "Write a SQL query that returns the ten newest users.",
         "Write a function that validates an email address with a regular expression."]
MODES = [("float32", "none"), ("bfloat16", "none"), ("float32", "int8"), ("float32", "int4")]
WIDTHS = (1, 2, 4, 8, 16, 32)


def arm_name(dtype: str, quant: str) -> str:
    return quant if quant != "none" else dtype


def width_curve(llm: LLM, eager: bool) -> dict[str, float]:
    """ms of one engine forward of Q new tokens over a PROFILE_CONTEXT-token context (and 16 rows of 1 token)."""
    engine = llm.make_engine(EngineConfig(kv_cache_gb=0.25, max_num_seqs=16, enforce_eager=eager))
    if not eager:  # a plain engine compiles one-token steps only; verify widths as a drafter's engine would
        engine.compiled = CompiledSteps(llm.model, engine.kv, 16, max(WIDTHS))
    out: dict[str, float] = {}
    slots = list(range(profile_slots(max(WIDTHS))))
    for b, q in [(1, w) for w in WIDTHS] + [(16, 1)]:
        profile_forward(engine, b, q, slots)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            profile_forward(engine, b, q, slots)
            times.append(time.perf_counter() - t0)
        out[f"{b}x{q}"] = round(min(times) * 1e3, 2)
    return out


def agreement(llms: dict[str, LLM], ids: list[list[int]]) -> dict[str, Any]:
    """Per arm: tasks whose first 32 greedy tokens (each task decoded alone) equal float32's, and where the
    others first differ."""
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    out = {arm: [llm.generate([x], params)[0].token_ids for x in ids] for arm, llm in llms.items()}
    ref = out["float32"]
    return {arm: {"identical": f"{sum(a == b for a, b in zip(toks, ref, strict=True))}/{len(ref)}",
                  "first_difference_at": [next((i for i, (u, v) in enumerate(zip(a, b, strict=False)) if u != v), None)
                                          for a, b in zip(toks, ref, strict=True)]}
            for arm, toks in out.items() if arm != "float32"}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--compiled-curve", action="append", default=[], help="modes whose width curve is also "
                    "measured compiled (default: int4; one compile per width)")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--agreement-only", action="store_true", help="greedy agreement with float32 alone, eager")
    a = ap.parse_args()
    params = SamplingParams(max_new_tokens=a.max_new_tokens, ignore_eos=True)
    llms: dict[str, LLM] = {}
    for dtype, quant in MODES:
        llm = LLM("smollm2", dtype=dtype, quantization=quant,
                  engine_config=EngineConfig(kv_cache_gb=0.25, max_num_seqs=16, enforce_eager=a.agreement_only))
        llms[arm_name(dtype, quant)] = llm
    prompts = [next(iter(llms.values())).tokenizer.apply_chat_template([{"role": "user", "content": t}])
               for t in TASKS]
    ids = [next(iter(llms.values())).encode(p) for p in prompts]
    if a.agreement_only:  # also: n-gram speculation against plain decoding, in int4 and in float32
        ngram = {}
        for quant in ("int4", "none"):
            spec = LLM("smollm2", quantization=quant, speculative=SpeculativeConfig.resolve("NGRAM"),
                       engine_config=EngineConfig(kv_cache_gb=0.25, max_num_seqs=16, enforce_eager=True))
            plain = llms[arm_name("float32", quant)]
            ngram[f"{quant} NGRAM vs {quant} plain"] = agreement({"float32": plain, "spec": spec}, ids)["spec"]
        print(json.dumps({"benchmark": "real_target", "command_line": sys.argv, "decode_steps": "eager",
                          "greedy_first32_vs_float32": agreement(llms, ids),
                          "greedy_first32_speculative_vs_plain": ngram}, indent=2))
        return
    hf = None
    if not a.no_transformers:
        from transformers import AutoModelForCausalLM  # the `peers`/`test` extra

        gguf = smollm2_gguf()
        hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                  torch_dtype=torch.float32).eval()
        hf.generation_config.pad_token_id = 2

    def run_hf(batch: list[list[int]]) -> list[list[int]]:
        assert hf is not None
        n = max(len(x) for x in batch)
        inp = torch.tensor([[2] * (n - len(x)) + x for x in batch])
        att = torch.tensor([[0] * (n - len(x)) + [1] * len(x) for x in batch])
        with torch.no_grad():
            out = hf.generate(input_ids=inp, attention_mask=att, max_new_tokens=a.max_new_tokens,
                              min_new_tokens=a.max_new_tokens, do_sample=False)
        return [r[n:].tolist() for r in out]

    def run(arm: str, batch: int) -> tuple[float, list[list[int]]]:
        t0 = time.perf_counter()
        toks: list[list[int]] = []
        for i in range(0, batch if batch > 1 else 4, batch):
            group = ids[i:i + batch]
            if arm == "transformers":
                toks += run_hf(group)
            else:
                toks += [o.token_ids for o in llms[arm].generate(group, params)]
        return sum(len(t) for t in toks) / (time.perf_counter() - t0), toks

    arms = [*llms, *(["transformers"] if hf is not None else [])]
    t0 = time.perf_counter()
    for arm in arms:  # warm-up: compiles the batch-1 and batch-16 decode steps
        for batch in (16, 1):
            run(arm, batch)
    warm_s = round(time.perf_counter() - t0, 1)
    speed: dict[tuple[str, int], list[float]] = {}
    tokens: dict[tuple[str, int], list[list[int]]] = {}
    for r in range(a.rounds):
        order = [(arm, b) for arm in arms for b in (1, 16)]
        for arm, b in order if r % 2 == 0 else order[::-1]:
            tps, toks = run(arm, b)
            speed.setdefault((arm, b), []).append(tps)
            tokens[(arm, b)] = toks
        print(f"round {r} done", file=sys.stderr)

    def med(arm: str, b: int) -> float:
        return statistics.median(speed[(arm, b)])

    def ratio(x: str, y: str, b: int) -> float:
        return round(statistics.median([p / q for p, q in zip(speed[(x, b)], speed[(y, b)], strict=True)]), 2)

    curves = {arm: {"eager": width_curve(llm, eager=True)} for arm, llm in llms.items()}
    for arm in a.compiled_curve or ["int4"]:
        curves[arm]["compiled"] = width_curve(llms[arm], eager=False)
    agree_all = agreement(llms, ids)
    ref = tokens[("float32", 1)]
    agree = {arm: sum(t[:32] == r[:32] for t, r in zip(tokens[(arm, 1)], ref, strict=True))
             for arm in arms}
    result: dict[str, Any] = {
        "benchmark": "real_target", "model": "smollm2", "command_line": sys.argv, "rounds": a.rounds,
        "max_new_tokens": a.max_new_tokens, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "machine": platform.machine(), "warm_up_s": warm_s,
        "tok_s": {arm: {f"batch{b}": round(med(arm, b), 1) for b in (1, 16)} for arm in arms},
        "tok_s_rounds": {f"{arm} b{b}": [round(x, 1) for x in v] for (arm, b), v in speed.items()},
        "verify_width_ms": curves,
        "greedy_first32_same_as_float32_batch1": {arm: f"{n}/{len(ref)}" for arm, n in agree.items()},
        "greedy_first32_vs_float32_each_task": agree_all,
        "goals": {
            "int4_over_float32_batch1": ratio("int4", "float32", 1),
            "int4_verify16_over_step": {mode: round(c["1x16"] / c["1x1"], 2)
                                        for mode, c in curves["int4"].items()},
        },
    }
    if hf is not None:
        result["goals"]["int4_over_transformers"] = {f"batch{b}": ratio("int4", "transformers", b) for b in (1, 16)}
        result["goals"]["float32_over_transformers"] = {f"batch{b}": ratio("float32", "transformers", b)
                                                        for b in (1, 16)}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

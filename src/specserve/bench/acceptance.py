"""Offline acceptance evaluation: each task decoded plainly and speculatively in the same process.

Per task: mean accept length ("average streak": accepted drafts + 1 per verify step, as SGLang and
vLLM count it), acceptance per draft position, tokens/s of both runs and the speedup, and the loop
measure of the plain output (fraction of repeated 4-grams), because small targets loop under greedy
decoding and loops flatter every drafter.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from tqdm import tqdm

from specserve.bench.by_kind import LOOP_THRESHOLD, kind_summary
from specserve.bench.diagnose import diagnose, max_depth
from specserve.bench.suites import Task
from specserve.engine.llm import LLM
from specserve.speculative.factory import DrafterBuilder
from specserve.types import GenerationResult, SamplingParams


def repeated_ngram_fraction(tokens: list[int], n: int = 4) -> float:
    """Fraction of the n-grams of `tokens` that already occurred earlier in `tokens` (0 = no loops)."""
    grams = [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
    if not grams:
        return 0.0
    seen: set[tuple[int, ...]] = set()
    repeats = 0
    for g in grams:
        repeats += g in seen
        seen.add(g)
    return repeats / len(grams)


@dataclass(frozen=True)
class TaskResult:
    name: str
    prompt_tokens: int
    new_tokens: int
    accept_length: float
    accept_per_position: list[float]
    verify_steps: int
    plain_tokens_per_s: float
    spec_tokens_per_s: float
    speedup: float
    loop_4gram: float
    identical_to_plain: bool | None  # greedy only: lossless check on the side
    reference_accept_length: float | None = None
    percent_of_reference: float | None = None
    kind: str | None = None  # the task's cut kind


def task_prompt(llm: LLM, task: Task) -> list[int]:
    if task.messages is not None:
        return llm.encode(llm.tokenizer.apply_chat_template(task.messages))
    assert task.prompt is not None
    return llm.encode(task.prompt)


def _timed(fn: Any) -> tuple[GenerationResult, float]:
    t0 = time.perf_counter()
    res = fn()
    return res, time.perf_counter() - t0


def run_acceptance(
    llm: LLM,
    tasks: list[Task],
    params: SamplingParams,
    reference: DrafterBuilder | None = None,
    progress: bool = True,
    loop_threshold: float = LOOP_THRESHOLD,
) -> dict[str, Any]:
    if llm.drafter_builder is None:
        raise ValueError("acceptance evaluation needs --speculative-algorithm other than NONE")
    prompts = [task_prompt(llm, t) for t in tasks]
    # warm-up: first calls pay one-time costs that are not decoding speed (allocations, RoPE tables, compiling
    # the decode steps and every chain length a round drafts). The longest prompt at the full length sizes the
    # offline engines' KV pools for every task, so no task rebuilds an engine (and recompiles its steps).
    warm = SamplingParams(max_new_tokens=params.max_new_tokens, temperature=params.temperature, seed=params.seed,
                          ignore_eos=True)
    longest = max(prompts, key=len)
    llm.generate_plain([longest], warm)
    llm.generate([longest], warm)
    if reference is not None:
        llm.generate_with(reference, [longest], warm)
    llm.warm_compiled(max_batch=1, progress=progress)  # widths the longest prompt did not meet (lookup drafters)
    results: list[TaskResult] = []
    all_steps: list[int] = []
    tot = {"plain_s": 0.0, "spec_s": 0.0, "plain_tokens": 0, "spec_tokens": 0, "draft_s": 0.0, "verify_s": 0.0}
    ref_steps: list[int] = []
    runs: list[tuple[list[int], list[int]]] = []  # (output, accept lengths) per task, for the diagnosis
    ref_runs: list[tuple[list[int], list[int]]] = []
    for task, ids in tqdm(list(zip(tasks, prompts, strict=True)), desc="acceptance", unit="task",
                          disable=not progress, file=sys.stderr):
        plain, t_plain = _timed(lambda ids=ids: llm.generate_plain([ids], params)[0])
        spec, t_spec = _timed(lambda ids=ids: llm.generate([ids], params)[0])
        ref_len = pct = None
        if reference is not None:
            [ref] = llm.generate_with(reference, [ids], params)
            ref_steps.extend(ref.accept_lengths)
            ref_runs.append((ref.token_ids, ref.accept_lengths))
            ref_len = ref.accept_length
            pct = 100.0 * spec.accept_length / ref_len if ref_len else None
        all_steps.extend(spec.accept_lengths)
        runs.append((spec.token_ids, spec.accept_lengths))
        tot["plain_s"] += t_plain
        tot["spec_s"] += t_spec
        tot["plain_tokens"] += plain.num_tokens
        tot["spec_tokens"] += spec.num_tokens
        tot["draft_s"] += spec.draft_s
        tot["verify_s"] += spec.verify_s
        p_tps, s_tps = plain.num_tokens / t_plain, spec.num_tokens / t_spec
        results.append(TaskResult(
            name=task.name, prompt_tokens=len(ids), new_tokens=spec.num_tokens,
            accept_length=round(spec.accept_length, 4),
            accept_per_position=[round(x, 4) for x in spec.accept_per_position],
            verify_steps=spec.num_verify_steps, plain_tokens_per_s=round(p_tps, 2),
            spec_tokens_per_s=round(s_tps, 2), speedup=round(s_tps / p_tps, 4),
            loop_4gram=round(repeated_ngram_fraction(plain.token_ids), 4),
            identical_to_plain=(plain.token_ids == spec.token_ids) if params.greedy else None,
            reference_accept_length=None if ref_len is None else round(ref_len, 4),
            percent_of_reference=None if pct is None else round(pct, 2), kind=task.kind,
        ))
    plain_tps = tot["plain_tokens"] / tot["plain_s"]
    spec_tps = tot["spec_tokens"] / tot["spec_s"]
    accept = sum(all_steps) / max(1, len(all_steps))
    summary: dict[str, Any] = {
        "tasks": len(results),
        "accept_length": round(accept, 4),
        "plain_tokens_per_s": round(plain_tps, 2),
        "spec_tokens_per_s": round(spec_tps, 2),
        "speedup": round(spec_tps / plain_tps, 4),
        "speedup_over_accept_length": round(spec_tps / plain_tps / accept, 4),
        # one round (drafting + verify) in plain one-token steps: a speedup G needs an accept length of G times it
        "round_cost_plain_steps": round(plain_tps * accept / spec_tps, 3),
        "loop_4gram": round(sum(r.loop_4gram for r in results) / len(results), 4),
        # of the speculative run's time: drafting, verifying (target forward + verify + KV commit)
        "draft_share_of_time": round(tot["draft_s"] / tot["spec_s"], 4),
        "verify_share_of_time": round(tot["verify_s"] / tot["spec_s"], 4),
    }
    summary.update(kind_summary([asdict(r) for r in results], loop_threshold))
    if params.greedy:
        summary["identical_to_plain"] = f"{sum(bool(r.identical_to_plain) for r in results)}/{len(results)}"
    if ref_steps:
        ref_accept = sum(ref_steps) / len(ref_steps)
        summary["reference_accept_length"] = round(ref_accept, 4)
        summary["percent_of_reference"] = round(100 * accept / ref_accept, 2)
    report: dict[str, Any] = {
        "kind": "acceptance",
        "schema_version": 1,
        "config": {
            "model": str(llm.model_dir), "device": str(llm.device), "dtype": str(llm.dtype).removeprefix("torch."),
            "draft_dtype": str(llm.draft_dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), "speculative": asdict(llm.spec), "sampling": asdict(params),
        },
        "summary": summary,
        "tasks": [asdict(r) for r in results],
    }
    if params.greedy:  # where the drafter (and the reference) miss: by depth and token class
        cap = max_depth(llm.spec)
        report["diagnosis"] = diagnose(runs, llm.tokenizer.decode, cap, ref_runs if reference is not None else None)
    return report

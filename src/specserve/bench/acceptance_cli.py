"""`specserve bench acceptance`: accept length and speedup per task, plain vs speculative, one process; or, with
`--base-url`, accept length per task through a running server (`remote_acceptance.py`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from specserve.bench.by_kind import LOOP_THRESHOLD
from specserve.cli_args import add_model_args, add_speculative_args, speculative_from_args
from specserve.types import SamplingParams


def add_acceptance_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("acceptance", help="accept length and speedup per task (offline, same process)")
    add_model_args(p)
    add_speculative_args(p)
    p.add_argument("--suite", default="heldout-code",
                   help="coding10 | coding10-chat | heldout-code | heldout-pip | chat-coding | code-edit | FILE.jsonl")
    p.add_argument("--num-tasks", type=int, default=None, help="use the first N tasks of the suite")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="default 32 for the held-out suites (short horizon), 128 otherwise")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, default=1,
                   help="sampled runs at seeds --seed .. --seed+N-1 in one process (temperature > 0): the report "
                        "adds their accept lengths, mean, standard deviation and standard error")
    p.add_argument("--reference-draft", default=None, help="a reference drafter to compare ours with")
    p.add_argument("--loop-threshold", type=float, default=LOOP_THRESHOLD,
                   help="tasks whose plain output repeats more than this fraction of its 4-grams count as looping "
                        "and are left out of the non-looping figures (the headline: their minimum over cut kinds)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON here (always printed to stdout too)")
    r = p.add_argument_group("through a running server (specserve, SGLang, vLLM)")
    r.add_argument("--base-url", default=None, help="measure through this server instead of offline")
    r.add_argument("--reference-base-url", default=None, help="a server with the reference drafter, task by task")
    r.add_argument("--served-model", default=None, help="model name to send (default: the server's first)")
    r.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY' to both servers")
    r.add_argument("--source", default="auto", choices=("auto", "response", "metrics"),
                   help="per-request figures from the response's meta_info, or /metrics deltas (auto: the first)")
    r.add_argument("--tokenizer", default=None,
                   help="for the loop measure, which the non-looping figures need (default: the served model's, if "
                        "local)")
    p.set_defaults(func=cmd_acceptance)


def cmd_remote_acceptance(a: argparse.Namespace) -> int:
    from specserve.bench.remote_acceptance import RemoteConfig, run_remote_acceptance
    from specserve.bench.suites import default_new_tokens, load_suite

    if a.seeds != 1 or a.reference_draft:
        raise ValueError("--seeds and --reference-draft are offline options; with --base-url give "
                         "--reference-base-url for a reference")
    tasks = load_suite(a.suite)[: a.num_tasks]
    new = a.max_new_tokens or default_new_tokens(a.suite)
    cfg = RemoteConfig(a.base_url, new, a.temperature, a.seed, a.served_model, a.api_key, a.source)
    ref = RemoteConfig(a.reference_base_url, new, a.temperature, a.seed, a.served_model, a.api_key, a.source) \
        if a.reference_base_url else None
    report = run_remote_acceptance(tasks, cfg, ref, a.tokenizer, loop_threshold=a.loop_threshold)
    return _write(report, a)


def seed_summary(accept_lengths: list[float], first_seed: int) -> dict[str, Any]:
    """Accept lengths of runs at seeds first_seed, first_seed+1, ... -> their mean, sample standard deviation
    and standard error of the mean (the spread a sampled figure needs beside it)."""
    n = len(accept_lengths)
    mean = sum(accept_lengths) / n
    sd = (sum((x - mean) ** 2 for x in accept_lengths) / (n - 1)) ** 0.5 if n > 1 else 0.0
    return {"seeds": list(range(first_seed, first_seed + n)), "accept_length": accept_lengths,
            "mean": round(mean, 4), "sd": round(sd, 4), "se": round(sd / n**0.5, 4)}


def cmd_acceptance(a: argparse.Namespace) -> int:
    from dataclasses import replace

    from specserve.bench.acceptance import run_acceptance
    from specserve.bench.suites import default_new_tokens, load_suite
    from specserve.engine.llm import LLM
    from specserve.speculative.factory import DrafterBuilder, plan_drafter

    if a.base_url:
        return cmd_remote_acceptance(a)
    tasks = load_suite(a.suite)[: a.num_tasks]
    new = a.max_new_tokens or default_new_tokens(a.suite)
    params = SamplingParams(max_new_tokens=new, temperature=a.temperature, seed=a.seed, ignore_eos=True)
    spec = speculative_from_args(a)
    if not spec.enabled:
        raise ValueError("--speculative-algorithm is required (acceptance compares it with plain decoding)")
    if a.seeds < 1 or (a.seeds > 1 and a.temperature == 0):
        raise ValueError(f"--seeds {a.seeds}: give at least 1, and more than 1 only with --temperature > 0 "
                         "(greedy decoding does not depend on the seed)")
    llm = LLM(a.model, device=a.device, dtype=a.dtype, quantization=a.quantization, speculative=spec,
              draft_dtype=a.speculative_draft_dtype)
    reference = None
    if a.reference_draft:
        ref_spec = replace(spec, draft_model_path=a.reference_draft)
        reference = DrafterBuilder(plan_drafter(ref_spec, llm.config), llm.model, llm.device, llm.draft_dtype)
    report = run_acceptance(llm, tasks, params, reference, loop_threshold=a.loop_threshold)
    if a.seeds > 1:
        runs = [report] + [run_acceptance(llm, tasks, replace(params, seed=a.seed + k), reference,
                                          loop_threshold=a.loop_threshold)
                           for k in range(1, a.seeds)]
        report = {**report, "seeds": seed_summary([r["summary"]["accept_length"] for r in runs], a.seed),
                  "runs": [{"seed": a.seed + k, "summary": r["summary"], "tasks": r["tasks"]}
                           for k, r in enumerate(runs)]}
    return _write(report, a)


def _write(report: dict[str, Any], a: argparse.Namespace) -> int:
    """The report with its suite and command line: printed, and written to --out when given."""
    report["config"]["suite"] = a.suite
    report["command_line"] = sys.argv
    text = json.dumps(report, indent=2)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")
    print(text)
    return 0

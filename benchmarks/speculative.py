"""Speculative decoding at batch 1 against plain decoding, in three views, one process.

    python benchmarks/speculative.py --model demo --config NGRAM --config "DFLASH draft=16"

Views (see the foundation issue: loops of a small target flatter every drafter):
  heldout  : held-out real-code continuations, greedy, 32 tokens (the headline)
  coding_t0: the coding10 prompts, greedy, 128 tokens, with the loop measure beside it
  coding_t07: the coding10 prompts sampled at temperature 0.7 (seeded), 128 tokens
A config is `ALGO key=value ...` with keys path, steps, topk, draft, block, tree (and for SUFFIX depth, cached,
factor, minprob: its --speculative-suffix-* flags).
Prints one JSON object with every view's summary per config (and per-task rows with --tasks).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys

import torch

from specserve.bench.acceptance import run_acceptance
from specserve.bench.suites import load_suite
from specserve.config import SpeculativeConfig
from specserve.engine.llm import LLM
from specserve.speculative.factory import default_draft_path, drafter_block_size
from specserve.types import SamplingParams

KEYS = {"path": "draft_model_path", "steps": "num_steps", "topk": "eagle_topk", "draft": "num_draft_tokens",
        "block": "dflash_block_size", "tree": "tree", "depth": "suffix_max_tree_depth",
        "cached": "suffix_max_cached_requests", "factor": "suffix_max_spec_factor", "minprob": "suffix_min_token_prob"}
FLOAT_KEYS = ("factor", "minprob")


def parse_config(text: str, model: str) -> SpeculativeConfig:
    algo, *pairs = text.split()
    kw: dict[str, object] = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key not in KEYS:
            raise ValueError(f"--config {text!r}: unknown key {key!r}; use {', '.join(KEYS)}")
        kw[KEYS[key]] = value if key in ("path", "tree") else float(value) if key in FLOAT_KEYS else int(value)
    kw.setdefault("draft_model_path", default_draft_path(algo, model))
    if algo.upper() == "DFLASH" and "dflash_block_size" not in kw and kw["draft_model_path"]:
        kw["dflash_block_size"] = drafter_block_size(str(kw["draft_model_path"]))
    return SpeculativeConfig.resolve(algo, **kw)


VIEWS = {
    "heldout": ("heldout-code", SamplingParams(max_new_tokens=32, ignore_eos=True)),
    "heldout_pip": ("heldout-pip", SamplingParams(max_new_tokens=32, ignore_eos=True)),
    "coding_t0": ("coding10", SamplingParams(max_new_tokens=128, ignore_eos=True)),
    "coding_t07": ("coding10", SamplingParams(max_new_tokens=128, temperature=0.7, seed=0, ignore_eos=True)),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--config", action="append", default=[], help="e.g. 'NGRAM draft=12' (repeatable)")
    ap.add_argument("--views", default="heldout,coding_t0,coding_t07")
    ap.add_argument("--heldout-tasks", type=int, default=32)
    ap.add_argument("--tasks", action="store_true", help="include per-task rows")
    a = ap.parse_args()
    configs = a.config or ["NGRAM"]
    out: dict[str, object] = {
        "benchmark": "speculative_batch1", "model": a.model, "command_line": sys.argv,
        "threads": torch.get_num_threads(), "torch": torch.__version__, "machine": platform.machine(),
        "results": [],
    }
    results: list[dict[str, object]] = []
    for text in configs:
        spec = parse_config(text, a.model)
        llm = LLM(a.model, device="cpu", dtype=a.dtype, speculative=spec)
        entry: dict[str, object] = {"config": text, "dtype": str(llm.dtype).removeprefix("torch.")}
        for view in a.views.split(","):
            suite, params = VIEWS[view]
            tasks = load_suite(suite)
            if suite.startswith("heldout"):
                tasks = tasks[: a.heldout_tasks]
            report = run_acceptance(llm, tasks, params, progress=False)
            entry[view] = report["summary"] if not a.tasks else {"summary": report["summary"], "tasks": report["tasks"]}
            print(f"{text:40s} {view:11s} {json.dumps(report['summary'])}", file=sys.stderr)
        results.append(entry)
    out["results"] = results
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()

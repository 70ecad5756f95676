"""What a speculative engine costs while it decodes plainly: its plain passes against the plain engine's.

    python benchmarks/plain_pass_overhead.py --model demo --config EAGLE3 --batch 32 --temperature 0.7

Adaptive speculation decodes plainly wherever drafting does not pay (high concurrency, sampling), and there a
speculative engine should run as fast as a plain one. It does not quite: hidden-state drafters have the target
capture states at every pass, every drafter takes in each accepted token, n-gram drafting keeps its shadow
rounds. Served levels (`serving_concurrency.py`) run minutes apart on a machine whose speed drifts, which hides
a few percent; here one process holds every engine (one per --config, policy held at width 0, and a plain
engine), each with --batch running requests of the coding prompts, and runs them in interleaved blocks of
--steps decode steps for --rounds rounds, so drift hits all alike. Give one --config per run for the overhead
itself: with several engines in one process the later ones of a round pay for the others' weights in the caches
(at --batch 32, four configs showed 1.14-1.26x for every speculative engine; one at a time 0.97-1.05x).

Prints ONE JSON object: per engine the median step time over the blocks, its target-forward and host parts (ms),
and the step time's ratio to the plain engine's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from speculative import parse_config  # benchmarks/speculative.py (this script's folder is on sys.path)

from specserve.bench.datasets import load_dataset, sample_prompts
from specserve.engine.batch import BatchEngine
from specserve.engine.engine_config import EngineConfig
from specserve.engine.llm import LLM
from specserve.server.batch_serving import build_batch_engine
from specserve.types import SamplingParams


def start(llm: LLM, batch: int, temperature: float, prompts: list[list[int]], hold_plain: bool) -> BatchEngine:
    eng = build_batch_engine(llm, EngineConfig(max_num_seqs=max(batch, 1)), adaptive=hold_plain)
    if hold_plain:
        assert eng.policy is not None
        eng.policy.choose = lambda b, classes=(): 0  # decode plainly, as the policy may
    for i in range(batch):
        eng.add_request(str(i), prompts[i % len(prompts)],
                        SamplingParams(max_new_tokens=1_000_000, ignore_eos=True, temperature=temperature, seed=i))
    while eng.scheduler.num_waiting or any(s.in_prefill or s.num_output_tokens == 0 for s in eng.scheduler.running):
        eng.step()  # every prompt prefilled
    for _ in range(3):
        eng.step()
    return eng


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--config", action="append", default=[], help="ALGO key=value ... (speculative.py's syntax)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--steps", type=int, default=10, help="decode steps per block")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    base = LLM(a.model)
    texts = [p.text for p in sample_prompts(load_dataset("coding", 32, 0), 64, 0)]
    prompts = [base.encode(t) for t in texts]
    engines = {"NONE": start(base, a.batch, a.temperature, prompts, hold_plain=False)}
    for cfg in a.config:
        llm = LLM(a.model, speculative=parse_config(cfg, a.model))
        engines[cfg] = start(llm, a.batch, a.temperature, prompts, hold_plain=True)
    blocks: dict[str, list[tuple[float, float]]] = {name: [] for name in engines}
    for _ in range(a.rounds):
        for name, eng in engines.items():
            t0, f0 = time.perf_counter(), eng.counters.forward_s
            for _ in range(a.steps):
                eng.step()
            blocks[name].append(((time.perf_counter() - t0) / a.steps, (eng.counters.forward_s - f0) / a.steps))
    out = {}
    for name, bl in blocks.items():
        step = statistics.median(t for t, _ in bl)
        out[name] = {"step_ms": round(1e3 * step, 2), "forward_ms": round(1e3 * statistics.median(f for _, f in bl), 2),
                     "host_ms": round(1e3 * statistics.median(t - f for t, f in bl), 2)}
    plain = out["NONE"]["step_ms"]
    for v in out.values():
        v["over_plain"] = round(v["step_ms"] / plain, 3)
    print(json.dumps({"benchmark": "plain_pass_overhead", "model": a.model, "batch": a.batch,
                      "temperature": a.temperature, "threads": torch.get_num_threads(), "steps": a.steps,
                      "rounds": a.rounds, "engines": out}, indent=1))


if __name__ == "__main__":
    main()

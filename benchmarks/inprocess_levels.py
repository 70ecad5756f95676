"""Closed-loop concurrency levels against engines held in one process: the served benchmark without HTTP.

    python benchmarks/inprocess_levels.py --model demo --config NGRAM --modes fixed,adaptive \
        --concurrency 1,4 --num-prompts 32 --output-len 64 --rounds 3

Every engine (plain, and each --config fixed and/or adaptive, as `specserve serve` builds them) lives in one
process and the levels run interleaved: in each round, each level runs on every engine in turn (the order rotates
from round to round and is reversed every other round). A level keeps `c` requests in flight (a finished one is
replaced at once) until max(--num-prompts, 2c) requests of the coding prompts (shuffled with seed 0, cycled) have
produced --output-len tokens each (ignore_eos). No HTTP, no tokenization: what is left is the engine's own work,
prefills included. Adaptive engines keep their policy's state across levels and rounds, as a server does.

--lockstep runs each level on every engine at once, one engine step of each in turn, each timed over its own
steps: every engine sees the machine at the same speed, at the price of caches the other engines' steps refill.
--against-policy FILE (a copy of the adaptive policy module from another commit) gives every adaptive engine a
twin whose policy is that file's `AdaptivePolicy` (`CONFIG adaptive @against`, `ratio_to_against`: the median of
the per-round ratios). --keep-logs DIR keeps the engines' pass logs.

Prints ONE JSON object: per engine and level the output tok/s of every round, their median, and the median over
rounds of the per-round ratio to plain decoding; the share of decode steps that speculated; and per draft width
(0 = plain) the decode passes at the level's full batch and their median milliseconds.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from speculative import parse_config  # benchmarks/speculative.py (this script's folder is on sys.path)

from specserve.bench.datasets import load_dataset, sample_prompts
from specserve.engine.batch import BatchEngine
from specserve.engine.engine_config import EngineConfig
from specserve.engine.llm import LLM
from specserve.engine.pass_log import PassLog, read_pass_log
from specserve.types import SamplingParams


class ClosedLoop:
    """One engine's closed-loop level: `concurrency` requests in flight, a finished one replaced at once, until
    every prompt has produced `output_len` tokens. `step()` advances it by one engine step and times it."""

    def __init__(self, eng: BatchEngine, prompts: list[list[int]], concurrency: int, output_len: int,
                 temperature: float, tag: str) -> None:
        self.eng, self.concurrency, self.tag = eng, concurrency, tag
        self.params = SamplingParams(max_new_tokens=output_len, ignore_eos=True, temperature=temperature, seed=0)
        self.queue = list(enumerate(prompts))
        self.inflight = self.produced = 0
        self.seconds = 0.0  # wall time of this level's steps
        self.steps0, self.spec0 = eng.counters.steps, eng.counters.spec_steps

    @property
    def done(self) -> bool:
        return not self.queue and not self.inflight

    def step(self) -> None:
        t0 = time.perf_counter()
        while self.queue and self.inflight < self.concurrency:
            i, p = self.queue.pop(0)
            self.eng.add_request(f"{self.tag}-{i}", p, self.params)
            self.inflight += 1
        for out in self.eng.step():
            self.produced += len(out.new_token_ids)
            if out.finish_reason is not None:
                self.inflight -= 1
        self.seconds += time.perf_counter() - t0

    def result(self) -> tuple[float, float]:
        """Output tok/s over the level's steps, and the share of its decode steps that speculated."""
        steps = self.eng.counters.steps - self.steps0
        return self.produced / self.seconds, (self.eng.counters.spec_steps - self.spec0) / max(steps, 1)


def run_level(eng: BatchEngine, prompts: list[list[int]], concurrency: int, output_len: int,
              temperature: float, tag: str) -> tuple[float, float]:
    """Output tok/s of a closed-loop level, and the share of its decode steps that speculated."""
    loop = ClosedLoop(eng, prompts, concurrency, output_len, temperature, tag)
    while not loop.done:
        loop.step()
    return loop.result()


def run_lockstep(engines: list[BatchEngine], prompts: list[list[int]], concurrency: int, output_len: int,
                 temperature: float, tag: str) -> list[tuple[float, float]]:
    """`run_level` on every engine at once, one step of each in turn, each engine timed over its own steps:
    the machine's speed, which drifts by 20% from second to second here, is the same for all."""
    loops = [ClosedLoop(eng, prompts, concurrency, output_len, temperature, f"{tag}-{i}")
             for i, eng in enumerate(engines)]
    while not all(loop.done for loop in loops):
        for loop in loops:
            if not loop.done:
                loop.step()
    return [loop.result() for loop in loops]


def measure(engines: dict[str, BatchEngine], encoded: dict[int, list[list[int]]], rounds: int, output_len: int,
            temperature: float, keep_logs: Path | None = None, lockstep: bool = False) -> dict[str, object]:
    """Every level (a key of `encoded`: its prompts) on every engine, interleaved, `rounds` times; the report.
    `keep_logs`: a folder for the engines' pass logs (NN-NAME.passes.jsonl), else they are deleted;
    `lockstep`: the engines run each level at once, a step each in turn (`run_lockstep`)."""
    levels = list(encoded)
    for eng in engines.values():  # warm-up: one short level each
        run_level(eng, encoded[levels[0]][:2], 1, 8, temperature, "warm")
    tps: dict[str, dict[int, list[float]]] = {n: {c: [] for c in levels} for n in engines}
    spec: dict[str, dict[int, list[float]]] = {n: {c: [] for c in levels} for n in engines}
    passes: dict[str, dict[int, dict[int, list[float]]]] = {n: {c: {} for c in levels} for n in engines}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) if keep_logs is None else keep_logs
        logs = [folder / f"{i:02d}-{name.replace(' ', '-')}.passes.jsonl" for i, name in enumerate(engines)]
        for eng, path in zip(engines.values(), logs, strict=True):
            eng.pass_log = PassLog(path)
        seen = dict.fromkeys(engines, 0)  # decode passes of each log already read
        order = list(zip(engines.items(), logs, strict=True))
        for r in range(rounds):
            turn = order[r % len(order):] + order[:r % len(order)]
            if r % 2:  # a rotation keeps who follows whom (with --lockstep, every step): reverse every other round
                turn.reverse()
            for c in levels:
                if lockstep:
                    results = run_lockstep([eng for (_, eng), _ in turn], encoded[c], c, output_len, temperature,
                                           f"r{r}c{c}")
                else:
                    results = [run_level(eng, encoded[c], c, output_len, temperature, f"r{r}c{c}")
                               for (_, eng), _ in turn]
                for ((name, _), path), (rate, share) in zip(turn, results, strict=True):
                    tps[name][c].append(rate)
                    spec[name][c].append(share)
                    new = read_pass_log(path)[seen[name]:]
                    seen[name] += len(new)
                    for p in new:
                        if p["batch"] == c:
                            passes[name][c].setdefault(int(p["width"]), []).append(p["seconds"])
        for eng in engines.values():
            assert eng.pass_log is not None
            eng.pass_log.close()
            eng.pass_log = None
    out: dict[str, object] = {"rounds": rounds, "output_len": output_len, "temperature": temperature}
    def ratio(a: list[float], b: list[float]) -> float:  # median of the per-round ratios
        return round(statistics.median(x / y for x, y in zip(a, b, strict=True)), 3)

    for name in engines:
        twin = tps.get(f"{name} @against")
        out[name] = {f"c={c}": {
            "tok_s": [round(x, 1) for x in tps[name][c]],
            "median_tok_s": round(statistics.median(tps[name][c]), 1),
            "ratio": ratio(tps[name][c], tps["NONE"][c]),
            **({} if twin is None else {"ratio_to_against": ratio(tps[name][c], twin[c])}),
            "speculating": round(statistics.mean(spec[name][c]), 3),
            "pass_ms": {w: [len(t), round(1e3 * statistics.median(t), 2)] for w, t in sorted(passes[name][c].items())},
        } for c in levels}
    return out


def load_policy_class(path: Path) -> type:
    """`AdaptivePolicy` of another version of `engine/adaptive.py` (a file), imported under its own name."""
    spec = importlib.util.spec_from_file_location("against_adaptive", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"--against-policy: cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.AdaptivePolicy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--config", action="append", default=[], help="ALGO key=value ... (speculative.py's syntax)")
    ap.add_argument("--modes", default="adaptive", help="fixed, adaptive or both (comma-separated)")
    ap.add_argument("--concurrency", default="1,4")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--against-policy", type=Path, default=None,
                    help="another version of engine/adaptive/policy.py: each adaptive engine gets a twin with "
                         "its policy")
    ap.add_argument("--lockstep", action="store_true",
                    help="run each level on all engines at once, one step of each in turn (see the docstring)")
    ap.add_argument("--keep-logs", type=Path, default=None,
                    help="folder to keep every engine's pass log in (for `specserve bench trace`)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    levels = [int(c) for c in a.concurrency.split(",")]
    modes = a.modes.split(",")
    if not levels or min(levels) < 1 or not set(modes) <= {"fixed", "adaptive"}:
        raise ValueError("--concurrency needs levels >= 1 (e.g. 1,4); --modes is fixed, adaptive or both")
    base = LLM(a.model)
    dataset = load_dataset("coding", a.num_prompts, 0)
    encoded = {c: [base.encode(p.text) for p in sample_prompts(dataset, max(a.num_prompts, 2 * c), 0)]
               for c in levels}
    engines = {"NONE": base.make_engine(EngineConfig(), plain=True)}
    for cfg in a.config:
        llm = LLM(a.model, speculative=parse_config(cfg, a.model))
        for mode in modes:
            eng = engines[f"{cfg} {mode}"] = llm.make_engine(EngineConfig(), adaptive=mode == "adaptive")
            if a.against_policy is not None and eng.policy is not None:
                twin = engines[f"{cfg} {mode} @against"] = llm.make_engine(EngineConfig(), adaptive=True)
                assert llm.drafter_builder is not None
                twin.policy = load_policy_class(a.against_policy)(
                    eng.policy.profile, eng.max_draft, stepwise=llm.drafter_builder.stepwise)
    print(json.dumps(measure(engines, encoded, a.rounds, a.output_len, a.temperature, a.keep_logs, a.lockstep),
                     indent=1))


if __name__ == "__main__":
    main()

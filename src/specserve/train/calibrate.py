"""Calibrating a trained DFlash drafter's DDTree: the temperature its block distributions are taken at before
the tree is built (`dflash_config.tree_temperature`, greedy requests) or before drafts are drawn from them
(`dflash_config.sample_temperature`, a multiplier of a sampling request's temperature), and how deep a tree's
first path is shown to the drafter (`dflash_config.greedy_reveal` / `sample_reveal`, one block forward per
token: measured here by accept length only, which a reveal raises at the price of a drafter forward).

DDTree keeps the `budget` most probable prefixes under the drafter's distributions; a drafter trained with a
soft cross-entropy is often less sure of its top token than it should be, which spends the budget on siblings
where a deeper path would be accepted; a drafter trained on the target's greedy continuations is surer than
the target when it samples, so drafts drawn from it are rejected more than they need be. Each temperature of
the grid is measured by mean accept length (the real speculative loop, `train/evaluate.py`; sampled at
`temperature`, averaged over `seeds` seeds, when calibrating `sample_temperature`) on a validation suite:
prompts from the training split, never an evaluation suite. The best one is written into the drafter's
config.json with `write`; the weights are not touched, and the output of speculative decoding is the
target's at every temperature (only the drafts change).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specserve.bench.suites import HELDOUT
from specserve.models.llama import CausalLM
from specserve.models.loader import load_model
from specserve.speculative.dflash.checkpoint import read_dflash_config
from specserve.train.evaluate import AcceptanceEvaluator, EvalConfig

GREEDY_GRID = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
SAMPLED_GRID = (1.0, 1.15, 1.3, 1.45, 1.6)
REVEAL_GRID = (0.0, 1.0, 2.0, 3.0)
FIELDS = ("tree_temperature", "sample_temperature", "greedy_reveal", "sample_reveal")
AS_TRAINED = {"tree_temperature": 1.0, "sample_temperature": 1.0, "greedy_reveal": 0, "sample_reveal": 0}
REVEALS = ("greedy_reveal", "sample_reveal")


@dataclass(frozen=True)
class CalibrateConfig:
    drafter: Path
    suite: str  # a JSONL of training-split prompts (`python -m specserve.train.prompts --kind continuations`)
    grid: tuple[float, ...] = GREEDY_GRID
    target: str = "demo"
    num_prompts: int | None = 64
    max_new_tokens: int = 32
    ddtree_budget: int = 16
    write: bool = False
    temperature: float = 0.0  # 0: calibrate tree_temperature (greedy); > 0: sample_temperature at this one
    seeds: int = 1  # sampled measurements averaged over seeds 0..seeds-1
    field: str | None = None  # None: tree_temperature or sample_temperature, by `temperature`

    def __post_init__(self) -> None:
        if self.field is not None and self.field not in FIELDS:
            raise ValueError(f"--field {self.field} is not one of {', '.join(FIELDS)}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0 (0 calibrates the greedy tree), got {self.temperature}")
        if self.field in ("tree_temperature", "greedy_reveal") and self.temperature > 0:
            raise ValueError(f"--field {self.field} acts on greedy trees: calibrate it with --temperature 0")
        if self.field in ("sample_temperature", "sample_reveal") and self.temperature == 0:
            raise ValueError(f"--field {self.field} acts on sampled decoding: give --temperature > 0")
        if self.calibrated in REVEALS:
            if any(t < 0 or t != int(t) for t in self.grid) or not self.grid:
                raise ValueError(f"--grid for {self.calibrated} must list whole numbers >= 0, got {list(self.grid)}")
        elif not self.grid or any(not t > 0 for t in self.grid):
            raise ValueError(f"--grid must list temperatures > 0, got {list(self.grid)}")
        if self.seeds < 1:
            raise ValueError(f"--seeds must be at least 1, got {self.seeds}")
        if self.suite in (*HELDOUT, "coding10", "coding10-chat"):
            raise ValueError(f"--suite {self.suite}: calibrate on training-split prompts, not an evaluation suite")

    @property
    def calibrated(self) -> str:
        """The dflash_config field the grid is for."""
        return self.field or ("tree_temperature" if self.temperature == 0 else "sample_temperature")


def calibrate_tree_temperature(cfg: CalibrateConfig, progress: bool = True) -> dict[str, Any]:
    """Mean accept length at each value of the grid; the best, written with `cfg.write`."""
    read_dflash_config(cfg.drafter)  # a DFlash drafter directory, or a clear error before the target loads
    target, _, target_dir = load_model(cfg.target, torch.device("cpu"), torch.float32)
    assert isinstance(target, CausalLM)
    field = cfg.calibrated
    evaluators = [AcceptanceEvaluator("dflash", target, target_dir, EvalConfig(
        suite=cfg.suite, num_prompts=cfg.num_prompts, max_new_tokens=cfg.max_new_tokens,
        ddtree_budget=cfg.ddtree_budget, temperature=cfg.temperature, seed=seed))
        for seed in range(cfg.seeds if cfg.temperature > 0 else 1)]
    raw = json.loads((cfg.drafter / "config.json").read_text())
    results: dict[float, float] = {}
    grid = [int(t) for t in cfg.grid] if field in REVEALS else list(cfg.grid)
    with tempfile.TemporaryDirectory(prefix="calibrate-") as tmp:
        view = Path(tmp)  # the drafter's files, with the config.json of each temperature in turn
        for f in cfg.drafter.iterdir():
            if f.is_file() and f.name != "config.json":
                (view / f.name).symlink_to(f.resolve())
        for tau in tqdm(grid, desc=field.replace("_", " "), disable=not progress):
            (view / "config.json").write_text(json.dumps(_with_value(raw, field, tau), indent=2) + "\n")
            runs = [e.measure(view).accept_length for e in evaluators]
            results[tau] = round(sum(runs) / len(runs), 4)
    best = max(results, key=lambda t: (results[t], t == AS_TRAINED[field]))  # ties keep the drafter as trained
    if cfg.write:
        (cfg.drafter / "config.json").write_text(json.dumps(_with_value(raw, field, best), indent=2) + "\n")
    return {"drafter": str(cfg.drafter), "field": field, "temperature": cfg.temperature, "seeds": len(evaluators),
            "suite": cfg.suite, "prompts": len(evaluators[0].prompts), "max_new_tokens": cfg.max_new_tokens,
            "ddtree_budget": cfg.ddtree_budget, "accept_length": {str(t): a for t, a in results.items()},
            "best": best, "written": cfg.write}


def _with_value(raw: dict[str, Any], field: str, value: float) -> dict[str, Any]:
    dcfg = {k: v for k, v in (raw.get("dflash_config") or {}).items() if k != field}
    if value != AS_TRAINED[field]:
        dcfg[field] = value
    return {**raw, "dflash_config": dcfg}

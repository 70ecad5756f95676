"""Acceptance of a drafter during training: mean accept length on validation contexts, optionally as a share
of a reference drafter's ("ours reaches 64% of the reference's streak").

The default contexts are `stdlib-val` (`train/val_cuts.py`: the standard library's validation split cut at a
line's end, after a newline and inside a line), and the figure the trainer keeps its best checkpoint by is the
headline of `bench/by_kind.py`: the worst kind's accept length over contexts whose continuation does not loop.
Decoding is the serving engine's (`engine/offline.py`, batch-invariant: each prompt decodes as it would
alone), on the target the trainer already holds, so the figure is the accept length a server would measure on
the same prompts, not a teacher-forced estimate of it. EAGLE-3 drafts a chain of `eagle_steps`; DFlash builds a
DDTree of `ddtree_budget` nodes. The loop measure (repeated 4-grams of the output) is reported with it:
greedy outputs of a small target loop, and loops flatter every drafter. Prompts too long for the target's
context keep their last tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specserve.bench.acceptance import repeated_ngram_fraction
from specserve.bench.by_kind import kind_summary
from specserve.bench.suites import load_suite
from specserve.config import SpeculativeConfig
from specserve.engine.batch import BatchEngine
from specserve.engine.engine_config import EngineConfig
from specserve.engine.offline import generate_batch, kv_blocks_needed
from specserve.models.llama import CausalLM
from specserve.speculative.factory import DrafterBuilder, plan_drafter
from specserve.tokenizer import Tokenizer
from specserve.train.val_cuts import SUITE, validation_cuts
from specserve.types import SamplingParams

ALGORITHM = {"eagle3": "EAGLE3", "dflash": "DFLASH", "dflash2": "DFLASH"}


@dataclass(frozen=True)
class EvalConfig:
    suite: str = SUITE  # stdlib-val | coding10 | heldout-code | FILE.jsonl (never training prompts)
    num_prompts: int | None = 12
    max_new_tokens: int = 32
    temperature: float = 0.0
    seed: int = 0
    eagle_steps: int = 5
    ddtree_budget: int = 16

    def __post_init__(self) -> None:
        SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature)
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"--eval-prompts must be at least 1, got {self.num_prompts}")
        if self.eagle_steps < 1 or self.ddtree_budget < 1:
            raise ValueError("--eval-eagle-steps and --eval-ddtree-budget must be at least 1")


@dataclass(frozen=True)
class Acceptance:
    accept_length: float  # mean over every verify step of every prompt
    verify_steps: int
    tokens: int
    loop_4gram: float  # mean over prompts
    rows: list[dict[str, Any]]  # per prompt: kind, accept_length, verify_steps, loop_4gram (`bench/by_kind.py`)


def drafter_spec(kind: str, path: Path, cfg: EvalConfig) -> SpeculativeConfig:
    if kind not in ALGORITHM:
        raise ValueError(f"unknown drafter kind {kind!r}; use one of {', '.join(ALGORITHM)}")
    if kind == "eagle3":
        return SpeculativeConfig.resolve("EAGLE3", str(path), num_steps=cfg.eagle_steps, eagle_topk=1)
    return SpeculativeConfig.resolve("DFLASH", str(path), num_draft_tokens=cfg.ddtree_budget, tree="ddtree")


class AcceptanceEvaluator:
    """Called with a drafter directory; returns accept length, loop measure and the reference comparison."""

    def __init__(self, kind: str, target: CausalLM, target_dir: Path, cfg: EvalConfig,
                 reference: Path | None = None) -> None:
        self.kind, self.target, self.cfg, self.reference = kind, target, cfg, reference
        self.tokenizer = Tokenizer(target_dir)
        eos = set(target.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_ids = tuple(sorted(eos))
        # Prompts longer than the target's context allows (with the horizon and a verify tree) keep their end.
        room = target.config.max_position_embeddings - cfg.max_new_tokens - 2 * max(cfg.ddtree_budget,
                                                                                      cfg.eagle_steps + 1)
        if room < 1:
            raise ValueError(f"--eval-max-new-tokens {cfg.max_new_tokens} leaves no room for a prompt in the "
                             f"target's context of {target.config.max_position_embeddings}")
        self.prompts: list[list[int]] = []
        tasks = (validation_cuts(cfg.num_prompts or 12, cfg.seed) if cfg.suite == SUITE
                 else load_suite(cfg.suite)[: cfg.num_prompts])
        self.kinds = [t.kind for t in tasks]
        for task in tasks:
            text = task.prompt if task.messages is None else self.tokenizer.apply_chat_template(task.messages)
            self.prompts.append(self.tokenizer.encode(text or "")[-room:])
        self.params = SamplingParams(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, seed=cfg.seed,
                                     ignore_eos=True)
        self._reference: Acceptance | None = None

    def measure(self, drafter_dir: Path) -> Acceptance:
        spec = drafter_spec(self.kind, drafter_dir, self.cfg)
        weight = self.target.lm_head.weight
        builder = DrafterBuilder(plan_drafter(spec, self.target.config), self.target, weight.device, weight.dtype)
        steps: list[int] = []
        loops: list[float] = []
        rows: list[dict[str, Any]] = []
        tokens = 0
        was_training = self.target.training
        self.target.eval()
        params = [self.params] * len(self.prompts)
        blocks = kv_blocks_needed(self.prompts, params, EngineConfig.kv_block_size, builder.max_tree_nodes,
                                  self.target.config.max_position_embeddings)
        config = EngineConfig(num_kv_blocks=blocks, max_num_seqs=len(self.prompts), batch_invariant=True)
        engine = BatchEngine(self.target, self.eos_ids, self.tokenizer.decode, config, builder)
        for res, kind in zip(generate_batch(engine, self.prompts, params, self.tokenizer.decode), self.kinds,
                             strict=True):
            steps.extend(res.accept_lengths)
            loops.append(repeated_ngram_fraction(res.token_ids))
            tokens += res.num_tokens
            rows.append({"kind": kind, "accept_length": res.accept_length, "verify_steps": len(res.accept_lengths),
                         "loop_4gram": loops[-1]})
        self.target.train(was_training)
        return Acceptance(sum(steps) / max(1, len(steps)), len(steps), tokens, sum(loops) / max(1, len(loops)), rows)

    def __call__(self, drafter_dir: Path) -> dict[str, Any]:
        """The figures logged at an evaluation; `score` is the one the best checkpoint is chosen by."""
        ours = self.measure(drafter_dir)
        kinds = kind_summary(ours.rows)
        headline = kinds["headline_accept_length"]
        out: dict[str, Any] = {
            "accept_length": round(ours.accept_length, 4), "loop_4gram": round(ours.loop_4gram, 4),
            "verify_steps": ours.verify_steps, "headline_accept_length": headline,
            "score": headline if headline is not None else round(ours.accept_length, 4),
            **({"by_kind": {k: g["accept_length_nonlooping"] for k, g in kinds["by_kind"].items()}}
               if "by_kind" in kinds else {}),
        }
        if self.reference is not None:
            if self._reference is None:
                self._reference = self.measure(self.reference)
            ref = self._reference.accept_length
            out["reference_accept_length"] = round(ref, 4)
            out["percent_of_reference"] = round(100 * ours.accept_length / ref, 2)
        return out

"""From a SpeculativeConfig to per-request drafters: check first (no weights), load once, build per request."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from torch import nn

from specserve.config import MODEL_FREE, ModelConfig, SpeculativeConfig
from specserve.layers.quant import QuantLinear
from specserve.models.layout import column_major_projections, two_layout_heads
from specserve.models.llama import CausalLM
from specserve.models.loader import load_config, load_model, resolve_model_path
from specserve.speculative.draft_model import DraftModelDrafter, check_draft_model
from specserve.speculative.drafter import Drafter
from specserve.speculative.eagle3.compiled import CompiledChains
from specserve.speculative.ngram import NgramDrafter
from specserve.speculative.suffix import SuffixDrafter
from specserve.speculative.suffix_index import SuffixCache
from specserve.types import SamplingParams

#: Bundled drafters used when the target is named (`demo`, `smollm2`) and no draft path is given.
BUNDLED_DRAFTERS = {("demo", "EAGLE3"): "demo-eagle3", ("demo", "DFLASH"): "demo-dflash",
                    ("smollm2", "DFLASH"): "smollm2-dflash"}


def default_draft_path(algorithm: str | None, model: str) -> str | None:
    return BUNDLED_DRAFTERS.get((model, algorithm.upper())) if algorithm else None


def drafter_block_size(draft_path: str) -> int | None:
    """The `block_size` a DFlash drafter's config.json declares, if it can be read."""
    try:
        cfg = json.loads((resolve_model_path(draft_path) / "config.json").read_text())
    except (ValueError, OSError):
        return None  # the real error is raised, with its flag, when the drafter is planned
    size = cfg.get("block_size")
    return int(size) if isinstance(size, int) else None


@dataclass(frozen=True)
class DrafterPlan:
    spec: SpeculativeConfig
    draft_dir: Path | None


def plan_drafter(spec: SpeculativeConfig, target_cfg: ModelConfig) -> DrafterPlan:
    """Resolve and check the drafter against the target's config, before any weights are read."""
    if spec.algorithm in MODEL_FREE:
        return DrafterPlan(spec, None)
    assert spec.draft_model_path is not None  # SpeculativeConfig guarantees it
    draft_dir = resolve_model_path(spec.draft_model_path)
    if spec.algorithm == "STANDALONE":
        dcfg = load_config(draft_dir)
        if dcfg.vocab_size != target_cfg.vocab_size:
            raise ValueError(
                f"--speculative-draft-model-path {draft_dir}: draft vocab_size {dcfg.vocab_size} differs from "
                f"the target's {target_cfg.vocab_size}; STANDALONE needs the target's tokenizer"
            )
    elif spec.algorithm == "EAGLE3":
        from specserve.speculative.eagle3.checkpoint import check_eagle3

        check_eagle3(draft_dir, target_cfg)
    elif spec.algorithm == "DFLASH":
        from specserve.speculative.dflash.checkpoint import check_dflash

        check_dflash(draft_dir, target_cfg, spec)
    return DrafterPlan(spec, draft_dir)


class DrafterBuilder:
    """Holds the drafter's weights; `for_request` makes the per-request drafter state."""

    def __init__(self, plan: DrafterPlan, target: CausalLM, device: torch.device, dtype: torch.dtype) -> None:
        self.plan = plan
        self.spec = plan.spec
        self.target = target
        self.device = device
        self.weights: object | None = None
        # DFLASH drafts through the target's LM head: a copy in the drafter's dtype where that is not the target's
        self.head: nn.Linear | None = None
        # SUFFIX: recent requests' outputs, shared by this engine's drafters (one builder per engine)
        self.suffix_cache = (SuffixCache(plan.spec.suffix_max_cached_requests)
                             if plan.spec.algorithm == "SUFFIX" else None)
        if plan.spec.algorithm == "STANDALONE":
            assert plan.draft_dir is not None
            draft, _, _ = load_model(plan.draft_dir, device, dtype)
            assert isinstance(draft, CausalLM)
            check_draft_model(draft, target)
            self.weights = draft
        elif plan.spec.algorithm == "EAGLE3":
            from specserve.speculative.eagle3.checkpoint import load_eagle3

            assert plan.draft_dir is not None
            self.weights = load_eagle3(plan.draft_dir, target.config, device, dtype)
        elif plan.spec.algorithm == "DFLASH":
            from specserve.speculative.dflash.checkpoint import load_dflash

            assert plan.draft_dir is not None
            self.weights = load_dflash(plan.draft_dir, target.config, device, dtype)
            # a quantized target's head multiplies the block's rows through the int8 kernel itself (`layers/quant.py`),
            # never as a float product of the whole vocabulary
            quantized_head = isinstance(target.lm_head, QuantLinear) and target.lm_head.kernel
            if target.lm_head.weight.dtype != dtype and not quantized_head:
                w = target.lm_head.weight.detach()  # [V, H]
                self.head = nn.Linear(w.shape[1], w.shape[0], bias=False, device=device, dtype=dtype)
                self.head.weight.data.copy_(w)
        if device.type == "cpu" and isinstance(self.weights, nn.Module):  # as the target's (models/layout.py)
            column_major_projections(self.weights)
            two_layout_heads(self.weights)
        self.compiled: CompiledChains | None = None  # compiled drafting (`compile_drafting`), shared by the requests

    def compile_drafting(self) -> None:
        """Draft through compiled graphs where this drafter has them: EAGLE-3 greedy chains
        (`eagle3/compiled.py`). The engine calls it when it compiles its own steps (not --enforce-eager)."""
        s = self.spec
        if s.algorithm != "EAGLE3" or s.eagle_topk != 1 or self.compiled is not None:
            return
        from specserve.speculative.eagle3.model import Eagle3Model

        model, target = self.weights, self.target
        assert isinstance(model, Eagle3Model)
        if not model.rotary.can_reserve:
            return
        dtype = model.lm_head.weight.dtype

        def embed(ids: torch.Tensor) -> torch.Tensor:
            table = model.embed_tokens if model.embed_tokens is not None else target.embed
            return table(ids).to(dtype)

        self.compiled = CompiledChains(model, embed, s.num_steps)

    def drafting_warmups(self) -> list[tuple[str, Callable[[], None]]]:
        """(name, compile it now) for each compiled drafting graph a server meets: every chain length up to
        --speculative-num-steps (the adaptive policy cuts rounds short)."""
        chains = self.compiled
        if chains is None:
            return []
        width = len(self.capture) * self.target.config.hidden_size
        return [(f"eagle3 chain {s}", partial(chains.warm, s, width)) for s in range(1, chains.max_steps + 1)]

    @property
    def capture(self) -> tuple[int, ...]:
        """HF hidden_states indices the target must capture for this drafter (empty: none)."""
        cfg = getattr(self.weights, "config", None)
        if self.spec.algorithm == "EAGLE3":
            return tuple(cfg.aux_layer_ids)  # type: ignore[union-attr]
        if self.spec.algorithm == "DFLASH":
            return tuple(cfg.capture)  # type: ignore[union-attr]
        return ()

    @property
    def stepwise(self) -> bool:
        """Whether drafting runs one forward per draft token (EAGLE-3 and draft-model chains), so a round cut to
        fewer drafts also drafts less; DFlash drafts a whole block at once and n-gram lookup is nearly free."""
        s = self.spec
        return s.algorithm == "STANDALONE" or (s.algorithm == "EAGLE3" and s.eagle_topk == 1)

    @property
    def free_drafting(self) -> bool:
        """Whether drafting costs next to nothing (n-gram and suffix lookup), so plain steps can draft unverified
        trees to keep measuring acceptance (`engine/shadow.py`)."""
        return self.spec.algorithm in MODEL_FREE

    @property
    def max_tree_nodes(self) -> int:
        """Largest verify width (root included) a round can produce."""
        s = self.spec
        if s.algorithm == "DFLASH" and s.tree == "ddtree":
            return s.num_draft_tokens + 1
        return s.num_draft_tokens

    def for_request(self, params: SamplingParams, generator: torch.Generator, max_len: int) -> Drafter:
        s = self.spec
        if s.algorithm == "NGRAM":
            return NgramDrafter.from_config(s, self.device)
        if s.algorithm == "SUFFIX":
            return SuffixDrafter.from_config(s, self.suffix_cache, self.device)
        if s.algorithm == "STANDALONE":
            assert isinstance(self.weights, CausalLM)
            return DraftModelDrafter(self.weights, s, params, generator, max_len)
        if s.algorithm == "EAGLE3":
            from specserve.speculative.eagle3.drafter import Eagle3Drafter

            return Eagle3Drafter(self.weights, self.target, s, params, generator, max_len,  # type: ignore[arg-type]
                                 compiled=self.compiled)
        from specserve.speculative.dflash.drafter import DFlashDrafter

        return DFlashDrafter(self.weights, self.target, s, params, generator, max_len,  # type: ignore[arg-type]
                             head=self.head)

"""The offline API: load a target (and a drafter), generate for a list of prompts.

    llm = LLM("demo", speculative=SpeculativeConfig.resolve("NGRAM"))
    [res] = llm.generate(["def fizzbuzz(n):"], SamplingParams(max_new_tokens=64))
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from specserve.config import ModelConfig, SpeculativeConfig, parse_dtype, pick_device
from specserve.engine.plain import generate_plain
from specserve.models.layout import column_major_projections, two_layout_heads
from specserve.models.llama import CausalLM
from specserve.models.loader import load_model, resolve_model_path
from specserve.speculative.decode import generate_speculative
from specserve.speculative.factory import DrafterBuilder, plan_drafter
from specserve.tokenizer import Tokenizer
from specserve.types import GenerationResult, SamplingParams


def default_dtype(cfg_dtype: str | None, device: torch.device) -> torch.dtype:
    """`auto`: the checkpoint's dtype on CUDA; float32 on CPU.

    On CPU float32 is the exact mode: a verify forward over many tokens rounds differently from a
    one-token decode step, and in bf16 that flips near-tie argmaxes often enough that greedy
    speculative output would drift from plain greedy output (measured on the demo: 3 of 10 coding
    prompts; see benchmarks/speculative.py --dtype bfloat16). bf16 stays available with --dtype.
    """
    if device.type == "cuda":
        return parse_dtype(cfg_dtype) if cfg_dtype else torch.bfloat16
    return torch.float32


def default_draft_dtype(algorithm: str, target_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """`auto` for the drafter: bfloat16 for DFLASH on a CPU with native bf16 matrix units (AMX or AVX512-BF16),
    where its block of rows multiplies 2-6x faster than in float32; else the target's dtype (EAGLE-3 and
    draft-model chains draft a row at a time, and a one-row product runs ~2x slower in bf16 there: EAGLE3 lost
    3-14% in bf16, DFLASH gained 3-10%, `benchmarks/draft_dtype.py`). Drafts only propose: the target verifies
    them in its own dtype, so greedy output stays exactly plain greedy decoding's whatever the drafter runs in."""
    if algorithm == "DFLASH" and device.type == "cpu" and target_dtype == torch.float32 and cpu_has_native_bf16():
        return torch.bfloat16
    return target_dtype


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (Linux `/proc/cpuinfo` flags amx_bf16 / avx512_bf16);
    elsewhere oneDNN emulates bf16, slower than float32."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"amx_bf16", "avx512_bf16"})
    except OSError:
        pass
    return False


class LLM:
    def __init__(
        self,
        model: str | Path = "demo",
        device: str | None = None,
        dtype: str | None = None,
        speculative: SpeculativeConfig | None = None,
        draft_dtype: str | None = None,
    ) -> None:
        """dtype / draft_dtype: `auto` (None) or a dtype name, of the target / of the drafter's weights."""
        self.device = pick_device(device)
        model_dir = resolve_model_path(model)
        cfg = ModelConfig.from_file(model_dir / "config.json")
        self.dtype = default_dtype(cfg.torch_dtype, self.device) if dtype in (None, "auto") else parse_dtype(dtype)
        self.spec = speculative or SpeculativeConfig()
        # Check the drafter against the target's config before any weights are read.
        plan = plan_drafter(self.spec, cfg) if self.spec.enabled else None
        target, self.config, self.model_dir = load_model(model_dir, self.device, self.dtype)
        assert isinstance(target, CausalLM)
        if self.device.type == "cpu":  # faster few-row verify products (models/layout.py)
            column_major_projections(target)
            two_layout_heads(target)
        self.model: CausalLM = target
        self.tokenizer = Tokenizer(self.model_dir)
        eos = set(self.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_ids = tuple(sorted(eos))
        self.draft_dtype = (
            default_draft_dtype(self.spec.algorithm, self.dtype, self.device) if draft_dtype in (None, "auto")
            else parse_dtype(draft_dtype, "--speculative-draft-dtype")
        )
        self.drafter_builder: DrafterBuilder | None = (
            DrafterBuilder(plan, self.model, self.device, self.draft_dtype) if plan is not None else None
        )

    def encode(self, prompt: str | list[int]) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def generate(self, prompts: list[str] | list[list[int]], params: SamplingParams) -> list[GenerationResult]:
        ids = [self.encode(p) for p in prompts]
        if self.drafter_builder is None:  # plain decoding batches the prompts
            return generate_plain(self.model, ids, params, self.eos_ids, self.tokenizer.decode)
        return [self.generate_one(p, params) for p in ids]

    def generate_one(
        self, prompt_ids: list[int], params: SamplingParams,
        on_tokens: Callable[[list[int]], bool] | None = None,
    ) -> GenerationResult:
        """One request, streamed: `on_tokens(new_ids)` is called as tokens are committed (False aborts)."""
        decode = self.tokenizer.decode
        if self.drafter_builder is None:
            cb = None if on_tokens is None else (lambda _row, ids: on_tokens(ids))
            return generate_plain(self.model, [prompt_ids], params, self.eos_ids, decode, cb)[0]
        b = self.drafter_builder
        return generate_speculative(self.model, b.for_request, prompt_ids, params, self.eos_ids,
                                    b.max_tree_nodes, decode, on_tokens)

    def generate_plain(self, prompts: list[str] | list[list[int]], params: SamplingParams) -> list[GenerationResult]:
        """Plain decoding regardless of the speculative config (the reference in benchmarks)."""
        return generate_plain(self.model, [self.encode(p) for p in prompts], params, self.eos_ids,
                              self.tokenizer.decode)

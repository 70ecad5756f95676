"""The offline API: load a target (and a drafter), generate for a list of prompts.

    from specserve import LLM, SamplingParams, SpeculativeConfig
    llm = LLM("demo", speculative=SpeculativeConfig.resolve("NGRAM"))
    outs = llm.generate(["def fizzbuzz(n):", "class Stack:"], SamplingParams(max_new_tokens=64))

The prompts run as one continuous batch on the serving engine (`engine/offline.py`), which `make_engine` also
builds for the server.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from specserve.config import ModelConfig, SpeculativeConfig, parse_dtype, pick_device
from specserve.engine.batch import BatchEngine
from specserve.engine.engine_config import EngineConfig
from specserve.engine.grammar import GrammarCompiler
from specserve.engine.offline import OnTokens, generate_batch, kv_blocks_needed
from specserve.engine.pass_log import PassLog
from specserve.models.layout import column_major_projections, two_layout_heads
from specserve.models.llama import CausalLM
from specserve.models.loader import load_model, open_gguf, resolve_model_path
from specserve.models.quantize import quantize_model, resolve_quantization
from specserve.speculative.factory import DrafterBuilder, plan_drafter
from specserve.tokenizer import Tokenizer
from specserve.types import GenerationResult, SamplingParams

log = logging.getLogger("specserve.engine")


def default_dtype(cfg_dtype: str | None, device: torch.device) -> torch.dtype:
    """`auto`: the checkpoint's dtype on CUDA; float32 on CPU.

    On CPU float32 is the exact mode: a verify forward over many tokens rounds differently from a
    one-token decode step, and in bf16 that flips near-tie argmaxes often enough that greedy
    speculative output would drift from plain greedy output (measured on the demo: 3 of 10 coding
    prompts; `benchmarks/speculative.py --dtype bfloat16`). bf16 stays available with --dtype.
    """
    if device.type == "cuda":
        return parse_dtype(cfg_dtype) if cfg_dtype else torch.bfloat16
    return torch.float32


def default_draft_dtype(algorithm: str, target_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """`auto` for the drafter: bfloat16 for DFLASH on a CPU with native bf16 matrix units (AMX or AVX512-BF16),
    where its block of rows multiplies 2-6x faster than in float32; else the target's dtype (EAGLE-3 and
    draft-model chains draft a row at a time, and a one-row product runs ~2x slower in bf16 there: EAGLE3 lost
    3-14% in bf16, DFLASH gained 3-10%: docs/benchmarks.md). Drafts only propose: the target verifies
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
        engine_config: EngineConfig | None = None,
        adaptive: bool = False,
        adaptive_profile: str | Path | None = None,
        enforce_eager: bool | None = None,
        quantization: str | None = None,
        prefix_cache: bool = True,
    ) -> None:
        """dtype / draft_dtype: `auto` (None) or a dtype name, of the target / of the drafter's weights.
        engine_config: the offline engine's (None: a KV pool sized to each batch, 1 GB at most).
        adaptive: pick the draft width per step from a measured cost profile (`--speculative-adaptive`) instead
        of always drafting the configured width.
        enforce_eager: without an `engine_config`, whether the offline engines run eager (None: `EngineConfig`'s
        default, compiled decode steps built on first use: `engine/compiled.py`).
        quantization: `--quantization` auto (None), none, int4, int8 (`models/quantize.py`).
        prefix_cache: without an `engine_config`, whether the offline engines keep prompts' KV for later calls
        (off in benchmarks that repeat prompts against peers that prefill every time)."""
        self.device = pick_device(device)
        model_dir = resolve_model_path(model)
        cfg = ModelConfig.from_file(model_dir / "config.json")
        self.dtype = default_dtype(cfg.torch_dtype, self.device) if dtype in (None, "auto") else parse_dtype(dtype)
        self.quantization = resolve_quantization(quantization, model_dir, self.device)
        self.spec = speculative or SpeculativeConfig()
        # Check the drafter against the target's config before any weights are read.
        plan = plan_drafter(self.spec, cfg) if self.spec.enabled else None
        gguf = open_gguf(model_dir)  # once: its header takes seconds to parse
        target, self.config, self.model_dir = load_model(model_dir, self.device, self.dtype, source=gguf)
        assert isinstance(target, CausalLM)
        if self.quantization != "none":  # replaces the projections and the head (models/quantize.py)
            quantize_model(target, self.quantization, gguf)
        elif self.device.type == "cpu":  # faster few-row verify products (models/layout.py)
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
        self.engine_config = engine_config
        self.enforce_eager = enforce_eager
        self.prefix_cache = prefix_cache
        self.adaptive = adaptive
        self.adaptive_profile = Path(adaptive_profile) if adaptive_profile else None
        # output grammars (`SamplingParams.grammar`), compiled once per spec for this tokenizer
        self.grammars = GrammarCompiler(self.tokenizer, self.config.vocab_size, self.eos_ids)
        self._engines: dict[str, BatchEngine] = {}  # the offline engines: "spec", "plain", "reference-<drafter>"

    def encode(self, prompt: str | list[int]) -> list[int]:
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def make_engine(self, config: EngineConfig, drafters: DrafterBuilder | None = None, plain: bool = False,
                    adaptive: bool = False, profile_path: Path | None = None,
                    trace_path: Path | None = None, warm_compiled: bool = False,
                    background: bool = False) -> BatchEngine:
        """A continuous-batching engine on this target: with this LLM's drafter (or `drafters`), or plain.
        `adaptive`: its cost profile is loaded from `profile_path` (or the per-machine default) or measured
        first. `trace_path`: a JSON line per pass (`engine/pass_log.py`). `warm_compiled`: compile the decode steps
        a server meets at once now, before the profile is measured on them (else each compiles on first use);
        `background`: on a thread of their own while the engine serves eager, a missing profile measured once
        they are ready (`engine/warmup.py`)."""
        builder = None if plain else (drafters or self.drafter_builder)
        passes = PassLog(trace_path) if trace_path else None
        engine = BatchEngine(self.model, self.eos_ids, self.tokenizer.decode, config, builder, pass_log=passes,
                             grammars=self.grammars)
        if warm_compiled:
            engine.warm_compiled(background=background)
        if adaptive and (path := engine.adapt(profile_path, defer=engine.warmup is not None)) is not None:
            due = " (measured once the decode steps are compiled)" if engine.profile_due is not None else ""
            log.info("adaptive speculation: cost profile %s%s", path, due)
        return engine

    def generate(
        self, prompts: Sequence[str] | Sequence[list[int]], params: SamplingParams | Sequence[SamplingParams],
        on_tokens: OnTokens | None = None,
    ) -> list[GenerationResult]:
        """Decode all prompts as one continuous batch (speculatively where configured); results in order.
        `params`: one for all or one per prompt. `on_tokens(i, new_ids)` streams; returning False aborts prompt i."""
        return self._run("spec" if self.drafter_builder is not None else "plain", prompts, params, on_tokens)

    def generate_plain(self, prompts: Sequence[str] | Sequence[list[int]],
                       params: SamplingParams | Sequence[SamplingParams]) -> list[GenerationResult]:
        """Plain decoding regardless of the speculative config (the reference in benchmarks)."""
        return self._run("plain", prompts, params)

    def generate_with(self, drafters: DrafterBuilder, prompts: Sequence[str] | Sequence[list[int]],
                      params: SamplingParams | Sequence[SamplingParams]) -> list[GenerationResult]:
        """Decode with another drafter on this target (`bench acceptance --reference-draft`)."""
        return self._run("reference", prompts, params, drafters=drafters)

    def warm_compiled(self, max_batch: int | None = None, progress: bool = False) -> None:
        """Compile every bucket the offline engines built so far can meet up to `max_batch` rows (and each
        drafter's every tree width), so that calls timed after it compile nothing."""
        for engine in self._engines.values():
            engine.warm_compiled(progress, max_batch)

    def _run(self, kind: str, prompts: Sequence[str] | Sequence[list[int]],
             params: SamplingParams | Sequence[SamplingParams], on_tokens: OnTokens | None = None,
             drafters: DrafterBuilder | None = None) -> list[GenerationResult]:
        ids = [self.encode(p) for p in prompts]
        plist = [params] * len(ids) if isinstance(params, SamplingParams) else list(params)
        engine = self._engine(kind, ids, plist, drafters)
        return generate_batch(engine, ids, plist, self.tokenizer.decode, on_tokens)

    def _engine(self, kind: str, ids: list[list[int]], params: list[SamplingParams],
                drafters: DrafterBuilder | None) -> BatchEngine:
        """The offline engine of `kind`, kept between calls (prefix cache, adaptive policy); without an
        `engine_config` its KV pool fits the batch (capped at 1 GB) and is rebuilt larger when a batch needs it."""
        builder = None if kind == "plain" else (drafters or self.drafter_builder)
        if kind == "reference":  # one engine per drafter: each keeps its compiled steps and prefix cache
            kind = f"reference-{id(builder)}"  # the engine holds its builder, so the id is not reused
        have = self._engines.get(kind)
        if self.engine_config is not None:
            if have is None:
                have = self._engines[kind] = self._make(kind, self.engine_config, builder)
            return have
        nodes = builder.max_tree_nodes if builder is not None else 1
        need = kv_blocks_needed(ids, params, EngineConfig.kv_block_size, nodes, self.config.max_position_embeddings)
        if have is None or have.pool.num_blocks < need:
            cap = BatchEngine.pool_blocks(self.model, EngineConfig(), builder)  # the default pool bounds it
            blocks = max(64, min(need, cap))
            eager = {} if self.enforce_eager is None else {"enforce_eager": self.enforce_eager}
            config = EngineConfig(num_kv_blocks=blocks, enable_prefix_cache=self.prefix_cache, **eager)
            have = self._engines[kind] = self._make(kind, config, builder)
        return have

    def _make(self, kind: str, config: EngineConfig, builder: DrafterBuilder | None) -> BatchEngine:
        return self.make_engine(config, drafters=builder, plain=builder is None,
                                adaptive=self.adaptive and kind == "spec", profile_path=self.adaptive_profile)

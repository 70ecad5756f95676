"""What the batch engine is configured with (`EngineConfig`, validated here: the serve flags' checks), what a
step returns (`StepOutput`), what it counts (`EngineCounters`) and reports (`EngineStats`, read by the server's
metrics)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from specserve.engine.scheduler import SchedulerConfig

#: set to 1, engines run eager unless told otherwise (the test suite: hundreds of short-lived engines, which a
#: compile per shape would dominate; the tests of compiled steps ask for them)
EAGER_ENV = "SPECSERVE_ENFORCE_EAGER"


def eager_by_default() -> bool:
    """`--enforce-eager`'s default: off, unless SPECSERVE_ENFORCE_EAGER=1 is in the environment."""
    return os.environ.get(EAGER_ENV, "") == "1"


@dataclass(frozen=True)
class EngineConfig:
    num_kv_blocks: int = 0  # 0 = size from kv_cache_gb
    kv_block_size: int = 16
    kv_cache_gb: float = 1.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_waiting: int = 256
    enable_prefix_cache: bool = True
    hicache_gb: float = 0.0  # host tier size; 0 = off
    batch_invariant: bool = False
    grammar_forced_drafts: bool = True  # tokens a request's grammar forces are drafted (verified as any draft)
    enforce_eager: bool = field(default_factory=eager_by_default)  # no compiled steps (engine/compiled.py)
    cuda_graph_max_bs: int = 16  # the largest batch a compiled decode step is built for

    def __post_init__(self) -> None:
        if self.num_kv_blocks < 0:
            raise ValueError(f"--num-kv-blocks must be >= 0 (0 = from --kv-cache-gb), got {self.num_kv_blocks}")
        if self.kv_block_size < 1:
            raise ValueError(f"--kv-block-size must be at least 1, got {self.kv_block_size}")
        if self.kv_cache_gb <= 0:
            raise ValueError(f"--kv-cache-gb must be > 0, got {self.kv_cache_gb}")
        if self.hicache_gb < 0:
            raise ValueError(f"--hicache-size must be >= 0 GB (0 = no host tier), got {self.hicache_gb}")
        if self.max_waiting < 1:
            raise ValueError(f"--max-queue must be at least 1 (requests waiting before 503), got {self.max_waiting}")
        if self.cuda_graph_max_bs < 1:
            raise ValueError(f"--cuda-graph-max-bs must be at least 1 (or --enforce-eager), "
                             f"got {self.cuda_graph_max_bs}")
        SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.max_waiting)


@dataclass(frozen=True)
class RequestStats:
    """A finished request's record, on its last `StepOutput`."""

    accept_lengths: tuple[int, ...]  # tokens committed per verify round (accepted drafts + the bonus token)
    stop_text_at: int | None = None  # char offset of a matched stop string in the decoded output
    draft_tokens: tuple[int, ...] = ()  # draft nodes verified per round (beside accept_lengths)
    grammar_masks: int = 0  # constrained requests: next-token masks computed, their seconds, forced drafts
    grammar_mask_s: float = 0.0
    forced_drafts: int = 0

    def meta_info(self, completion_tokens: int, speculative: bool) -> dict[str, object]:
        """Per-request figures under SGLang's `meta_info` names, counted as `/metrics` counts them: a verify
        round is one draft tree checked by the target; accept length includes the bonus token."""
        out: dict[str, object] = {"completion_tokens": completion_tokens}
        if self.grammar_masks:
            out.update({"grammar_masks": self.grammar_masks, "grammar_mask_ms": round(1e3 * self.grammar_mask_s, 3),
                        "grammar_forced_draft_tokens": self.forced_drafts})
        if not speculative:
            return out
        rounds = len(self.accept_lengths)
        accepted = sum(self.accept_lengths) - rounds
        drafted = sum(self.draft_tokens)
        deepest = max(self.accept_lengths, default=1) - 1
        out.update({
            "spec_verify_ct": rounds,
            "spec_accept_length": round(sum(self.accept_lengths) / rounds, 4) if rounds else 0.0,
            "spec_accept_token_num": accepted,
            "spec_draft_token_num": drafted,
            "spec_accept_rate": round(accepted / drafted, 4) if drafted else 0.0,
            # [i]: rounds that accepted i drafts; [i] of per_position: rounds that accepted draft i+1
            "spec_accept_histogram": [sum(1 for n in self.accept_lengths if n - 1 == i) for i in range(deepest + 1)],
            "spec_accept_per_position": [sum(1 for n in self.accept_lengths if n - 1 > i) for i in range(deepest)],
        })
        return out


@dataclass(frozen=True)
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # set on the request's last output
    stats: RequestStats | None = None  # with finish_reason (not on aborts, nor the scheduler's "length" cut)


@dataclass
class EngineCounters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    steps: int = 0
    spec_steps: int = 0  # steps that verified drafts
    verify_rounds: int = 0  # per-request verify rounds (accept length counted over these)
    accept_sum: int = 0
    position_accepted: list[int] = field(default_factory=list)
    finished: dict[str, int] = field(default_factory=dict)
    step_s: float = 0.0  # wall time inside step()
    forward_s: float = 0.0  # of which target forwards (the rest is host work: scheduling, drafting, verifying)
    prefill_drafter_s: float = 0.0  # of which drafters taking in completed prompts
    grammar_masks: int = 0  # grammar masks computed (one per constrained row node)
    grammar_mask_s: float = 0.0  # of the drafting time, computing them
    forced_drafts: int = 0  # draft tokens that came from grammars' forced continuations
    draft_s: float = 0.0  # of the decode passes' time, drafting
    decode_s: float = 0.0  # decode passes (drafting, the forward, verifying, committing)
    merged_prefills: int = 0  # prefill chunks that rode in a decode forward (`BatchEngine._merges`)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's state and counters (what `/metrics` and `/server_info` report)."""

    num_waiting: int
    num_running: int
    max_queue: int
    prompt_tokens: int
    generation_tokens: int
    finished: dict[str, int]  # finish reason -> requests
    speculative: bool
    spec_verify_steps: int = 0
    spec_accept_length_sum: int = 0  # accepted drafts + 1, summed over verify steps
    spec_position_accepted: tuple[int, ...] = ()  # [i]: verify steps that accepted draft i+1
    # continuous-batching engine (zero where an engine has no such part)
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    kv_blocks_cached: int = 0  # held by the prefix cache
    num_preemptions: int = 0
    prefix_hit_tokens: int = 0
    prefix_miss_tokens: int = 0
    host_hit_tokens: int = 0  # prefix hits served from the host tier
    host_blocks_used: int = 0
    device_to_host_blocks: int = 0
    host_to_device_blocks: int = 0
    engine_steps: int = 0
    engine_step_seconds: float = 0.0
    engine_forward_seconds: float = 0.0  # target forwards; the rest of a step is host work
    spec_steps: int = 0  # steps that verified drafts (adaptive speculation may skip some)
    adaptive_choices: dict[int, int] = field(default_factory=dict)  # draft width -> steps
    grammars_compiled: int = 0  # output grammars compiled (cache misses)
    grammar_compile_seconds: float = 0.0
    grammar_masks: int = 0  # next-token masks computed (one per constrained row node)
    grammar_mask_seconds: float = 0.0
    forced_draft_tokens: int = 0  # draft tokens that came from grammars' forced continuations

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.kv_blocks_free / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def avg_accept_length(self) -> float | None:
        if not self.speculative:
            return None
        return self.spec_accept_length_sum / self.spec_verify_steps if self.spec_verify_steps else 0.0

"""What the batch engine is configured with (`EngineConfig`, validated here: the serve flags' checks), what a
step returns (`StepOutput`) and what it counts (`EngineCounters`, read by the server's metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.engine.scheduler import SchedulerConfig


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
        SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.max_waiting)


@dataclass(frozen=True)
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # set on the request's last output


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
    merged_prefills: int = 0  # prefill chunks that rode in a decode forward (`BatchEngine._merges`)

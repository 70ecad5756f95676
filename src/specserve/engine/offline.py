"""Offline generation on the serving engine: a list of prompts runs as one continuous batch of a `BatchEngine`.

`LLM.generate` and the evaluations (`bench acceptance`, training-time acceptance) come here, so the offline
API decodes exactly as the server does: the same scheduler, paged KV, prefix cache, drafters and verifiers.
Prompts enter as the waiting queue has room; each request's result is assembled from the engine's step outputs.
"""

from __future__ import annotations

import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specserve.engine.batch import BatchEngine
from specserve.engine.engine_config import RequestStats
from specserve.types import GenerationResult, SamplingParams

#: on_tokens(index of the prompt, its new token ids) -> False to abort that request
OnTokens = Callable[[int, list[int]], bool]


@dataclass
class _Pending:
    index: int
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: RequestStats | None = None
    finished_at: float = 0.0


def kv_blocks_needed(prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams], block_size: int,
                     max_tree_nodes: int, max_context: int) -> int:
    """KV blocks that hold every request of a batch at its longest at once (prompt, output, a verify tree)."""
    total = 0
    for p, sp in zip(prompts, params, strict=True):
        tokens = min(len(p) + sp.max_new_tokens, max_context) + max_tree_nodes + 2
        total += -(-tokens // block_size)
    return total


def accept_per_position(accept_lengths: Sequence[int]) -> list[float]:
    """[i]: the share of verify rounds that accepted draft i+1 (accept length > i+1)."""
    rounds = max(1, len(accept_lengths))
    deepest = max(accept_lengths, default=1) - 1
    return [sum(1 for n in accept_lengths if n - 1 >= i) / rounds for i in range(1, deepest + 1)]


@torch.inference_mode()
def generate_batch(
    engine: BatchEngine,
    prompts: Sequence[list[int]],
    params: Sequence[SamplingParams],
    decode: Callable[[list[int]], str],
    on_tokens: OnTokens | None = None,
) -> list[GenerationResult]:
    """Decode every prompt on `engine` until all finish; results in prompt order.

    Raises ValueError (nothing left running) for an empty prompt or one that leaves no room in the context.
    """
    if len(prompts) != len(params):
        raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
    tag = uuid.uuid4().hex[:12]  # request ids unique across calls on one engine (its prefix cache persists)
    jobs = {f"offline-{tag}-{i}": _Pending(i, list(p)) for i, p in enumerate(prompts)}
    queue = deque(jobs)
    c = engine.counters
    t0, draft0, decode0 = time.perf_counter(), c.draft_s, c.decode_s
    try:
        while queue or engine.has_unfinished:
            while queue and engine.scheduler.num_waiting < engine.config.max_waiting:
                rid = queue[0]
                engine.add_request(rid, jobs[rid].prompt, params[jobs[rid].index])
                queue.popleft()
            for out in engine.step():
                job = jobs[out.request_id]
                job.tokens += out.new_token_ids
                if out.finish_reason is not None:
                    job.finish_reason, job.stats, job.finished_at = out.finish_reason, out.stats, time.perf_counter()
                elif on_tokens is not None and out.new_token_ids and not on_tokens(job.index, out.new_token_ids):
                    engine.abort(out.request_id)
                    job.finish_reason, job.finished_at = "abort", time.perf_counter()
                if out.finish_reason is not None and on_tokens is not None and out.new_token_ids:
                    on_tokens(job.index, out.new_token_ids)
    except BaseException:
        for rid, job in jobs.items():  # leave the engine as it was: nothing of this batch keeps running
            if job.finish_reason is None:
                engine.abort(rid)
        raise
    draft_s, decode_s = c.draft_s - draft0, c.decode_s - decode0
    results: list[GenerationResult] = []
    speculative = engine.drafters is not None
    for job in jobs.values():
        steps = list(job.stats.accept_lengths) if job.stats is not None else []
        text = decode(job.tokens)
        if job.stats is not None and job.stats.stop_text_at is not None:
            text = text[: job.stats.stop_text_at]
        if not speculative:
            steps = [1] * len(job.tokens)
        assert job.finish_reason is not None
        results.append(GenerationResult(
            token_ids=job.tokens, text=text, finish_reason=job.finish_reason, prompt_tokens=len(job.prompt),
            elapsed_s=job.finished_at - t0, num_verify_steps=len(steps), accept_lengths=steps,
            accept_per_position=accept_per_position(steps) if speculative else [],
            draft_s=draft_s, verify_s=decode_s - draft_s,
        ))
    return results

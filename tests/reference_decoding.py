"""Plain (non-speculative) decoding: the lossless reference every speculative path must match."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from specserve.engine.stops import StopChecker
from specserve.kv.contiguous import KVCache
from specserve.layers.sampling import make_generator, pick
from specserve.models.llama import CausalLM
from specserve.types import GenerationResult, SamplingParams


@torch.inference_mode()
def generate_plain(
    model: CausalLM,
    prompts: list[list[int]],
    params: SamplingParams,
    eos_ids: tuple[int, ...],
    decode: Callable[[list[int]], str] | None = None,
    on_tokens: Callable[[int, list[int]], bool] | None = None,
) -> list[GenerationResult]:
    """Decode a batch of prompts of different lengths (left-padded, one KV cache).

    `on_tokens(row, new_ids)` sees each row's tokens as they come; returning False aborts that row.
    """
    cfg = model.config
    device = model.lm_head.weight.device
    dtype = model.lm_head.weight.dtype
    if any(not p for p in prompts):
        raise ValueError("every prompt needs at least one token")
    max_ctx = cfg.max_position_embeddings
    checkers = [StopChecker(params, eos_ids, max_ctx, len(p), decode) for p in prompts]
    t0 = time.perf_counter()
    bsz, longest = len(prompts), max(len(p) for p in prompts)
    pads = [longest - len(p) for p in prompts]
    steps = max(c.limit for c in checkers)
    cache = KVCache.allocate(cfg, bsz, longest + steps, device, dtype)
    gen = make_generator(params.seed, device)

    ids = torch.tensor([[0] * pad + p for pad, p in zip(pads, prompts, strict=True)], device=device)
    pad_t = torch.tensor(pads, device=device)  # [B]
    positions = (torch.arange(longest, device=device)[None] - pad_t[:, None]).clamp(min=0)  # [B, T]
    key_ok = torch.arange(longest + steps, device=device)[None] >= pad_t[:, None]  # [B, S] not padding
    padded = any(pads)

    def mask_for(start: int, q: int) -> torch.Tensor | None:
        if not padded:
            return None if q == 1 else cache.view(start, q).mask
        causal = torch.arange(start + q, device=device)[None] <= (torch.arange(q, device=device) + start)[:, None]
        return (causal[None] & key_ok[:, None, : start + q])[:, None]  # [B, 1, Q, K]

    out = model(ids, positions, cache.view(0, longest, mask_for(0, longest)), last_only=True)
    next_tok = pick(out.logits[:, -1], params, gen)  # [B]
    cur = longest
    pos = positions[:, -1:] + 1  # [B, 1]
    while True:
        toks = next_tok.tolist()
        for row, (c, t) in enumerate(zip(checkers, toks, strict=True)):
            if not c.done:
                c.feed([t])
                if on_tokens is not None and not on_tokens(row, [t]) and not c.done:
                    c.finish_reason = "abort"
        if all(c.done for c in checkers):
            break
        out = model(next_tok[:, None], pos, cache.view(cur, 1, mask_for(cur, 1)), last_only=True)
        next_tok = pick(out.logits[:, -1], params, gen)
        cur += 1
        pos = pos + 1
    elapsed = time.perf_counter() - t0
    return [
        GenerationResult(
            token_ids=c.tokens, text=c.text(), finish_reason=c.finish_reason or "length",
            prompt_tokens=len(p), elapsed_s=elapsed, num_verify_steps=len(c.tokens),
            accept_lengths=[1] * len(c.tokens),
        )
        for c, p in zip(checkers, prompts, strict=True)
    ]

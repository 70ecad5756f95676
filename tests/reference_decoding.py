"""The test oracles: plain decoding (batched, left-padded, one contiguous KV cache) and speculative decoding of
one request, written apart from the serving engine so the engine's outputs have something independent to equal.

Speculative exactness rests on three things only: the verify forward sees each node at its true position with
an ancestor-only mask, the verifier is lossless (speculative/verify.py), and the accepted path's KV is
compacted into contiguous slots before the next round.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from specserve.engine.stops import StopChecker
from specserve.kv.contiguous import ContiguousKVCache
from specserve.layers.sampling import make_generator, pick, target_probs
from specserve.models.llama import CausalLM
from specserve.speculative.drafter import Drafter
from specserve.speculative.trees.tree import DraftTree
from specserve.speculative.verify import verify_greedy, verify_sampled
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
    cache = ContiguousKVCache.allocate(cfg, bsz, longest + steps, device, dtype)
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


#: Builds a per-request drafter: (sampling params, generator, max context length) -> Drafter.
DrafterFactory = Callable[[SamplingParams, torch.Generator, int], Drafter]


def tree_mask(tree: DraftTree, prefix: int) -> torch.Tensor:
    """[1, 1, N+1, prefix+N+1] bool: every node sees the whole prefix and its own ancestors."""
    anc = tree.ancestor_mask()  # [N+1, N+1]
    head = torch.ones(anc.shape[0], prefix, dtype=torch.bool, device=anc.device)
    return torch.cat((head, anc), dim=1)[None, None]


@torch.inference_mode()
def generate_speculative(
    model: CausalLM,
    make_drafter: DrafterFactory,
    prompt: list[int],
    params: SamplingParams,
    eos_ids: tuple[int, ...],
    max_tree_nodes: int,
    decode: Callable[[list[int]], str] | None = None,
    on_tokens: Callable[[list[int]], bool] | None = None,
) -> GenerationResult:
    """Decode one prompt. `on_tokens(new_ids)` sees tokens as they are committed; returning False aborts."""
    cfg = model.config
    device, dtype = model.lm_head.weight.device, model.lm_head.weight.dtype
    if not prompt:
        raise ValueError("the prompt needs at least one token")
    checker = StopChecker(params, eos_ids, cfg.max_position_embeddings, len(prompt), decode)
    t_start = time.perf_counter()
    max_len = len(prompt) + checker.limit + max_tree_nodes + 2
    cache = ContiguousKVCache.allocate(cfg, 1, max_len, device, dtype)
    gen = make_generator(params.seed, device)
    drafter = make_drafter(params, gen, max_len)
    capture = drafter.capture

    ids = torch.tensor([prompt], device=device)
    out = model(ids, torch.arange(len(prompt), device=device)[None], cache.view(0, len(prompt)),
                capture=capture, last_only=True)
    hidden = torch.cat(out.captured, dim=-1)[0] if capture else None  # [T, n*H]
    root = int(pick(out.logits[:, -1], params, gen).item())
    checker.feed([root])
    if on_tokens is not None and not on_tokens([root]):
        checker.finish_reason = "abort"
    drafter.prefill(prompt, hidden)
    committed = len(prompt)  # tokens whose KV the target holds; the root is not among them

    accept_lengths: list[int] = []
    depth_hits: list[int] = []
    draft_s = verify_s = 0.0
    while not checker.done:
        t0 = time.perf_counter()
        tree = drafter.propose(root)
        t1 = time.perf_counter()
        n = tree.tokens.shape[0]
        positions = (tree.depths + committed)[None]  # [1, N+1]
        mask = None if tree.is_chain else tree_mask(tree, committed)
        out = model(tree.tokens[None], positions, cache.view(committed, n, mask), capture=capture)
        logits = out.logits[0]  # [N+1, V]
        res = verify_greedy(tree, logits) if params.greedy else verify_sampled(tree, target_probs(logits, params), gen)
        path = [0, *res.accepted]
        if res.accepted and res.accepted[-1] != len(res.accepted):  # not a chain prefix: compact
            cache.move(torch.tensor(path, device=device) + committed, committed)
        tokens = tree.tokens[path].tolist()  # [root, accepted drafts...]
        verify_s += time.perf_counter() - t1
        draft_s += t1 - t0
        accept_lengths.append(len(res.accepted) + 1)
        depth_hits.append(len(res.accepted))
        taken = checker.feed([*tokens[1:], res.bonus])
        if on_tokens is not None and not on_tokens(checker.tokens[-taken:]) and not checker.done:
            checker.finish_reason = "abort"
        if checker.done:
            break
        committed += len(path)
        acc_hidden = torch.cat(out.captured, dim=-1)[0, path] if capture else None  # [k+1, n*H]
        drafter.accept(tokens, acc_hidden, res.bonus)
        root = res.bonus

    max_depth = max(depth_hits, default=0)
    steps = max(1, len(depth_hits))
    per_pos = [sum(1 for d in depth_hits if d >= i) / steps for i in range(1, max_depth + 1)]
    return GenerationResult(
        token_ids=checker.tokens, text=checker.text(), finish_reason=checker.finish_reason or "length",
        prompt_tokens=len(prompt), elapsed_s=time.perf_counter() - t_start,
        num_verify_steps=len(accept_lengths), accept_lengths=accept_lengths,
        accept_per_position=per_pos, draft_s=draft_s, verify_s=verify_s,
    )


def counts_p_value(a: Counter[Any], b: Counter[Any], n: int) -> float:
    """Chi-square p-value of two samples of n outcomes each, counted: outcomes seen 10 times or more are cells, the
    rest one cell. Fails if fewer than 3 such outcomes exist (too peaked a law leaves the test without power)."""
    from scipy.stats import chi2_contingency

    common = [k for k in set(a) | set(b) if a[k] + b[k] >= 10]
    assert len(common) >= 3, "the test needs a spread-out distribution to have power"
    table = [[a[k] for k in common] + [n - sum(a[k] for k in common)],
             [b[k] for k in common] + [n - sum(b[k] for k in common)]]
    if table[0][-1] + table[1][-1] == 0:
        table = [row[:-1] for row in table]
    return float(chi2_contingency(table)[1])


def first_pairs_p_value(speculative: list[GenerationResult], plain: list[GenerationResult]) -> float:
    """`counts_p_value` of the first two tokens' joint law, speculative runs against plain ones (as many of each)."""
    assert len(plain) == len(speculative)
    a, b = (Counter(tuple(r.token_ids[:2]) for r in rs) for rs in (speculative, plain))
    return counts_p_value(a, b, len(speculative))

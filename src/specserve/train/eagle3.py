"""EAGLE-3 training: the training-time test, unrolled over the drafter's own features.

Slot s of the drafter holds (feature of token s, embedding of token s+1) and predicts token s+2, exactly as
`speculative/eagle3/drafter.py` drafts. Step 0 feeds the target's features (fc of the three tapped
states). Step i feeds, at slot s, the drafter's own step-(i-1) output of slot s-1, so slot s at step i is
the i-th draft after the committed token c = s - i. Its attention sees what drafting would have in the KV cache:
  step-0 keys at positions <= c  (committed pairs)      step-k keys at position c + k, k = 1..i
The keys of earlier steps are kept in a list (`UnrolledKV`), so every step runs the model's own forward.
Loss of step i: soft cross-entropy against the target's distribution at position s+1 restricted to the draft
vocabulary (renormalised), over positions whose target argmax lies in the draft vocabulary and whose
predicted token is a response token; steps weighted decay^i (0.8). Logits (the drafter's and the target's) are
computed at those positions only.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specserve.kv.contiguous import ContiguousKVCache, ContiguousView
from specserve.models.llama import CausalLM
from specserve.speculative.eagle3.checkpoint import init_random_eagle3, load_eagle3, save_eagle3
from specserve.speculative.eagle3.model import Eagle3Model
from specserve.train.data import Example, collate
from specserve.train.distributed import sync
from specserve.train.features import OnlineFeatures
from specserve.train.trainer import Objective, StepLoss


@dataclass(frozen=True)
class Eagle3TrainConfig:
    ttt_steps: int = 7
    step_decay: float = 0.8
    draft_vocab_size: int | None = None  # default: min(32000, the target's vocabulary)
    aux_layer_ids: tuple[int, ...] | None = None  # default: (2, L//2, L-3) as the engines pick them
    init_from: str | None = None  # continue from an EAGLE-3 drafter directory instead of a random one
    head_from_target: bool = True  # start lm_head/norm as the target's, restricted to the draft vocabulary
    seed: int = 0

    def __post_init__(self) -> None:
        if self.ttt_steps < 1:
            raise ValueError(f"--ttt-steps must be at least 1, got {self.ttt_steps}")
        if not 0 < self.step_decay <= 1:
            raise ValueError(f"--step-decay must be in (0, 1], got {self.step_decay}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"--draft-vocab-size must be at least 1, got {self.draft_vocab_size}")


def draft_vocab_from_data(examples: list[Example], vocab_size: int, size: int) -> list[int]:
    """The `size` most frequent response tokens, sorted: the draft vocabulary. Ties (tokens no response has, with
    little data) go to the tokens more frequent in the prompts (answers quote them), then to the lower id."""
    if not 1 <= size <= vocab_size:
        raise ValueError(f"--draft-vocab-size {size} must be in [1, the target's vocab_size {vocab_size}]")
    counts = np.zeros(vocab_size, dtype=np.int64)
    prompts = np.zeros(vocab_size, dtype=np.int64)
    for e in examples:
        counts += np.bincount(e.tokens[e.prompt_len :], minlength=vocab_size)
        prompts += np.bincount(e.tokens[: e.prompt_len], minlength=vocab_size)
    order = np.lexsort((np.arange(vocab_size), -prompts, -counts))  # the last key is the primary one
    return sorted(order[:size].tolist())


def ttt_mask(length: int, step: int, device: torch.device) -> torch.Tensor:
    """[1, 1, L, (step+1)*L] bool: query slot s at `step` sees step-0 slots <= s-step and, of each step
    k = 1..step, the slot s-step+k (its own chain of drafts)."""
    s = torch.arange(length, device=device)[:, None]
    t = torch.arange(length, device=device)[None, :]
    blocks = [t <= s - step] + [t == s - step + k for k in range(1, step + 1)]
    return torch.cat(blocks, dim=1)[None, None]


@dataclass(frozen=True)
class UnrolledKV(ContiguousView):
    """A KV view for the unrolled training forward: earlier steps' keys/values live in `past` (autograd keeps
    them) instead of a cache tensor; `update` appends this step's and returns all of them."""

    past: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.past.append((k, v))  # [B, Hkv, L, D] each
        return torch.cat([p[0] for p in self.past], dim=2), torch.cat([p[1] for p in self.past], dim=2)


def ttt_unroll(
    model: Eagle3Model,
    embeds: torch.Tensor,  # [B, L, H] embeddings of token s+1
    target_states: torch.Tensor,  # [B, L, 3*Ht] the target's tapped states of token s
    steps: int,
) -> Iterator[torch.Tensor]:
    """Yields the layer output [B, L, H] of every step; slot s of step i is the i-th draft after token s-i."""
    b, length, _ = embeds.shape
    positions = torch.arange(length, device=embeds.device).expand(b, length)
    feature = model.project(target_states)  # [B, L, H]
    past: list[tuple[torch.Tensor, torch.Tensor]] = []
    for i in range(steps):
        out = model(embeds, feature, positions, UnrolledKV(ContiguousKVCache([], []), 0, length,
                                                           ttt_mask(length, i, embeds.device), past))
        yield out
        feature = torch.cat((torch.zeros_like(out[:, :1]), out[:, :-1]), dim=1)  # slot s gets slot s-1's output


def ttt_loss(
    model: Eagle3Model,
    embeds: torch.Tensor,  # [B, L, H]
    target_states: torch.Tensor,  # [B, L, 3*Ht]
    target_p: torch.Tensor,  # [N, Vd] at the valid slots (`valid.nonzero()` order): the target at position s+1
    valid: torch.Tensor,  # [B, L] bool: slot s is trained on (N of them)
    steps: int,
    decay: float,
) -> tuple[torch.Tensor, list[float]]:
    """Sum over steps of decay^i x mean soft cross-entropy, and the top-1 agreement with the target per step.
    Draft logits are computed at the trained slots only (the LM head is most of a step's cost)."""
    rows, slots = valid.nonzero(as_tuple=True)  # [N], [N]
    target_top = target_p.argmax(dim=-1)  # [N]
    total = embeds.new_zeros((), dtype=torch.float32)
    accs: list[float] = []
    for i, out in enumerate(ttt_unroll(model, embeds, target_states, steps)):
        keep = slots >= i  # slot s < i has no committed token to draft from
        n = keep.sum().clamp(min=1)
        logp = F.log_softmax(model.draft_logits(out[rows[keep], slots[keep]]).float(), dim=-1)  # [n, Vd]
        ce = -(target_p[keep] * logp).sum(dim=-1)  # [n]
        total = total + decay**i * ce.sum() / n
        accs.append(float((logp.argmax(dim=-1) == target_top[keep]).sum() / n))
    return total, accs


class Eagle3Objective(Objective):
    kind = "eagle3"
    drafter: Eagle3Model

    def __init__(self, target: CausalLM, drafter: Eagle3Model, cfg: Eagle3TrainConfig) -> None:
        self.target, self.drafter, self.cfg = target, drafter, cfg
        self.device = target.lm_head.weight.device
        self.draft_ids = torch.arange(drafter.config.draft_vocab_size, device=self.device) + drafter.d2t  # [Vd]
        self.capture = drafter.config.aux_layer_ids
        self.features = OnlineFeatures(target, self.capture)

    def loss(self, batch: list[Example], gen: torch.Generator) -> StepLoss:
        ids, lens, plens = collate(batch, self.device)  # [B, T], [B], [B]
        length = ids.shape[1] - 2
        sync(self.device)
        t0 = time.perf_counter()
        with torch.no_grad():
            f = self.features(batch, self.device)
            states = f.captured[:, :length]  # [B, L, 3*Ht]
            slot = torch.arange(length, device=self.device)[None]
            valid = ((slot + 2 < lens[:, None]) & (slot + 2 >= plens[:, None])
                     & self.drafter.t2d[f.argmax[:, 1 : length + 1]])  # [B, L]
            head = self.target.lm_head.weight[self.draft_ids]  # [Vd, Ht]
            # the target at position s+1 of every trained slot, over the draft vocabulary only: [N, Vd]
            target_p = torch.softmax(F.linear(f.hidden[:, 1 : length + 1][valid], head).float(), dim=-1)
        sync(self.device)
        target_s = time.perf_counter() - t0
        own = self.drafter.embed_tokens
        next_ids = ids[:, 1 : length + 1]  # [B, L] token s+1 of every slot
        embeds = own(next_ids) if own is not None else self.target.embed(next_ids)  # [B, L, H]
        loss, accs = ttt_loss(self.drafter, embeds, states, target_p, valid, self.cfg.ttt_steps, self.cfg.step_decay)
        return StepLoss(loss, int(lens.sum()), target_s, {"acc_first": accs[0], "acc_last": accs[-1]})

    def save_drafter(self, path: Path) -> None:
        save_eagle3(self.drafter, self.drafter.config, path)


def build_eagle3(target: CausalLM, examples: list[Example], cfg: Eagle3TrainConfig) -> Eagle3Objective:
    """A trainable drafter (fp32) for `target`: from `init_from`, or random with the draft vocabulary taken from
    the data. A drafter that does not fit the target (hidden size, vocabulary, layers) raises ValueError here."""
    tcfg = target.config
    device = target.lm_head.weight.device
    if cfg.init_from is not None:
        drafter = load_eagle3(cfg.init_from, tcfg, device, torch.float32)
        dc = drafter.config
        for flag, asked, have in (("--draft-vocab-size", cfg.draft_vocab_size, dc.draft_vocab_size),
                                  ("--aux-layer-ids", cfg.aux_layer_ids, dc.aux_layer_ids)):
            if asked is not None and asked != have:
                raise ValueError(f"{flag} {asked} differs from the {have} of --init-from {cfg.init_from}; "
                                 f"leave {flag} out to continue that drafter")
    else:
        size = cfg.draft_vocab_size or min(32000, tcfg.vocab_size)
        ids = draft_vocab_from_data(examples, tcfg.vocab_size, size)
        with tempfile.TemporaryDirectory() as d:
            init_random_eagle3(tcfg, Path(d), seed=cfg.seed, draft_token_ids=ids, aux_layer_ids=cfg.aux_layer_ids)
            drafter = load_eagle3(d, tcfg, device, torch.float32)
        if cfg.head_from_target and drafter.config.hidden_size == tcfg.hidden_size:
            with torch.no_grad():
                drafter.lm_head.weight.copy_(target.lm_head.weight[torch.tensor(ids, device=device)].float())
                drafter.norm.weight.copy_(target.model.norm.weight.float())
    drafter.train()
    for p in drafter.parameters():
        p.requires_grad_(True)
    return Eagle3Objective(target, drafter, cfg)

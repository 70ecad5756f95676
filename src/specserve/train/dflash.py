"""DFlash training: blocks [anchor token, MASK x (bs-1)] predicted in one non-causal forward.

For every sequence, anchors are sampled among response positions that have a next token (without
replacement; sequences with fewer positions than anchors use all of them). The block of anchor a sits at
positions a .. a+bs-1, sees the target's context at positions < a (its tapped states, "KV injection") and
itself bidirectionally, never the other blocks (`DFlashDraftModel.train_blocks`). Block position k >= 1
predicts token a+k through the target's own LM head; cross-entropy weighted exp(-(k-1)/gamma), gamma = 7,
over positions inside the sequence. This is the drafting of `speculative/dflash/drafter.py` with the anchor as the root.

With `soft_label_weight` = a > 0 the label of block position k is also the target's own distribution over token
a+k (its next-token distribution at position a+k-1, computed in the same target forward): loss = (1-a) x hard CE
+ a x soft CE, the soft term being distillation as EAGLE-3 trains (it sees the whole distribution, which is what
sampled verification accepts against, not one sample of it).

DFlash 2 (`train dflash2`) trains the same blocks through the drafter with its convolutions (each block's taps
stay in the block) and, jointly, its candidate selector: at block position k the candidates are the top-k of
the drafter's logits (the data token put in place of the last one when it is not among them), scored as drafting
scores them, unary logit + pairwise term given the data token before (teacher forcing; the anchor for k = 1),
with cross-entropy towards the data token, weighted as the block loss and added to it x `selector_weight`. The
unary part carries gradient into the drafter too. From a DFlash drafter (`--init-from`) the convolutions start as
the identity, so training starts from what that drafter drafts.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from specserve.models.llama import CausalLM
from specserve.speculative.dflash.checkpoint import init_random_dflash, load_dflash, save_dflash
from specserve.speculative.dflash.conv import GroupedCausalConv
from specserve.speculative.dflash.model import V2_FIELDS, DFlashDraftModel
from specserve.speculative.dflash.selector import CandidateSelector
from specserve.tokenizer import Tokenizer
from specserve.train.corpus import SPECIAL_TOKENS
from specserve.train.data import Example, collate
from specserve.train.distributed import sync
from specserve.train.features import OnlineFeatures
from specserve.train.trainer import Objective, StepLoss

MASK_TOKEN = SPECIAL_TOKENS[3]  # "<|mask|>", reserved in the demo tokenizer for this purpose


@dataclass(frozen=True)
class DFlashTrainConfig:
    block_size: int | None = None  # default 16 (or the --init-from drafter's)
    anchors_per_seq: int = 64
    gamma: float = 7.0
    num_layers: int = 2
    target_layer_ids: tuple[int, ...] | None = None  # default: spread over the target's layers
    mask_token_id: int | None = None  # default: the target tokenizer's <|mask|>
    init_from: str | None = None
    seed: int = 0
    soft_label_weight: float = 0.0  # 0: hard labels only (DFlash's recipe); 1: distillation only
    # DFlash 2: (conv_kernel_size, conv_group_size, selector_rank, selector_top_k), or None for DFlash
    dflash2: tuple[int, int, int, int] | None = None
    selector_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.dflash2 is not None and min(self.dflash2) < 1:
            raise ValueError(f"--conv-kernel-size, --conv-group-size, --selector-rank and --selector-top-k must be "
                             f">= 1, got {self.dflash2}")
        if self.selector_weight < 0:
            raise ValueError(f"--selector-weight must be >= 0, got {self.selector_weight}")
        if not 0.0 <= self.soft_label_weight <= 1.0:
            raise ValueError(f"--soft-label-weight must be in [0, 1], got {self.soft_label_weight}")
        if self.block_size is not None and self.block_size < 2:
            raise ValueError(f"--block-size must be at least 2, got {self.block_size}")
        if self.anchors_per_seq < 1 or self.num_layers < 1:
            raise ValueError("--anchors-per-seq and --num-layers must be at least 1")
        if self.gamma <= 0:
            raise ValueError(f"--gamma must be positive, got {self.gamma}")


def sample_anchors(lens: torch.Tensor, prompt_lens: torch.Tensor, n: int,
                   gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """lens, prompt_lens [B] -> anchors [B, N] (sorted) in [prompt_len, len-2], and ok [B, N] (False: padding
    for a sequence with fewer than N such positions)."""
    anchors = torch.zeros(len(lens), n, dtype=torch.long)
    ok = torch.zeros(len(lens), n, dtype=torch.bool)
    for row, (t, p) in enumerate(zip(lens.tolist(), prompt_lens.tolist(), strict=True)):
        count = t - 1 - p  # positions p .. t-2
        take = min(n, count)
        picked = torch.randperm(count, generator=gen)[:take] + p
        anchors[row, :take] = picked.sort().values
        anchors[row, take:] = p
        ok[row, :take] = True
    return anchors.to(lens.device), ok.to(lens.device)


def position_weights(block_size: int, gamma: float, device: torch.device) -> torch.Tensor:
    """[bs]: 0 for the anchor itself, exp(-(k-1)/gamma) for block position k >= 1."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    return torch.where(k >= 1, torch.exp(-(k - 1) / gamma), torch.zeros_like(k))


def block_batch(ids: torch.Tensor, lens: torch.Tensor, anchors: torch.Tensor, ok: torch.Tensor, block_size: int,
                mask_token_id: int, gamma: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [B, T] -> block inputs [B, N*bs] ([anchor token, MASK...] per block), labels [B, N*bs] (token at
    anchor+k), weights [B, N*bs] (position weight; 0 outside the sequence or for padded anchors)."""
    t = ids.shape[1]
    pos = anchors[:, :, None] + torch.arange(block_size, device=ids.device)  # [B, N, bs]
    inputs = torch.full_like(pos, mask_token_id)
    inputs[:, :, 0] = ids.gather(1, anchors)
    labels = ids.gather(1, pos.clamp(max=t - 1).flatten(1))  # [B, N*bs]
    inside = (pos < lens[:, None, None]) & ok[:, :, None]  # [B, N, bs]
    weights = position_weights(block_size, gamma, ids.device) * inside
    return inputs.flatten(1), labels, weights.flatten(1)


def dflash_loss(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                soft: torch.Tensor | None = None, soft_weight: float = 0.0) -> torch.Tensor:
    """logits [B, Q, V], labels/weights [B, Q], soft [B, Q, V] (target probabilities, rows summing to 1)
    -> sum(w * ((1-a) CE(labels) + a CE(soft))) / sum(w), a = soft_weight."""
    logp = F.log_softmax(logits.float(), dim=-1)  # [B, Q, V]
    ce = -logp.gather(-1, labels[..., None])[..., 0]  # [B, Q]
    if soft is not None and soft_weight > 0:
        ce = (1.0 - soft_weight) * ce - soft_weight * (soft * logp).sum(dim=-1)
    return (ce * weights).sum() / weights.sum().clamp(min=1e-9)


def soft_labels(target_logits: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """target_logits [B, T, V] (position j: distribution of token j+1) -> [B, N*bs, V]: for block position k of
    anchor a, the target's distribution of token a+k (rows past the sequence are clamped; their weight is 0)."""
    t = target_logits.shape[1]
    pos = anchors[:, :, None] + torch.arange(block_size, device=anchors.device)  # [B, N, bs]
    src = (pos - 1).clamp(min=0, max=t - 1).flatten(1)  # [B, N*bs]
    rows = torch.arange(target_logits.shape[0], device=anchors.device)[:, None]
    return torch.softmax(target_logits.float(), dim=-1)[rows, src]


def block_streak(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor, block_size: int) -> float:
    """Teacher-forced accept length of greedy blocks: 1 + leading correct positions, mean over blocks."""
    b = logits.shape[0]
    correct = ((logits.argmax(dim=-1) == labels) & (weights > 0)).view(b, -1, block_size)[:, :, 1:]
    blocks = (weights.view(b, -1, block_size)[:, :, 1] > 0)  # blocks with at least one label
    streak = 1 + correct.long().cumprod(dim=-1).sum(dim=-1)  # [B, N]
    return float(streak[blocks].float().mean()) if blocks.any() else 1.0


def selector_batch(logits: torch.Tensor, labels: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, Q, V], labels [B, Q] -> candidates [B, Q, K] (the top-k, the label in place of the last one
    where it is not among them) and the label's index among them [B, Q]."""
    cands = torch.topk(logits.detach(), top_k, dim=-1).indices  # [B, Q, K]
    hit = cands == labels[..., None]
    missing = ~hit.any(dim=-1)
    cands[..., -1] = torch.where(missing, labels, cands[..., -1])
    hit = cands == labels[..., None]
    return cands, hit.float().argmax(dim=-1)


def selector_loss(selector: CandidateSelector, hidden: torch.Tensor, logits: torch.Tensor, prev: torch.Tensor,
                  labels: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, float]:
    """hidden [B, Q, H] block outputs, logits [B, Q, V], prev/labels/weights [B, Q] -> (weighted cross-entropy of
    the selector's scores over the candidates, the fraction of weighted positions where its pick is the label)."""
    cands, target = selector_batch(logits, labels, selector.top_k)
    scores = logits.float().gather(-1, cands) + selector.pair_scores(hidden, prev, cands).float()  # [B, Q, K]
    ce = F.cross_entropy(scores.flatten(0, 1), target.flatten(), reduction="none").view_as(weights)
    total = weights.sum().clamp(min=1e-9)
    with torch.no_grad():
        counted = weights > 0
        right = float(((scores.argmax(dim=-1) == target) & counted).sum() / counted.sum().clamp(min=1))
    return (ce * weights).sum() / total, right


def block_prev(ids: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """ids [B, T], anchors [B, N] -> [B, N*bs]: the data token before each block position, ids[a+k-1] (the anchor's
    own token for k = 1; for k = 0, whose weight is 0, the token before the anchor)."""
    pos = anchors[:, :, None] + torch.arange(block_size, device=ids.device) - 1  # [B, N, bs]
    return ids.gather(1, pos.clamp(min=0, max=ids.shape[1] - 1).flatten(1))


class DFlashObjective(Objective):
    kind = "dflash"
    drafter: DFlashDraftModel

    def __init__(self, target: CausalLM, drafter: DFlashDraftModel, cfg: DFlashTrainConfig) -> None:
        self.target, self.drafter, self.cfg = target, drafter, cfg
        self.kind = "dflash2" if drafter.config.is_v2 else "dflash"
        self.device = target.lm_head.weight.device
        self.block_size = drafter.config.block_size
        self.capture = drafter.config.capture
        self.features = OnlineFeatures(target, self.capture)

    def loss(self, batch: list[Example], gen: torch.Generator) -> StepLoss:
        ids, lens, plens = collate(batch, self.device)  # [B, T], [B], [B]
        anchors, ok = sample_anchors(lens, plens, self.cfg.anchors_per_seq, gen)  # [B, N]
        dcfg = self.drafter.config
        inputs, labels, weights = block_batch(ids, lens, anchors, ok, self.block_size, dcfg.mask_token_id,
                                              self.cfg.gamma)
        sync(self.device)
        t0 = time.perf_counter()
        with torch.no_grad():
            f = self.features(batch, self.device)
            features = f.captured  # [B, T, n*H]
            soft = self.cfg.soft_label_weight > 0
            target_p = soft_labels(self.target.logits(f.hidden), anchors, self.block_size) if soft else None
        sync(self.device)
        target_s = time.perf_counter() - t0
        noise = self.target.embed(inputs)  # [B, N*bs, H] (frozen: the target's embedding)
        hidden = self.drafter.train_hidden(features, noise, anchors)  # [B, N*bs, H]
        logits = self.target.logits(hidden)  # [B, N*bs, V]
        loss = dflash_loss(logits, labels, weights, target_p, self.cfg.soft_label_weight)
        with torch.no_grad():
            streak = block_streak(logits, labels, weights, self.block_size)
        extra = {"block_streak": streak}
        selector = self.drafter.candidate_selector
        if selector is not None:
            prev = block_prev(ids, anchors, self.block_size)
            sel, extra["selector_top1"] = selector_loss(selector, hidden, logits, prev, labels, weights)
            loss = loss + self.cfg.selector_weight * sel
        return StepLoss(loss, int(lens.sum()), target_s, extra)

    def save_drafter(self, path: Path) -> None:
        save_dflash(self.drafter, self.drafter.config, path)


def _mask_token(cfg: DFlashTrainConfig, target_dir: Path, vocab_size: int) -> int:
    if cfg.mask_token_id is not None:
        if not 0 <= cfg.mask_token_id < vocab_size:
            raise ValueError(f"--mask-token-id {cfg.mask_token_id} must be in [0, vocab_size {vocab_size})")
        return cfg.mask_token_id
    tid = Tokenizer(target_dir).token_to_id(MASK_TOKEN)
    if tid is None:
        raise ValueError(f"--mask-token-id: the target's tokenizer has no {MASK_TOKEN} token; pass the id of an "
                         "unused token")
    return tid


def build_dflash(target: CausalLM, target_dir: Path, cfg: DFlashTrainConfig) -> DFlashObjective:
    """A trainable drafter (fp32) for `target`, from `init_from` or random. A drafter that does not fit the
    target (hidden size, vocabulary, tapped layers) raises ValueError here, before any training."""
    tcfg = target.config
    device = target.lm_head.weight.device
    v2 = {} if cfg.dflash2 is None else dict(zip(V2_FIELDS, cfg.dflash2, strict=True))
    if cfg.init_from is not None:
        drafter = load_dflash(cfg.init_from, tcfg, device, torch.float32)
        if cfg.block_size is not None and cfg.block_size != drafter.config.block_size:
            raise ValueError(f"--block-size {cfg.block_size} differs from the block_size "
                             f"{drafter.config.block_size} of --init-from {cfg.init_from}")
        if v2 and not drafter.config.is_v2:
            drafter = dflash2_from(drafter, v2, cfg.seed)
        elif drafter.config.is_v2 != bool(v2):
            raise ValueError(f"--init-from {cfg.init_from} is a DFlash 2 drafter; train it with `train dflash2`")
    else:
        mask = _mask_token(cfg, target_dir, tcfg.vocab_size)
        with tempfile.TemporaryDirectory() as d:
            init_random_dflash(tcfg, Path(d), seed=cfg.seed, num_hidden_layers=cfg.num_layers,
                               block_size=cfg.block_size or 16, target_layer_ids=cfg.target_layer_ids,
                               mask_token_id=mask, **v2)
            drafter = load_dflash(d, tcfg, device, torch.float32)
    drafter.train()
    for p in drafter.parameters():
        p.requires_grad_(True)
    return DFlashObjective(target, drafter, cfg)


def dflash2_from(drafter: DFlashDraftModel, sizes: dict[str, int], seed: int) -> DFlashDraftModel:
    """A DFlash 2 drafter holding `drafter`'s weights, its convolutions the identity (it drafts the same blocks)
    and its selector N(0, 0.02) (a small pairwise term: both codebooks at 0 would get no gradient)."""
    cfg = replace(drafter.config, conv_kernel_size=sizes["conv_kernel_size"], conv_group_size=sizes["conv_group_size"],
                  selector_rank=sizes["selector_rank"], selector_top_k=sizes["selector_top_k"], sample_reveal=0,
                  greedy_reveal=0)
    weight = drafter.fc.weight
    with torch.device(weight.device):
        out = DFlashDraftModel(cfg).to(weight.dtype)
    missing, unexpected = out.load_state_dict(drafter.state_dict(), strict=False)
    assert not unexpected and all("conv" in k or "candidate_selector" in k for k in missing), missing
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in out.modules():
            if isinstance(m, GroupedCausalConv):
                m.reset_identity()
        assert out.candidate_selector is not None
        for p in out.candidate_selector.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    return out

"""The model runner: one target forward over a batch of rows on the paged KV cache.

A row is one sequence's new tokens this step: a prefill chunk, a decode token, or a draft tree (root
first). It attends to its whole context (the slots of its earlier positions) and, among its new tokens,
causally or by the tree's ancestor mask. Keys are laid out per row as [context | new tokens | padding].
Rows of one length run as a [B, Q] batch; rows of several lengths (a prefill chunk with decodes, trees cut
to different sizes) run packed: their T tokens as one [1, T] sequence through the projections and MLPs, and
only attention laid out per row on the padded [B, Q_max] grid (`PagedView.pad`).

`batch_invariant=True` runs every row as its own forward with exactly the shapes offline decoding uses
(the test oracles, `tests/reference_decoding.py`), so a request's tokens do not depend on what else is in the
batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from specserve.kv.paged import PagedKVCache, PagedView
from specserve.models.llama import CausalLM

LogitRows = Literal["all", "last", "none"]


@dataclass(frozen=True)
class Row:
    token_ids: list[int]  # [q]
    positions: list[int]  # [q] RoPE positions
    write_slots: list[int]  # [q] physical slots for the new K/V
    context: list[int]  # [c] slots of the positions before, attended in full
    tree_mask: torch.Tensor | None = None  # [q, q] bool among the new tokens; None = causal
    logits: LogitRows = "all"

    @property
    def q(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class RowOutput:
    logits: torch.Tensor | None  # [q, V] ("all"), [1, V] ("last") or None
    captured: torch.Tensor | None  # [q, n*H] captured target states, when asked for


class ModelRunner:
    def __init__(self, model: CausalLM, cache: PagedKVCache, batch_invariant: bool = False) -> None:
        self.model = model
        self.cache = cache
        self.batch_invariant = batch_invariant
        self.device = cache.device

    @torch.inference_mode()
    def forward(self, rows: list[Row], capture: tuple[int, ...] = ()) -> list[RowOutput]:
        if not rows:
            return []
        if self.batch_invariant or len(rows) == 1:
            return [self._forward_one(r, capture) for r in rows]
        return self._forward_batch(rows, capture)

    def _forward_one(self, row: Row, capture: tuple[int, ...]) -> RowOutput:
        dev, q, c = self.device, row.q, len(row.context)
        write = torch.tensor(row.write_slots, device=dev)
        read = torch.tensor([row.context + row.write_slots], device=dev)  # [1, c+q]
        mask: torch.Tensor | None = None
        if q > 1:  # what offline decoding passes: causal (prefill, chain) or the tree's ancestors
            causal = torch.ones(q, q, dtype=torch.bool, device=dev).tril()
            local = row.tree_mask if row.tree_mask is not None else causal
            mask = torch.cat((torch.ones(q, c, dtype=torch.bool, device=dev), local.to(dev)), dim=1)[None, None]
        view = PagedView(self.cache, write, read, mask)
        ids = torch.tensor([row.token_ids], device=dev)
        pos = torch.tensor([row.positions], device=dev)
        last = row.logits == "last"
        out = self.model(ids, pos, view, capture=capture, last_only=last, compute_logits=row.logits != "none")
        logits = out.logits[0] if out.logits is not None else None
        captured = torch.cat(out.captured, dim=-1)[0] if capture else None
        return RowOutput(logits, captured)

    def _forward_batch(self, rows: list[Row], capture: tuple[int, ...]) -> list[RowOutput]:
        """Rows of one length as a [B, Q] batch; rows of several lengths packed: their T tokens as one [1, T]
        sequence through every projection and MLP (T rows multiplied, not B * Q_max), attention alone laid out
        per row on the padded [B, Q_max] grid (`PagedView.pad`)."""
        dev = self.device
        qs = [r.q for r in rows]
        cs = [len(r.context) for r in rows]
        q_max = max(qs)
        k_max = max(c + q for c, q in zip(cs, qs, strict=True))
        scratch = self.cache.scratch
        # each array in one conversion from Python lists (per-row tensor writes cost ~0.5 ms at 16 rows)
        ids = torch.tensor([t for r in rows for t in r.token_ids])  # [T], row after row
        pos = torch.tensor([p for r in rows for p in r.positions])
        write = torch.tensor([s for r in rows for s in r.write_slots])
        read = torch.tensor([r.context + r.write_slots + [scratch] * (k_max - c - q)
                             for r, c, q in zip(rows, cs, qs, strict=True)])  # [B, K]
        pack: torch.Tensor | None = None
        shape = (len(rows), q_max)  # rows of one length: nothing to pad
        if len(set(qs)) > 1:
            pack = torch.tensor([b * q_max + i for b, q in enumerate(qs) for i in range(q)]).to(dev)  # [T]
            shape = (1, len(ids))
        view = PagedView(self.cache, write.to(dev), read.to(dev), mask(rows, qs, cs, q_max, k_max).to(dev),
                         pack)
        out = self.model(ids.view(shape).to(dev), pos.view(shape).to(dev), view, capture=capture,
                         compute_logits=False)
        h = out.hidden.reshape(len(ids), -1)  # [T, H]
        starts = [0]
        for q in qs:
            starts.append(starts[-1] + q)
        # logits only where asked: all rows of decodes, the last row of completing prefill chunks
        want = [(i, slice(starts[i] if r.logits == "all" else starts[i + 1] - 1, starts[i + 1]))
                for i, r in enumerate(rows) if r.logits != "none"]
        logits: dict[int, torch.Tensor] = {}
        if want:
            all_logits = self.model.logits(torch.cat([h[s] for _, s in want]))  # [n, V]
            at = 0
            for i, s in want:
                n = s.stop - s.start
                logits[i] = all_logits[at:at + n]
                at += n
        captured = torch.cat(out.captured, dim=-1).reshape(len(ids), -1) if capture else None  # [T, n*H]
        return [RowOutput(logits.get(i), captured[starts[i]:starts[i + 1]] if captured is not None else None)
                for i in range(len(rows))]


def mask(rows: list[Row], qs: list[int], cs: list[int], q_max: int, k_max: int) -> torch.Tensor:
    """[B, 1, Q, K] bool: context keys for real queries; local keys by causality or the row's tree; a
    padding query sees key 0 (a row of no keys would make attention NaN)."""
    qi = torch.arange(q_max)[:, None]  # [Q, 1]
    kj = torch.arange(k_max)[None, :]  # [1, K]
    c_t = torch.tensor(cs)[:, None, None]  # [B, 1, 1]
    q_t = torch.tensor(qs)[:, None, None]
    real_q = qi[None] < q_t  # [B, Q, 1]
    m = real_q & ((kj[None] < c_t) | ((kj[None] >= c_t) & (kj[None] - c_t <= qi[None])))
    m[:, :, 0] |= ~real_q[:, :, 0]
    for i, (r, c, q) in enumerate(zip(rows, cs, qs, strict=True)):
        if r.tree_mask is not None:
            m[i, :q, c:c + q] = r.tree_mask.cpu()
    return m[:, None]

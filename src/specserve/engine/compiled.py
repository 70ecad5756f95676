"""Compiled decode steps: the target's decode and verify forwards as graphs, three shapes in all.

As SGLang and vLLM capture CUDA graphs for their decode batches, a decode pass (every row wants logits at each of
its new tokens) runs through a `torch.compile`d forward (inductor; dense weights frozen into the graph, quantized
ones left as inputs so that a second start reuses the cached graphs), one of three:
one plain decode (1 x 1, static: the latency path), B >= 2 plain decodes (N x 1, the batch dimension dynamic), or
one row's draft tree of Q >= 2 tokens (1 x N, the width dynamic). So a server compiles three graphs at start-up,
not one per batch size and tree width, and no pass is padded. Batched trees stay eager: they run packed
(`engine/runner.py`), multiplying their real tokens only. The keys' length K (context + new tokens) is dynamic in
all three, so a graph compiles once however long its rows' contexts grow. Passes outside every shape (prefill
chunks, a tree wider than `max_width`, a batch beyond `max_batch`) run eager, never fail. Measured gains and
compile times: docs/benchmarks.md, docs/real-target.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.runner import Row, RowOutput, mask
from specserve.kv.paged import PagedKVCache, PagedView
from specserve.layers.compiled_fn import Compiled, CompiledFns, compile_named
from specserve.layers.quant import QuantLinear
from specserve.models.llama import CausalLM

DYNAMIC = 0  # a shape's dimension of any size from 2 up (dynamo specializes sizes 0 and 1)

Key = tuple["Bucket", tuple[int, ...]]


@dataclass(frozen=True)
class Bucket:
    """A compiled graph's shape: batch and width each 1 or DYNAMIC (one of 1x1, Nx1, 1xN)."""

    batch: int
    width: int

    def __str__(self) -> str:
        return f"{self.batch or 'N'}x{self.width or 'N'}"


ONE, BATCH, TREE = Bucket(1, 1), Bucket(DYNAMIC, 1), Bucket(1, DYNAMIC)


class CompiledSteps:
    """Compiled forwards per bucket for one model and KV cache; `forward` returns None for a pass it does not
    hold (the caller runs it eager)."""

    def __init__(self, model: CausalLM, cache: PagedKVCache, max_batch: int, max_width: int) -> None:
        """`model`'s RoPE table must be reservable (`RotaryEmbedding.can_reserve`)."""
        self.model = model
        self.cache = cache
        self.max_batch = max_batch
        self.max_width = max_width
        self._steps: CompiledFns[Key] = CompiledFns()  # by (bucket, captured layers); their compiled and failed keys
        # dense weights frozen into the graphs; the quantized kernel's left as inputs (`compile_named`)
        self.freeze = not any(isinstance(mod, QuantLinear) for mod in model.modules())
        self.hits = 0  # passes run compiled
        self.misses = 0  # decode passes outside every bucket (run eager)
        model.rotary.reserve(model.config.max_position_embeddings, cache.device)

    @property
    def compiled_fns(self) -> CompiledFns[Key]:
        """Its compiled functions (`CompiledFns.lazy` is switched off while a background warm-up runs)."""
        return self._steps

    @property
    def buckets(self) -> list[str]:
        """The shapes compiled so far ("1x1", "Nx1", "1xN"), for /server_info."""
        return [str(b) for b in (ONE, BATCH, TREE) if any(k == b for k, _ in self._steps.ran)]

    def bucket(self, rows: list[Row]) -> Bucket | None:
        """The graph a pass of these rows runs in, or None (eager)."""
        if any(r.logits != "all" for r in rows):  # a prefill chunk rides along
            return None
        width = max(r.q for r in rows)
        if len(rows) > 1 and width > 1:  # batched trees run packed, eager: a grid would multiply B x Q rows
            return None
        if len(rows) > self.max_batch or width > self.max_width:
            return None
        return ONE if len(rows) == 1 and width == 1 else BATCH if width == 1 else TREE

    def startup_buckets(self) -> list[Bucket]:
        """The shapes a server meets: one plain decode, batches up to `max_batch`, one row's trees up to
        `max_width` (a shape left to its first use would stall serving while it compiles)."""
        return [ONE, *([BATCH] if self.max_batch > 1 else []), *([TREE] if self.max_width > 1 else [])]

    @torch.inference_mode()  # as the engine's passes run: a graph compiled under autograd would not be reused
    def warm(self, bucket: Bucket, capture: tuple[int, ...]) -> None:
        """Compile `bucket` now (at load) with a pass over the scratch slot (a failure is logged: eager)."""
        scratch = self.cache.scratch
        b, q = bucket.batch or 2, bucket.width or 2
        self._run(bucket, [Row([0] * q, list(range(q)), [scratch] * q, [scratch]) for _ in range(b)], capture,
                  warming=True)

    @torch.inference_mode()
    def forward(self, rows: list[Row], capture: tuple[int, ...]) -> list[RowOutput] | None:
        bucket = self.bucket(rows)
        out = None if bucket is None or (bucket, capture) in self._steps.failed else self._run(bucket, rows, capture)
        if out is None:
            self.misses += 1
        else:
            self.hits += 1
        return out

    def _run(self, bucket: Bucket, rows: list[Row], capture: tuple[int, ...],
             warming: bool = False) -> list[RowOutput] | None:
        dev, scratch = self.cache.device, self.cache.scratch
        q = max(r.q for r in rows)  # every row's width (batches are of one-token decodes)
        k_len = max(2, max(len(r.context) + r.q for r in rows))  # >= 2: sizes 0 and 1 specialize
        ids = torch.tensor([r.token_ids for r in rows], device=dev)  # [B, Q]
        pos = torch.tensor([r.positions for r in rows], device=dev)
        write = torch.tensor([s for r in rows for s in r.write_slots], device=dev)  # [B*Q]
        read = torch.tensor([r.context + r.write_slots + [scratch] * (k_len - len(r.context) - r.q)
                             for r in rows], device=dev)  # [B, K]
        m = mask(rows, [r.q for r in rows], [len(r.context) for r in rows], q, k_len).to(dev)  # [B, 1, Q, K]
        torch._dynamo.mark_dynamic(read, 1)
        torch._dynamo.mark_dynamic(m, 3)
        if bucket.batch == DYNAMIC:
            for t, dim in ((ids, 0), (pos, 0), (write, 0), (read, 0), (m, 0)):
                torch._dynamo.mark_dynamic(t, dim)
        if bucket.width == DYNAMIC:
            for t, dim in ((ids, 1), (pos, 1), (write, 0), (m, 2)):
                torch._dynamo.mark_dynamic(t, dim)
        out = self._steps.call((bucket, capture), lambda: self._compile(bucket, capture), f"the {bucket} decode step",
                               ids, pos, write, read, m, warming=warming)
        if out is None:
            return None
        logits, captured = out  # [B, Q, V], [B, Q, n*H]
        return [RowOutput(logits[i, :r.q], captured[i, :r.q] if capture else None) for i, r in enumerate(rows)]

    def _compile(self, bucket: Bucket, capture: tuple[int, ...]) -> Compiled:
        model, cache = self.model, self.cache

        def step(ids: torch.Tensor, pos: torch.Tensor, write: torch.Tensor, read: torch.Tensor,
                 m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            out = model(ids, pos, PagedView(cache, write, read, m), capture=capture)
            assert out.logits is not None
            feats = torch.cat(out.captured, dim=-1) if capture else out.logits.new_zeros(0)
            return out.logits, feats

        layers = "_".join(str(i) for i in capture)
        return compile_named(step, f"step_{bucket.batch or 'N'}x{bucket.width or 'N'}_{layers}_{id(self):x}",
                             freeze=self.freeze)

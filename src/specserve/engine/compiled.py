"""Compiled decode steps: the target's decode and verify forwards as static-shape graphs, one per bucket.

As SGLang and vLLM capture one CUDA graph per batch size, a decode pass (every row wants logits at each of its new
tokens) runs padded up to a bucket through a `torch.compile`d forward (inductor; weights frozen into the graph):
B plain decodes (B <= `max_batch`) as B x 1, or one row's draft tree of Q <= `max_width` tokens as 1 x Q. Batched
trees stay eager: they run packed (`engine/runner.py`), multiplying their real tokens only, where a B x Q grid
padded to the widest tree multiplied up to twice as many rows and ran slower than eager.
Padding tokens write to the cache's scratch slot and see key 0 only; padding keys point at scratch and are masked
(`runner.mask`). The keys' length K (context + new tokens) is the graph's one dynamic dimension, so a
bucket compiles once however long its rows' contexts grow. Passes outside every bucket (prefill chunks, a wider
tree, a larger batch) run eager, never fail. Measured gains and compile times: docs/benchmarks.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.engine.runner import Row, RowOutput, mask
from specserve.kv.paged import PagedKVCache, PagedView
from specserve.layers.compiled_fn import Compiled, CompiledFns, compile_named
from specserve.models.llama import CausalLM

#: padded batch sizes and tree widths (new tokens per row); a pass takes the smallest bucket that holds it
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
WIDTH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 32, 48, 64)

Key = tuple["Bucket", tuple[int, ...]]



@dataclass(frozen=True)
class Bucket:
    batch: int
    width: int

    def __str__(self) -> str:
        return f"{self.batch}x{self.width}"


def bucket_for(values: tuple[int, ...], n: int) -> int | None:
    return next((b for b in values if b >= n), None)


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
        self.hits = 0  # passes run compiled
        self.misses = 0  # decode passes outside every bucket (run eager)
        model.rotary.reserve(model.config.max_position_embeddings, cache.device)

    @property
    def buckets(self) -> list[str]:
        """The buckets compiled so far ("BxQ"), for /server_info."""
        return sorted({str(b) for b, _ in self._steps.ran}, key=lambda s: tuple(int(x) for x in s.split("x")))

    def bucket(self, rows: list[Row]) -> Bucket | None:
        """The bucket a pass of these rows runs in, or None (eager)."""
        if any(r.logits != "all" for r in rows):  # a prefill chunk rides along
            return None
        width = max(r.q for r in rows)
        if len(rows) > 1 and width > 1:  # batched trees run packed, eager: the grid would multiply B x Q rows
            return None
        b = bucket_for(BATCH_BUCKETS, len(rows)) if len(rows) <= self.max_batch else None
        q = bucket_for(WIDTH_BUCKETS, width) if width <= self.max_width else None
        return Bucket(b, q) if b is not None and q is not None else None

    def startup_buckets(self) -> list[Bucket]:
        """Plain decodes of every batch bucket up to `max_batch`, and one row's trees of every width bucket up to
        the widest (trees vary in size from step to step: a bucket left to its first use stalls serving while it
        compiles)."""
        out = [Bucket(b, 1) for b in BATCH_BUCKETS if b <= self.max_batch]
        widest = bucket_for(WIDTH_BUCKETS, self.max_width) or 0
        return out + [Bucket(1, q) for q in WIDTH_BUCKETS if 1 < q <= widest]

    @torch.inference_mode()  # as the engine's passes run: a graph compiled under autograd would not be reused
    def warm(self, bucket: Bucket, capture: tuple[int, ...]) -> None:
        """Compile `bucket` now (at load) with a pass over the scratch slot (a failure is logged: eager)."""
        scratch = self.cache.scratch
        rows = [Row([0] * bucket.width, list(range(bucket.width)), [scratch] * bucket.width, [scratch])
                for _ in range(bucket.batch)]
        self._run(bucket, rows, capture)

    @torch.inference_mode()
    def forward(self, rows: list[Row], capture: tuple[int, ...]) -> list[RowOutput] | None:
        bucket = self.bucket(rows)
        out = None if bucket is None or (bucket, capture) in self._steps.failed else self._run(bucket, rows, capture)
        if out is None:
            self.misses += 1
        else:
            self.hits += 1
        return out

    def _run(self, bucket: Bucket, rows: list[Row], capture: tuple[int, ...]) -> list[RowOutput] | None:
        b, q = bucket.batch, bucket.width
        dev, scratch = self.cache.device, self.cache.scratch
        pad = [Row([], [], [], [])] * (b - len(rows))
        qs = [r.q for r in rows] + [0] * len(pad)
        cs = [len(r.context) for r in rows] + [0] * len(pad)
        k_len = max(2, max(c + n for c, n in zip(cs, qs, strict=True)))  # >= 2: sizes 0 and 1 specialize
        ids = torch.tensor([r.token_ids + [0] * (q - r.q) for r in rows + pad], device=dev)  # [B, Q]
        pos = torch.tensor([r.positions + [0] * (q - r.q) for r in rows + pad], device=dev)
        write = torch.tensor([s for r in rows + pad for s in r.write_slots + [scratch] * (q - r.q)], device=dev)
        read = torch.tensor([r.context + r.write_slots + [scratch] * (k_len - c - n)
                             for r, c, n in zip(rows + pad, cs, qs, strict=True)], device=dev)  # [B, K]
        m = mask(rows + pad, qs, cs, q, k_len).to(dev)  # [B, 1, Q, K]
        torch._dynamo.mark_dynamic(read, 1)
        torch._dynamo.mark_dynamic(m, 3)
        out = self._steps.call((bucket, capture), lambda: self._compile(bucket, capture), f"the {bucket} decode step",
                               ids, pos, write, read, m)
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
        return compile_named(step, f"step_{bucket.batch}x{bucket.width}_{layers}_{id(self):x}")

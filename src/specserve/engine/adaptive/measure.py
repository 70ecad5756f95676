"""The cost profile of one engine: measured once, saved, reused.

The profile times real target forwards through the engine's own runner (paged KV, padded batches) for batch
sizes 1..max_num_seqs and verify widths 1..max drafts + 1, at a fixed context length. It is keyed by everything
that changes those times (model config, device, dtype, weight layout, torch version, threads, block size,
widths); a saved profile with another key is measured again and overwritten."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
from torch import nn
from tqdm import tqdm

from specserve.engine.adaptive.costs import CostProfile, monotone
from specserve.engine.compiled import CompiledSteps
from specserve.engine.engine_config import EngineConfig
from specserve.engine.runner import Row, RowOutput
from specserve.kv.block_pool import BlockPool
from specserve.kv.paged import PagedKVCache
from specserve.layers.quant import QuantLinear
from specserve.models.llama import CausalLM


class ProfiledEngine(Protocol):
    """What the measurement reads of a `BatchEngine` (which imports this package: no import of it here)."""

    model: CausalLM
    config: EngineConfig
    max_draft: int
    capture: tuple[int, ...]
    compiled: CompiledSteps | None
    pool: BlockPool
    kv: PagedKVCache

    @property
    def has_unfinished(self) -> bool: ...

    def target_forward(self, rows: list[Row]) -> list[RowOutput]: ...

log = logging.getLogger("specserve.engine")

PROFILE_CONTEXT = 128  # context tokens per row while timing
PROFILE_TOKENS = 64  # shapes of more tokens (rows x q) are continued from smaller ones, not timed


def measure_profile(
    forward: Callable[[int, int], None], key: str, batch_sizes: list[int], widths: list[int], repeats: int = 3,
    progress: Callable[[int, int], None] | None = None, max_tokens: int | None = None,
) -> CostProfile:
    """forward(batch, q) runs one target forward of that shape; the fastest of `repeats` after a warm-up, the
    grid then made `monotone`. `max_tokens`: shapes of more tokens (batch x q) are not run but continued from
    their batch's widest measured one (`extend_row`; at least two widths per batch are run): past a few dozen
    tokens a CPU forward is compute-bound, and the tall shapes took most of a fresh start's profile."""
    grid: list[list[float]] = []
    timed = [measured_widths(b, widths, max_tokens) for b in batch_sizes]
    total, done = sum(map(len, timed)), 0
    for b, row_widths in zip(batch_sizes, timed, strict=True):
        row: list[float] = []
        for q in row_widths:
            forward(b, q)
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                forward(b, q)
                times.append(time.perf_counter() - t0)
            row.append(min(times))  # noise (other processes, page faults) only ever adds time
            done += 1
            if progress is not None:
                progress(done, total)
        grid.append(extend_row(widths, row))
    return CostProfile(key, tuple(batch_sizes), tuple(widths), monotone(grid))


def measured_widths(batch: int, widths: list[int], max_tokens: int | None) -> list[int]:
    """The widths of `batch`'s row that are timed: those of at most `max_tokens` tokens, and at least two."""
    if max_tokens is None:
        return widths
    fits = [q for q in widths if batch * q <= max_tokens]
    return widths[: max(len(fits), min(2, len(widths)))]


def extend_row(widths: list[int], measured: list[float]) -> list[float]:
    """A batch's times at every width from those of its first widths: past the last one measured, in proportion
    to the tokens (a compute-bound forward's cost; its fixed part makes this an overestimate, on the side of
    drafting less)."""
    q_last, t_last = widths[len(measured) - 1], measured[-1]
    return [*measured, *(t_last * q / q_last for q in widths[len(measured):])]


def profile_forward(engine: ProfiledEngine, batch: int, q: int, slots: list[int]) -> None:
    """One target pass of `batch` rows of q new tokens over a PROFILE_CONTEXT-token context (scratch K/V in
    `slots`): what the engine's pass of that shape runs, compiled or eager."""
    ctx, new = slots[:PROFILE_CONTEXT], slots[PROFILE_CONTEXT:PROFILE_CONTEXT + q]
    row = Row(token_ids=[0] * q, positions=list(range(PROFILE_CONTEXT, PROFILE_CONTEXT + q)), write_slots=new,
              context=ctx, logits="all")
    engine.target_forward([row] * batch)


def profile_grid(max_batch: int, max_width: int) -> tuple[list[int], list[int]]:
    """Batch sizes (powers of two up to max_batch, and max_batch) and verify widths q (1 .. max_width + 1)."""
    batches = sorted({b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b <= max_batch} | {max_batch})
    widths = sorted({q for q in (1, 2, 3, 5, 9, 13, 17, 25, 33) if q <= max_width + 1} | {max_width + 1})
    return batches, widths


def profile_key(engine: ProfiledEngine) -> str:
    cfg = engine.model.config
    w = engine.model.lm_head.weight
    proj = next((m for m in engine.model.modules() if isinstance(m, nn.Linear) and m is not engine.model.lm_head),
                None)
    facts = {
        "model": {k: v for k, v in sorted(vars(cfg).items()) if isinstance(v, int | float | str | bool)},
        "device": str(w.device), "dtype": str(w.dtype), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "block": engine.config.kv_block_size,
        "max_batch": engine.config.max_num_seqs, "max_draft": engine.max_draft,
        "batch_invariant": engine.config.batch_invariant, "context": PROFILE_CONTEXT,
        # compiled decode steps (engine/compiled.py) cost less than eager ones
        "compiled": None if engine.compiled is None else [engine.compiled.max_batch, engine.compiled.max_width],
        # the projections' storage order (models/layout.py): the same weights multiply at another speed
        "weight_strides": None if proj is None else list(proj.weight.stride()),
        "head": type(engine.model.lm_head).__name__,  # one layout or two (models/layout.py), or bf16
        # weight-only quantized projections (layers/quant.py): their kind and whether the C++ kernel runs them
        "quantization": next(([m.kind, m.kernel] for m in engine.model.modules() if isinstance(m, QuantLinear)),
                             None),
        "fused_layers": engine.model.runs_fused(),  # a layer in five kernel calls (models/fused.py) costs less
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def default_profile_path(key: str) -> Path:
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "specserve" / "adaptive" / f"{key}.json"


def engine_profile(engine: ProfiledEngine, path: Path | None = None, progress: bool = True,
                   slots: list[int] | None = None) -> tuple[CostProfile, Path]:
    """Load the saved profile at `path` (default: per key under ~/.cache/specserve) or measure and save it.

    Timing writes scratch K/V: into `slots` (at least `profile_slots`, held for it), or else the pool's first
    slots, so then call it before the engine serves.
    """
    key = profile_key(engine)
    path = path or default_profile_path(key)
    saved = saved_profile(path, key)
    if saved is not None:
        return saved, path
    batches, widths = profile_grid(engine.config.max_num_seqs, engine.max_draft)
    need = profile_slots(engine.max_draft)
    if slots is None:
        if engine.has_unfinished or engine.pool.num_free != engine.pool.num_blocks:
            raise RuntimeError("measure the adaptive profile before the engine takes requests (it writes scratch "
                               "K/V), or on slots held for it")
        slots = list(range(need))
    if need > min(len(slots), engine.kv.num_slots):
        raise ValueError(f"the KV pool ({engine.kv.num_slots} slots) is too small to profile {need}-token rows")
    bar = tqdm(desc="adaptive profile", unit="shape", disable=not progress)

    def advance(_done: int, total: int) -> None:
        bar.total = total
        bar.update(1)

    profile = measure_profile(lambda b, q: profile_forward(engine, b, q, slots), key, batches, widths,
                              progress=advance, max_tokens=PROFILE_TOKENS)
    bar.close()
    try:
        profile.save(path)
    except OSError as e:  # an unwritable cache must not stop the server: use the profile, say it was not kept
        log.warning("adaptive profile not saved to %s (%s); pass --speculative-adaptive-profile PATH", path, e)
    return profile, path


def saved_profile(path: Path, key: str) -> CostProfile | None:
    """The profile saved at `path` if it was measured for `key`; None if missing, unreadable or stale."""
    if not path.exists():
        return None
    try:
        saved = CostProfile.load(path)
    except (ValueError, KeyError, json.JSONDecodeError):
        return None
    return saved if saved.key == key else None


def profile_slots(max_draft: int) -> int:
    """KV slots a profile's rows use: the context and the widest verify."""
    return PROFILE_CONTEXT + max_draft + 1

"""The target's features for drafter training: computed on the fly, or once per sequence into a disk cache.

A drafter's loss reads three things from the target for every position of a sequence: the states it taps
(`capture`, concatenated), the final normed hidden state (logits are recomputed from it through the target's
LM head, restricted to what the loss reads) and the argmax of the full logits. `OnlineFeatures` runs the target
for every batch, every epoch; `FeatureCache` reads what `build_feature_cache` wrote, so the target runs once per
sequence and the epochs after the first cost the drafter only.

Cache directory (`--feature-cache`): captured.bin [N, n*H] and hidden.bin [N, H] as bf16 bits, argmax.bin [N] int32
(N: the data's tokens, sequences concatenated in `load_data` order), done.npy (the sequences written so far: a
build that is killed resumes at the first missing one), hashes.npy (each sequence's tokens hashed: data grown by
new shards keeps the rows it had and builds the new ones), meta.json (target, capture, max_len).
"""

from __future__ import annotations

import hashlib
import json
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from specserve.models.llama import CausalLM
from specserve.train.data import Example, collate

BUILD_TOKENS = 4096  # tokens per target forward while building (sequences of similar length batched)


@dataclass(frozen=True)
class Features:
    captured: torch.Tensor  # [B, T, n*H] the tapped states, concatenated in `capture` order
    hidden: torch.Tensor  # [B, T, H] the final normed hidden state
    argmax: torch.Tensor  # [B, T] int64, the argmax of the target's logits (the token it predicts next)


class FeatureSource(ABC):
    """The target's features of a batch of sequences, right-padded to its longest (padding rows are zeros)."""

    capture: tuple[int, ...]

    @abstractmethod
    def __call__(self, batch: list[Example], device: torch.device) -> Features: ...


class OnlineFeatures(FeatureSource):
    def __init__(self, target: CausalLM, capture: tuple[int, ...]) -> None:
        self.target, self.capture = target, capture

    @torch.no_grad()
    def __call__(self, batch: list[Example], device: torch.device) -> Features:
        ids, _, _ = collate(batch, device)  # [B, T]
        return target_features(self.target, ids, self.capture)


def target_features(target: CausalLM, ids: torch.Tensor, capture: tuple[int, ...]) -> Features:
    """ids [B, T] -> the target's features at every position (causal: right padding changes no real row)."""
    positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    out = target(ids, positions, capture=capture)
    assert out.logits is not None
    return Features(torch.cat(out.captured, dim=-1), out.hidden, out.logits.argmax(dim=-1))


def _fingerprint(target_dir: Path, capture: tuple[int, ...], max_len: int) -> dict[str, Any]:
    return {"format": "specserve-feature-cache/2", "target_dir": str(target_dir), "capture": list(capture),
            "max_len": max_len}


def sequence_hashes(examples: list[Example]) -> np.ndarray:
    """[S] uint64: a hash of each sequence's tokens, what the cache checks its rows against."""
    return np.asarray([int.from_bytes(hashlib.blake2b(e.tokens.astype(np.int32).tobytes(), digest_size=8).digest(),
                                      "little") for e in examples], dtype=np.uint64)


def _bf16_bits(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.bfloat16).view(torch.int16).cpu().numpy()


class FeatureCache(FeatureSource):
    def __init__(self, path: Path, capture: tuple[int, ...], offsets: np.ndarray, widths: tuple[int, int]) -> None:
        self.path, self.capture, self.offsets = path, capture, offsets
        n = int(offsets[-1])
        self.captured = np.memmap(path / "captured.bin", dtype=np.int16, mode="r", shape=(n, widths[0]))
        self.hidden = np.memmap(path / "hidden.bin", dtype=np.int16, mode="r", shape=(n, widths[1]))
        self.argmax = np.memmap(path / "argmax.bin", dtype=np.int32, mode="r", shape=(n,))

    def __call__(self, batch: list[Example], device: torch.device) -> Features:
        t = max(len(e.tokens) for e in batch)
        cap = np.zeros((len(batch), t, self.captured.shape[1]), dtype=np.int16)
        hid = np.zeros((len(batch), t, self.hidden.shape[1]), dtype=np.int16)
        arg = np.zeros((len(batch), t), dtype=np.int64)
        for row, e in enumerate(batch):
            lo, hi = int(self.offsets[e.index]), int(self.offsets[e.index + 1])
            cap[row, : hi - lo], hid[row, : hi - lo], arg[row, : hi - lo] = (
                self.captured[lo:hi], self.hidden[lo:hi], self.argmax[lo:hi])

        def load(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).view(torch.bfloat16).to(device=device, dtype=torch.float32)

        return Features(load(cap), load(hid), torch.from_numpy(arg).to(device))


def build_feature_cache(path: Path, target: CausalLM, target_dir: Path, capture: tuple[int, ...],
                        examples: list[Example], max_len: int,
                        progress: bool = True) -> FeatureCache:
    """Open the cache at `path`, first computing whatever of it is missing (a killed build resumes). A cache
    made for other data, another target or other tapped layers is an error naming the fix."""
    if any(e.index != i for i, e in enumerate(examples)):
        raise ValueError("feature cache: the examples must come from `load_data` (their index is their position)")
    fp = _fingerprint(target_dir, capture, max_len)
    cfg = target.config
    widths = (len(capture) * cfg.hidden_size, cfg.hidden_size)
    offsets = np.zeros(len(examples) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(e.tokens) for e in examples])
    hashes = sequence_hashes(examples)
    path.mkdir(parents=True, exist_ok=True)
    meta_path, hash_path, done_path = path / "meta.json", path / "hashes.npy", path / "done.npy"
    done = np.zeros(len(examples), dtype=bool)
    if meta_path.exists():
        have = json.loads(meta_path.read_text())
        if have != fp:
            diff = sorted(k for k in fp if have.get(k) != fp[k])
            raise ValueError(f"--feature-cache {path} was built for other {', '.join(diff)}; pass a new directory "
                             "(or delete this one) to build the cache for this run")
        old = np.load(hash_path)
        if len(old) > len(hashes) or not np.array_equal(old, hashes[: len(old)]):
            raise ValueError(f"--feature-cache {path} was built for other data (its sequences are not the first ones "
                             "of --data); pass a new directory for this data")
        if done_path.exists():  # data grown by new shards: the cached rows stay, the new ones are built
            done[: len(old)] = np.load(done_path)[: len(old)]
        _grow(path, int(offsets[-1]), widths)
    else:
        meta_path.write_text(json.dumps(fp, indent=1) + "\n")
    np.save(hash_path, hashes)
    n = int(offsets[-1])
    _grow(path, n, widths)
    cap = np.memmap(path / "captured.bin", dtype=np.int16, mode="r+", shape=(n, widths[0]))
    hid = np.memmap(path / "hidden.bin", dtype=np.int16, mode="r+", shape=(n, widths[1]))
    arg = np.memmap(path / "argmax.bin", dtype=np.int32, mode="r+", shape=(n,))
    todo = sorted((i for i in range(len(examples)) if not done[i]), key=lambda i: len(examples[i].tokens))
    device = target.lm_head.weight.device
    bar = tqdm(total=len(examples), initial=len(examples) - len(todo), desc="target features", unit="seq",
               disable=not progress or not todo)
    while todo:
        longest = len(examples[todo[0]].tokens)
        take = 1
        while take < len(todo) and (take + 1) * max(longest, len(examples[todo[take]].tokens)) <= BUILD_TOKENS:
            longest = max(longest, len(examples[todo[take]].tokens))
            take += 1
        group, todo = todo[:take], todo[take:]
        ids, _, _ = collate([examples[i] for i in group], device)
        with torch.no_grad():
            f = target_features(target, ids, capture)
        for row, i in enumerate(group):
            lo, hi = int(offsets[i]), int(offsets[i + 1])
            cap[lo:hi] = _bf16_bits(f.captured[row, : hi - lo])
            hid[lo:hi] = _bf16_bits(f.hidden[row, : hi - lo])
            arg[lo:hi] = f.argmax[row, : hi - lo].cpu().numpy()
        for m in (cap, hid, arg):
            m.flush()
        done[group] = True
        tmp = path / "done.tmp.npy"
        np.save(tmp, done)
        os.replace(tmp, done_path)
        bar.update(len(group))
    bar.close()
    del cap, hid, arg
    return FeatureCache(path, capture, offsets, widths)


def _grow(path: Path, tokens: int, widths: tuple[int, int]) -> None:
    """Size the three row files for `tokens` rows (new files are created; rows already there are kept)."""
    for name, row_bytes in (("captured.bin", 2 * widths[0]), ("hidden.bin", 2 * widths[1]), ("argmax.bin", 4)):
        with (path / name).open("ab") as fh:
            if fh.tell() < tokens * row_bytes:
                fh.truncate(tokens * row_bytes)

"""Crash-safe files for training runs: atomic writes, directory swaps, RNG snapshots, log truncation.

Every file a run keeps is written next to its final name and renamed over it (`os.replace` is atomic on
POSIX), so a kill or a full disk mid-write leaves the previous version readable.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch


def atomic_torch_save(obj: Any, path: Path) -> None:
    """torch.save to `path.tmp`, fsync, rename over `path`. On failure the temp file is removed, `path`
    is untouched, and an OSError says so."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:
        tmp.unlink(missing_ok=True)
        kept = f"the previous {path.name} is intact" if path.exists() else f"no earlier {path.name} existed"
        raise OSError(f"writing checkpoint {path} failed ({e}); {kept}") from e


def replace_dir(write: Callable[[Path], None], dest: Path) -> None:
    """Call `write(tmp_dir)`, then swap the finished directory in for `dest` (old copy removed after)."""
    tmp, old = dest.with_name(dest.name + ".tmp"), dest.with_name(dest.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
    except (OSError, RuntimeError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OSError(f"writing {dest} failed ({e}); the previous {dest.name}/ is intact") from e
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        os.replace(dest, old)
    os.replace(tmp, dest)
    shutil.rmtree(old, ignore_errors=True)


def rng_state() -> dict[str, Any]:
    """The global RNGs of this process: torch (CPU and CUDA), numpy, python."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
                             "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def truncate_log(path: Path, last_step: int) -> None:
    """Drop JSON-lines records past `last_step` (written by a run that died after its last checkpoint),
    and a final line cut short by the kill."""
    if not path.exists():
        return
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    keep: list[str] = []
    for i, ln in enumerate(lines):
        try:
            record = json.loads(ln)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise ValueError(f"{path}:{i + 1}: not a JSON record; the training log is damaged") from None
        if record.get("step", 0) <= last_step:
            keep.append(ln)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(ln + "\n" for ln in keep))
    os.replace(tmp, path)


def round_to_bf16(module: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Round the weights and the optimizer's floating state to bf16 precision in place (kept in their dtype)."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(p.to(torch.bfloat16))
        for state in opt.state.values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor) and v.is_floating_point() and k != "step":
                    v.copy_(v.to(torch.bfloat16))


def bf16_copy(obj: Any) -> Any:
    """`obj` (a state dict, nested) with every floating tensor but Adam's `step` as bf16."""
    if isinstance(obj, torch.Tensor):
        return obj.to(torch.bfloat16) if obj.is_floating_point() and obj.dim() > 0 else obj
    if isinstance(obj, dict):
        return {k: v if k == "step" else bf16_copy(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(bf16_copy(v) for v in obj)
    return obj

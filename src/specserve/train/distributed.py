"""Running as one of several processes: torchrun's environment, the process group, each process's data.

Under `torchrun --nproc-per-node N` every process reads RANK / WORLD_SIZE / LOCAL_RANK; the process group
uses gloo on CPU and nccl on CUDA (one GPU per process, cuda:LOCAL_RANK). Data are sharded by `Batcher`:
every step draws one global batch from a seeded per-epoch permutation and each process takes its slice.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from specserve.config import pick_device


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def init_distributed(device: str | None) -> tuple[DistContext, torch.device]:
    """Read torchrun's environment; start the process group (gloo on CPU, nccl on CUDA) when world > 1."""
    ctx = DistContext(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                      int(os.environ.get("LOCAL_RANK", 0)))
    dev = pick_device(device)
    if dev.type == "cuda" and ctx.world > 1:
        dev = torch.device("cuda", ctx.local_rank)
        torch.cuda.set_device(dev)
    if ctx.world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return ctx, dev


def sync(device: torch.device) -> None:
    """Wait for queued GPU work so that wall-clock timings mean something."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Batcher:
    """Global batches of batch_size x world sequence indices from a seeded permutation per epoch; each
    process takes its own slice. State (epoch, position) is all a resume needs."""

    def __init__(self, n: int, batch_size: int, ctx: DistContext, seed: int) -> None:
        if n < batch_size * ctx.world:
            raise ValueError(f"--batch-size {batch_size} x {ctx.world} process(es) exceeds the {n} sequences "
                             "in --data; lower --batch-size or prepare more data")
        self.n, self.batch_size, self.ctx, self.seed = n, batch_size, ctx, seed
        self.epoch, self.pos = 0, 0

    def _perm(self) -> np.ndarray:
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.n)

    def next(self) -> list[int]:
        g = self.batch_size * self.ctx.world
        if self.pos + g > self.n:
            self.epoch, self.pos = self.epoch + 1, 0
        idx = self._perm()[self.pos : self.pos + g]
        self.pos += g
        lo = self.ctx.rank * self.batch_size
        return [int(i) for i in idx[lo : lo + self.batch_size]]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])

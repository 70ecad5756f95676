"""Bookkeeping of a bounded host-memory KV tier (SGLang's HiCache idea; `--enable-hierarchical-cache`).

Blocks the prefix cache evicts from the device pool are copied to a host slot instead of being
lost, and copied back on a later prefix hit. This class only manages host slot ids, their LRU
order and the capacity; the two copies are callbacks (`HostBlockStore` at the end holds the tensors):

    copy_out(device_block, host_slot)   device -> host, before the device block is freed
    copy_in(host_slot, device_block)    host -> device, into a freshly allocated device block

When the tier is full, storing a block drops the least recently used unpinned host block.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specserve.kv.block_pool import KVInvariantError
from specserve.kv.paged import PagedKVCache

CopyFn = Callable[[int, int], None]


@dataclass
class HostStats:
    """Counted in blocks."""

    device_to_host: int = 0
    host_to_device: int = 0
    evictions: int = 0


class HostTier:
    def __init__(self, capacity_blocks: int, copy_out: CopyFn, copy_in: CopyFn) -> None:
        if capacity_blocks < 1:
            raise ValueError(
                f"the host KV tier needs room for at least 1 block, got {capacity_blocks}: raise --hicache-size "
                "or leave --enable-hierarchical-cache off"
            )
        self.capacity = capacity_blocks
        self._copy_out = copy_out
        self._copy_in = copy_in
        self._free: deque[int] = deque(range(capacity_blocks))
        self._lru: OrderedDict[int, None] = OrderedDict()  # used slots, least recently used first
        self._pinned: set[int] = set()
        self.stats = HostStats()

    @property
    def num_used(self) -> int:
        return len(self._lru)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def lru_order(self) -> list[int]:
        """Used host slots, least recently used first."""
        return list(self._lru)

    def store(self, device_block: int) -> tuple[int | None, list[int]]:
        """Copy a device block out to a host slot.

        Returns (slot, dropped): `dropped` are host slots whose blocks were evicted to make room
        (their owner must forget them; one of those ids may be `slot` itself). `slot` is None when
        every used slot is pinned: nothing was copied.
        """
        dropped: list[int] = []
        if not self._free:
            victim = next((s for s in self._lru if s not in self._pinned), None)
            if victim is None:
                return None, dropped
            self.drop(victim)
            dropped.append(victim)
        slot = self._free.popleft()
        self._lru[slot] = None
        self._copy_out(device_block, slot)
        self.stats.device_to_host += 1
        return slot, dropped

    def load(self, host_slot: int, device_block: int) -> None:
        """Copy a host block into `device_block` and free its host slot."""
        self._check_used(host_slot)
        self._copy_in(host_slot, device_block)
        self.stats.host_to_device += 1
        self.release(host_slot)

    def release(self, host_slot: int) -> None:
        """Free a host slot whose contents are no longer needed (not counted as an eviction)."""
        self._check_used(host_slot)
        del self._lru[host_slot]
        self._pinned.discard(host_slot)
        self._free.append(host_slot)

    def drop(self, host_slot: int) -> None:
        """Evict a host block (its contents are lost)."""
        self.release(host_slot)
        self.stats.evictions += 1

    def touch(self, host_slot: int) -> None:
        self._check_used(host_slot)
        self._lru.move_to_end(host_slot)

    def pin(self, host_slot: int) -> None:
        """Protect a slot from LRU eviction (while it is being brought back)."""
        self._check_used(host_slot)
        self._pinned.add(host_slot)

    def unpin(self, host_slot: int) -> None:
        self._pinned.discard(host_slot)

    def _check_used(self, host_slot: int) -> None:
        if host_slot not in self._lru:
            raise KVInvariantError(f"host KV slot {host_slot} is not in use")


class HostBlockStore:
    """The host tier's tensors: copies of whole device blocks (K, V and features of every layer) by host
    slot, with the two copy callbacks `HostTier` takes."""

    def __init__(self, kv: PagedKVCache) -> None:
        self.kv = kv
        self._blocks: dict[int, list[torch.Tensor]] = {}

    def copy_out(self, block: int, host_slot: int) -> None:
        self._blocks[host_slot] = [t.to("cpu") for t in self.kv.read_block(block)]

    def copy_in(self, host_slot: int, block: int) -> None:
        self.kv.write_block(block, [t.to(self.kv.device) for t in self._blocks[host_slot]])

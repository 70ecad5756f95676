"""Paged KV bookkeeping on plain Python lists: a pool of fixed-size blocks and per-sequence block tables.

A block holds `block_size` consecutive token positions. Token position p of a sequence lives in
block `table[p // block_size]` at offset `p % block_size`, i.e. at physical slot
`block * block_size + offset` of the per-layer KV tensors. No tensors are built here; the model
runner turns slot lists into index tensors.

Blocks are reference counted so that several sequences (and the prefix cache) can share one.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class KVInvariantError(RuntimeError):
    """A bookkeeping invariant broke (double free, unknown block, ...): a bug in the caller, never user input."""


class OutOfBlocks(RuntimeError):
    """Fewer free blocks than requested; the caller evicts cached blocks or preempts a sequence and retries."""


class BlockPool:
    """`num_blocks` blocks of `block_size` token slots, a free list and a reference count per block."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"--num-kv-blocks must be at least 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"--kv-block-size must be at least 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._refs = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_slots(self) -> int:
        """Token slots in the whole pool."""
        return self.num_blocks * self.block_size

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks, each with reference count 1; all or nothing."""
        if n < 0:
            raise KVInvariantError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise OutOfBlocks(f"{n} KV blocks requested, {len(self._free)} free of {self.num_blocks}")
        out = [self._free.popleft() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def incref(self, block: int) -> None:
        """Share an allocated block; a free block cannot be shared."""
        self._check_id(block)
        if self._refs[block] == 0:
            raise KVInvariantError(f"incref of free KV block {block}")
        self._refs[block] += 1

    def decref(self, block: int) -> bool:
        """Drop one reference; returns True when the block went back to the free list."""
        self._check_id(block)
        if self._refs[block] == 0:
            raise KVInvariantError(f"double free of KV block {block}")
        self._refs[block] -= 1
        if self._refs[block] == 0:
            self._free.append(block)
            return True
        return False

    def free(self, blocks: Iterable[int]) -> int:
        """Drop one reference on each block; returns how many went back to the free list."""
        return sum(self.decref(b) for b in blocks)

    def ref_count(self, block: int) -> int:
        self._check_id(block)
        return self._refs[block]

    def check(self) -> None:
        """Full scan: the free list holds exactly the blocks with no reference, once each."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise KVInvariantError("a KV block appears twice in the free list")
        zero = {b for b, r in enumerate(self._refs) if r == 0}
        if free != zero:
            raise KVInvariantError(f"free list and reference counts disagree on blocks {sorted(free ^ zero)}")
        if any(r < 0 for r in self._refs):
            raise KVInvariantError("negative KV block reference count")

    def _check_id(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise KVInvariantError(f"KV block id {block} outside [0, {self.num_blocks})")


class BlockTable:
    """One sequence's blocks: token position -> (block, offset) -> physical slot.

    `num_slots` positions have a slot reserved; positions [0, num_slots) map into `blocks`.
    The table owns one reference on each of its blocks.
    """

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self._blocks: list[int] = []
        self.num_slots = 0

    @property
    def blocks(self) -> tuple[int, ...]:
        return tuple(self._blocks)

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def locate(self, pos: int) -> tuple[int, int]:
        """(block, offset) of token position `pos`."""
        if not 0 <= pos < self.num_slots:
            raise KVInvariantError(f"token position {pos} outside the {self.num_slots} reserved slots")
        return self._blocks[pos // self.block_size], pos % self.block_size

    def slot(self, pos: int) -> int:
        block, offset = self.locate(pos)
        return block * self.block_size + offset

    def slots(self, start: int, end: int) -> list[int]:
        """Physical slots of token positions [start, end)."""
        if not 0 <= start <= end <= self.num_slots:
            raise KVInvariantError(f"slot range [{start}, {end}) outside the {self.num_slots} reserved slots")
        bs = self.block_size
        return [self._blocks[p // bs] * bs + p % bs for p in range(start, end)]

    def blocks_for(self, num_slots: int) -> int:
        """Blocks a table of `num_slots` slots holds in total."""
        return -(-num_slots // self.block_size)

    def blocks_needed(self, num_slots: int) -> int:
        """Blocks to allocate so that `num_slots` positions have a slot (0 if they already do)."""
        return max(0, self.blocks_for(num_slots) - len(self._blocks))

    def ensure(self, num_slots: int) -> None:
        """Reserve slots up to `num_slots` (never shrinks); raises OutOfBlocks, changing nothing, if short."""
        new = self.pool.allocate(self.blocks_needed(num_slots))
        self._blocks.extend(new)
        self.num_slots = max(self.num_slots, num_slots)

    def append(self, n: int) -> list[int]:
        """Reserve `n` more positions and return their slots."""
        start = self.num_slots
        self.ensure(start + n)
        return self.slots(start, start + n)

    def truncate(self, num_slots: int) -> int:
        """Keep positions [0, num_slots) (e.g. after speculative rejection); frees emptied blocks, returns how many."""
        if not 0 <= num_slots <= self.num_slots:
            raise KVInvariantError(f"cannot truncate {self.num_slots} slots to {num_slots}")
        keep = self.blocks_for(num_slots)
        dropped = self._blocks[keep:]
        del self._blocks[keep:]
        self.num_slots = num_slots
        return self.pool.free(reversed(dropped))

    def resize(self, num_slots: int) -> None:
        """Grow or shrink to exactly `num_slots` reserved positions."""
        if num_slots < self.num_slots:
            self.truncate(num_slots)
        else:
            self.ensure(num_slots)

    def adopt(self, blocks: list[int], num_tokens: int) -> None:
        """Start an empty table from shared prefix blocks whose references the caller already took for it."""
        if self._blocks or self.num_slots:
            raise KVInvariantError("adopt() needs an empty block table")
        if self.blocks_for(num_tokens) != len(blocks):
            raise KVInvariantError(f"{len(blocks)} blocks cannot hold exactly {num_tokens} tokens")
        self._blocks = list(blocks)
        self.num_slots = num_tokens

    def release(self) -> int:
        """Drop every block reference; returns how many blocks went back to the pool."""
        return self.truncate(0)

"""Prefix cache: a radix tree over full KV blocks, shared between requests.

Each edge is one full block of `block_size` token ids, chained from the root, so a node stands for
its whole token prefix. A node's KV lives in a device block (the cache holds one reference on it)
or, with a host tier, in a host slot. Invariants:
- device-resident nodes form a prefix-closed subtree: a device node's parent is on the device;
- a device block is evictable when only the cache references it and no child is on the device.

Recency is a logical clock (one tick per lookup or insert), so eviction order is deterministic.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

from specserve.kv.block_pool import BlockPool, KVInvariantError
from specserve.kv.host_tier import HostTier

Key = tuple[int, ...]


@dataclass(eq=False)
class _Node:
    key: Key
    parent: _Node | None
    depth: int
    children: dict[Key, _Node] = field(default_factory=dict)
    device_block: int | None = None
    host_slot: int | None = None
    last_used: int = 0


@dataclass
class CacheStats:
    """hit/miss counted in tokens over recorded lookups; evictions in device blocks."""

    lookups: int = 0
    hit_tokens: int = 0
    miss_tokens: int = 0
    host_hit_tokens: int = 0
    evictions: int = 0


class RadixCache:
    def __init__(self, pool: BlockPool, host: HostTier | None = None) -> None:
        self.pool = pool
        self.host = host
        self.block_size = pool.block_size
        self._root = _Node(key=(), parent=None, depth=0)
        self._device: dict[int, _Node] = {}  # device block -> node
        self._hosted: dict[int, _Node] = {}  # host slot -> node
        self._clock = 0
        self.stats = CacheStats()

    @property
    def num_device_blocks(self) -> int:
        return len(self._device)

    @property
    def num_host_blocks(self) -> int:
        return len(self._hosted)

    def device_blocks(self) -> set[int]:
        """Device blocks the cache holds a reference on."""
        return set(self._device)

    def num_evictable(self) -> int:
        return sum(1 for n in self._device.values() if self._evictable(n))

    def match_prefix(self, tokens: Sequence[int], *, record: bool = True) -> tuple[list[int], int]:
        """Cached blocks of the longest cached full-block prefix of `tokens`, and how many tokens they cover.

        The caller receives one new reference on each returned block (free them when done).
        Host-resident blocks on the path are brought back to the device. With `record=False` the
        hit/miss counters are left for `record()` (for a lookup whose result may be given back).
        """
        self._clock += 1
        bs = self.block_size
        node, blocks = self._root, []
        for i in range(len(tokens) // bs):
            child = node.children.get(tuple(tokens[i * bs:(i + 1) * bs]))
            if child is None or (child.device_block is None and not self._restore(child)):
                break
            assert child.device_block is not None
            self.pool.incref(child.device_block)
            blocks.append(child.device_block)
            child.last_used = self._clock
            node = child
        if record:
            self.record(len(tokens), len(blocks) * bs)
        return blocks, len(blocks) * bs

    def record(self, query_tokens: int, hit_tokens: int) -> None:
        self.stats.lookups += 1
        self.stats.hit_tokens += hit_tokens
        self.stats.miss_tokens += query_tokens - hit_tokens

    def insert(self, tokens: Sequence[int], blocks: Sequence[int]) -> int:
        """Cache the full blocks of `tokens` (whose KV is in `blocks`); returns how many blocks were new.

        Where a block of the same prefix is already on the device, the cached one is kept and the
        caller's block stays the caller's. The cache takes its own reference on blocks it adopts.
        """
        self._clock += 1
        bs = self.block_size
        node, added = self._root, 0
        for i in range(min(len(tokens) // bs, len(blocks))):
            key = tuple(tokens[i * bs:(i + 1) * bs])
            child = node.children.get(key)
            if child is None:
                child = _Node(key=key, parent=node, depth=node.depth + 1)
                node.children[key] = child
            if child.device_block is None:
                if child.host_slot is not None:
                    assert self.host is not None
                    self.host.release(child.host_slot)
                    del self._hosted[child.host_slot]
                    child.host_slot = None
                if blocks[i] in self._device:
                    raise KVInvariantError(f"KV block {blocks[i]} is already cached under another prefix")
                self.pool.incref(blocks[i])
                child.device_block = blocks[i]
                self._device[blocks[i]] = child
                added += 1
            child.last_used = self._clock
            node = child
        return added

    def evict(self, n_blocks: int) -> int:
        """Free up to `n_blocks` device blocks, least recently used unreferenced leaves first; returns how many.

        With a host tier the evicted blocks move to host memory instead of being forgotten.
        """
        heap = [self._heap_entry(n) for n in self._device.values() if self._evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < n_blocks:
            node = heapq.heappop(heap)[-1]
            parent = node.parent
            self._evict_one(node)
            freed += 1
            if parent is not None and parent is not self._root and self._evictable(parent):
                heapq.heappush(heap, self._heap_entry(parent))
        return freed

    def check(self) -> None:
        """Full scan of the tree invariants (for tests)."""
        stack = list(self._root.children.values())
        seen_device, seen_host = 0, 0
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if (node.device_block is None) == (node.host_slot is None):
                raise KVInvariantError(f"cache node at depth {node.depth} must live on exactly one tier")
            if node.device_block is not None:
                seen_device += 1
                if self._device.get(node.device_block) is not node or self.pool.ref_count(node.device_block) < 1:
                    raise KVInvariantError(f"cached device block {node.device_block} is not tracked")
                assert node.parent is not None
                if node.parent is not self._root and node.parent.device_block is None:
                    raise KVInvariantError("a device-resident cache node has a host-resident parent")
            else:
                seen_host += 1
                assert node.host_slot is not None
                if self._hosted.get(node.host_slot) is not node:
                    raise KVInvariantError(f"host slot {node.host_slot} is not tracked")
        if seen_device != len(self._device) or seen_host != len(self._hosted):
            raise KVInvariantError("cache maps hold nodes that are no longer in the tree")

    def _evictable(self, node: _Node) -> bool:
        return (
            node.device_block is not None
            and self.pool.ref_count(node.device_block) == 1
            and not any(c.device_block is not None for c in node.children.values())
        )

    def _heap_entry(self, node: _Node) -> tuple[int, int, int, _Node]:
        assert node.device_block is not None
        return node.last_used, -node.depth, node.device_block, node

    def _evict_one(self, node: _Node) -> None:
        block = node.device_block
        assert block is not None
        slot: int | None = None
        if self.host is not None:
            slot, dropped = self.host.store(block)
            for s in dropped:
                self._remove_subtree(self._hosted.pop(s), released=s)
        del self._device[block]
        node.device_block = None
        if slot is None:
            self._remove_subtree(node)
        else:
            node.host_slot = slot
            self._hosted[slot] = node
        if not self.pool.decref(block):
            raise KVInvariantError(f"evicted KV block {block} is still referenced")
        self.stats.evictions += 1

    def _restore(self, node: _Node) -> bool:
        """Bring a host-resident node back into a new device block; False if no device block can be had."""
        slot = node.host_slot
        if self.host is None or slot is None:
            raise KVInvariantError("a cache node is on neither tier")
        self.host.pin(slot)
        if self.pool.num_free == 0:
            self.evict(1)
        if self.pool.num_free == 0:
            self.host.unpin(slot)
            self.host.touch(slot)
            return False
        block = self.pool.allocate(1)[0]
        self.host.load(slot, block)
        del self._hosted[slot]
        node.host_slot = None
        node.device_block = block
        self._device[block] = node
        self.stats.host_hit_tokens += self.block_size
        return True

    def _remove_subtree(self, node: _Node, released: int | None = None) -> None:
        """Forget `node` and everything below it; all of it must be off the device.

        `released` names a host slot the host tier already freed.
        """
        assert node.parent is not None
        del node.parent.children[node.key]
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n.device_block is not None:
                raise KVInvariantError(f"dropping a cache subtree that still holds device block {n.device_block}")
            if n.host_slot is not None and n.host_slot != released:
                assert self.host is not None
                self.host.drop(n.host_slot)
                del self._hosted[n.host_slot]

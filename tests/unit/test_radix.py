"""RadixCache and HostTier: prefix sharing, LRU eviction of unreferenced leaves, host-tier round trips."""

from __future__ import annotations

import random

import pytest

from specserve.kv.block_pool import BlockPool, BlockTable, KVInvariantError
from specserve.kv.host_tier import HostTier
from specserve.kv.radix import RadixCache

BS = 4


class FakeMemory:
    """Device blocks and host slots as dicts of contents; the copies are the tier callbacks."""

    def __init__(self) -> None:
        self.device: dict[int, object] = {}
        self.host: dict[int, object] = {}
        self.moves: list[tuple[str, int, int]] = []

    def copy_out(self, device_block: int, host_slot: int) -> None:
        self.host[host_slot] = self.device[device_block]
        self.moves.append(("out", device_block, host_slot))

    def copy_in(self, host_slot: int, device_block: int) -> None:
        self.device[device_block] = self.host[host_slot]
        self.moves.append(("in", host_slot, device_block))


def cached_request(cache: RadixCache, tokens: list[int], mem: FakeMemory | None = None) -> list[int]:
    """Compute `tokens` into fresh blocks (contents = the tokens of each block), cache them, release."""
    table = BlockTable(cache.pool)
    table.append(len(tokens))
    if mem is not None:
        for i, b in enumerate(table.blocks):
            mem.device[b] = tuple(tokens[i * BS:(i + 1) * BS])
    cache.insert(tokens, table.blocks)
    blocks = list(table.blocks)
    table.release()
    return blocks


def test_match_after_insert_shares_full_blocks_and_counts() -> None:
    pool = BlockPool(16, BS)
    cache = RadixCache(pool)
    assert cache.match_prefix(list(range(10))) == ([], 0)
    blocks = cached_request(cache, list(range(10)))  # 2 full blocks + a partial one
    assert cache.num_device_blocks == 2 and pool.num_used == 2
    got, n = cache.match_prefix([*range(9), 99])
    assert (got, n) == (blocks[:2], 8)
    assert [pool.ref_count(b) for b in got] == [2, 2]  # cache + caller
    got2, n2 = cache.match_prefix([0, 1, 2, 3, 7, 7, 7, 7])
    assert (got2, n2) == (blocks[:1], 4)
    s = cache.stats
    assert (s.lookups, s.hit_tokens, s.miss_tokens) == (3, 12, 10 + 2 + 4)
    pool.free(got + got2)
    cache.check()
    pool.check()


def test_unrecorded_lookup_counts_nothing_until_recorded() -> None:
    pool = BlockPool(8, BS)
    cache = RadixCache(pool)
    cached_request(cache, list(range(8)))
    blocks, n = cache.match_prefix(list(range(9)), record=False)
    assert cache.stats.lookups == 0
    cache.record(9, n)
    assert (cache.stats.hit_tokens, cache.stats.miss_tokens) == (8, 1)
    pool.free(blocks)


def test_common_prefix_is_one_path_in_the_tree() -> None:
    pool = BlockPool(16, BS)
    cache = RadixCache(pool)
    a = cached_request(cache, [1, 1, 1, 1, 2, 2, 2, 2])
    b = cached_request(cache, [1, 1, 1, 1, 3, 3, 3, 3])
    assert cache.num_device_blocks == 3  # the shared first block is cached once
    assert pool.num_used == 3 and pool.ref_count(a[0]) == 1
    assert b[0] != a[0]  # b computed its own copy, which went back to the pool
    got, _ = cache.match_prefix([1, 1, 1, 1, 3, 3, 3, 3])
    assert got == [a[0], b[1]]
    pool.free(got)


def test_eviction_is_lru_over_leaves_and_spares_referenced_blocks() -> None:
    pool = BlockPool(16, BS)
    cache = RadixCache(pool)
    a = cached_request(cache, [1] * 8)
    b = cached_request(cache, [2] * 8)
    c = cached_request(cache, [3] * 8)
    held, _ = cache.match_prefix([1] * 8)  # a is now most recent and referenced
    pool.free(cache.match_prefix([2] * 8)[0])  # b more recent than c, unreferenced
    assert cache.num_evictable() == 2  # the leaves of b and c (a's leaf is referenced, inner blocks have children)
    assert cache.evict(1) == 1
    assert pool.ref_count(c[1]) == 0  # c's leaf went first
    assert cache.evict(2) == 2  # then c's root block (now a leaf), then b's leaf
    assert pool.ref_count(c[0]) == 0 and pool.ref_count(b[1]) == 0 and pool.ref_count(b[0]) == 1
    assert cache.evict(10) == 1  # only b[0] is left unreferenced
    assert [pool.ref_count(x) for x in a] == [2, 2]
    assert cache.stats.evictions == 4
    pool.free(held)
    assert cache.evict(10) == 2
    assert pool.num_free == pool.num_blocks and cache.num_device_blocks == 0
    cache.check()


def test_inner_block_is_never_evicted_before_its_children() -> None:
    pool = BlockPool(8, BS)
    cache = RadixCache(pool)
    blocks = cached_request(cache, list(range(12)))
    order = []
    for _ in range(3):
        cache.evict(1)
        order.append(next(b for b in blocks if pool.ref_count(b) == 0 and b not in order))
    assert order == blocks[::-1]


def test_host_tier_round_trips_blocks_through_the_callbacks() -> None:
    pool = BlockPool(4, BS)
    mem = FakeMemory()
    host = HostTier(8, mem.copy_out, mem.copy_in)
    cache = RadixCache(pool, host)
    tokens = list(range(12))
    blocks = cached_request(cache, tokens, mem)
    assert cache.evict(3) == 3
    assert pool.num_free == 4 and cache.num_host_blocks == 3
    assert [m[1] for m in mem.moves] == blocks[::-1]  # copied out leaf first
    for b in blocks:  # device memory is reused by others
        mem.device[b] = "garbage"
    pool.allocate(1)  # one device block stays busy, so the restore must reuse the others
    got, n = cache.match_prefix([*tokens, 5])
    assert n == 12
    assert [mem.device[b] for b in got] == [tuple(tokens[i:i + 4]) for i in (0, 4, 8)]
    assert (host.stats.device_to_host, host.stats.host_to_device) == (3, 3)
    assert cache.stats.host_hit_tokens == 12 and cache.num_host_blocks == 0 and host.num_used == 0
    pool.free(got)
    cache.check()
    pool.check()


def test_restore_evicts_colder_device_blocks_to_make_room() -> None:
    pool = BlockPool(2, BS)
    mem = FakeMemory()
    cache = RadixCache(pool, HostTier(4, mem.copy_out, mem.copy_in))
    cached_request(cache, [1] * 8, mem)
    cache.evict(2)  # [1]*8 now on the host
    cached_request(cache, [2] * 8, mem)  # fills the device
    got, n = cache.match_prefix([1] * 8)
    assert n == 8 and [mem.device[b] for b in got] == [(1,) * 4] * 2
    assert cache.num_host_blocks == 2  # [2]*8 moved out to make room
    pool.free(got)
    cache.check()


def test_host_tier_capacity_drops_lru_host_blocks() -> None:
    pool = BlockPool(8, BS)
    mem = FakeMemory()
    host = HostTier(2, mem.copy_out, mem.copy_in)
    cache = RadixCache(pool, host)
    for t in (1, 2, 3):
        cached_request(cache, [t] * 4, mem)
    cache.evict(3)  # 1 then 2 then 3 go to the host; 1 is dropped for 3
    assert host.num_used == 2 and host.stats.evictions == 1
    assert cache.match_prefix([1] * 4)[1] == 0
    got, n = cache.match_prefix([3] * 4)
    assert n == 4 and mem.device[got[0]] == (3,) * 4
    pool.free(got)
    cache.check()


def test_a_block_with_no_host_room_is_dropped_with_its_host_descendants() -> None:
    pool = BlockPool(8, BS)
    mem = FakeMemory()
    host = HostTier(1, mem.copy_out, mem.copy_in)
    cache = RadixCache(pool, host)
    cached_request(cache, [1] * 8, mem)
    cache.evict(1)  # the leaf goes to the only host slot
    host.pin(host.lru_order()[0])  # as during a restore: the host tier cannot make room
    assert cache.evict(1) == 1  # the root block has nowhere to go: forgotten, and its host child with it
    assert cache.num_host_blocks == 0 and host.num_used == 0 and host.stats.evictions == 1
    assert cache.match_prefix([1] * 8) == ([], 0)
    assert pool.num_free == pool.num_blocks
    cache.check()


def test_host_tier_unit() -> None:
    mem = FakeMemory()
    mem.device.update({0: "a", 1: "b", 2: "c"})
    host = HostTier(2, mem.copy_out, mem.copy_in)
    s0, dropped = host.store(0)
    s1, _ = host.store(1)
    assert dropped == [] and host.lru_order() == [s0, s1]
    host.touch(s0)
    host.pin(s1)
    s2, dropped = host.store(2)
    assert dropped == [s0] and s2 == s0 and host.stats.evictions == 1
    host.pin(s2)
    assert host.store(0) == (None, [])  # everything pinned: nothing copied
    host.load(s1, 5)
    assert mem.device[5] == "b" and host.num_used == 1
    with pytest.raises(KVInvariantError):
        host.load(s1, 5)
    with pytest.raises(ValueError, match="--hicache-size"):
        HostTier(0, mem.copy_out, mem.copy_in)


@pytest.mark.parametrize("host_capacity", [0, 3])
def test_random_use_keeps_cache_and_pool_consistent(host_capacity: int) -> None:
    rng = random.Random(host_capacity)
    pool = BlockPool(12, BS)
    mem = FakeMemory()
    host = HostTier(host_capacity, mem.copy_out, mem.copy_in) if host_capacity else None
    cache = RadixCache(pool, host)
    held: list[list[int]] = []
    for _ in range(600):
        tokens = [rng.randrange(2) for _ in range(rng.randrange(1, 14))]
        op = rng.randrange(4)
        if op == 0 and pool.num_free >= 4:
            cached_request(cache, tokens, mem)
        elif op == 1:
            blocks, n = cache.match_prefix(tokens)
            assert n == 4 * len(blocks)
            assert [mem.device[b] for b in blocks] == [tuple(tokens[i:i + 4]) for i in range(0, n, 4)]
            held.append(blocks)
        elif op == 2 and held:
            pool.free(held.pop(rng.randrange(len(held))))
        else:
            cache.evict(rng.randint(1, 3))
        refs = [0] * pool.num_blocks
        for blocks in held:
            for b in blocks:
                refs[b] += 1
        for b in range(pool.num_blocks):
            assert pool.ref_count(b) == refs[b] + (b in cache.device_blocks())
        cache.check()
        pool.check()
        assert host is None or host.num_used == cache.num_host_blocks <= host_capacity
    for blocks in held:
        pool.free(blocks)
    cache.evict(pool.num_blocks)
    assert pool.num_free == pool.num_blocks

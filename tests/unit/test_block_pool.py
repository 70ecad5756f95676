"""BlockPool and BlockTable: reference counts, slot mapping, append/truncate, invariants under random use."""

from __future__ import annotations

import random

import pytest

from specserve.kv.block_pool import BlockPool, BlockTable, KVInvariantError, OutOfBlocks


def test_allocate_free_and_refcounts() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    a, b = pool.allocate(2)
    assert (pool.num_free, pool.num_used) == (2, 2)
    assert pool.ref_count(a) == 1
    pool.incref(a)
    assert pool.decref(a) is False  # still shared
    assert pool.decref(a) is True
    assert pool.free([b]) == 1
    assert pool.num_free == 4
    pool.check()


def test_double_free_and_misuse_raise_invariant_errors() -> None:
    pool = BlockPool(num_blocks=2, block_size=4)
    (blk,) = pool.allocate(1)
    pool.decref(blk)
    with pytest.raises(KVInvariantError, match="double free"):
        pool.decref(blk)
    with pytest.raises(KVInvariantError, match="incref of free"):
        pool.incref(blk)
    with pytest.raises(KVInvariantError, match="outside"):
        pool.decref(7)
    assert pool.num_free == 2
    pool.check()


def test_allocate_is_all_or_nothing() -> None:
    pool = BlockPool(num_blocks=3, block_size=4)
    pool.allocate(2)
    with pytest.raises(OutOfBlocks):
        pool.allocate(2)
    assert pool.num_free == 1


@pytest.mark.parametrize(("blocks", "size", "flag"), [(0, 4, "--num-kv-blocks"), (4, 0, "--kv-block-size")])
def test_bad_sizes_name_the_flag(blocks: int, size: int, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        BlockPool(blocks, size)


def test_slot_mapping() -> None:
    pool = BlockPool(num_blocks=8, block_size=4)
    pool.allocate(3)  # so the table's blocks are not 0, 1, 2
    table = BlockTable(pool)
    slots = table.append(10)
    blocks = table.blocks
    assert len(blocks) == 3 and table.num_slots == 10
    assert slots == [blocks[p // 4] * 4 + p % 4 for p in range(10)]
    assert table.locate(5) == (blocks[1], 1)
    assert table.slot(9) == blocks[2] * 4 + 1
    assert table.slots(3, 6) == slots[3:6]
    with pytest.raises(KVInvariantError):
        table.slot(10)
    with pytest.raises(KVInvariantError):
        table.slots(8, 11)


def test_append_allocates_only_when_a_block_fills() -> None:
    pool = BlockPool(num_blocks=4, block_size=4)
    table = BlockTable(pool)
    table.append(3)
    assert pool.num_used == 1
    table.append(1)
    assert pool.num_used == 1
    table.append(1)
    assert pool.num_used == 2


def test_ensure_short_of_blocks_changes_nothing() -> None:
    pool = BlockPool(num_blocks=2, block_size=4)
    table = BlockTable(pool)
    table.append(5)
    with pytest.raises(OutOfBlocks):
        table.ensure(9)
    assert table.num_slots == 5 and len(table.blocks) == 2


def test_truncate_frees_emptied_blocks_only() -> None:
    pool = BlockPool(num_blocks=4, block_size=4)
    table = BlockTable(pool)
    table.append(13)  # 4 blocks
    assert table.truncate(9) == 1  # positions 0..8 need 3 blocks
    assert table.num_slots == 9 and pool.num_free == 1
    assert table.truncate(8) == 1  # block 3 (positions 8..11) now empty
    assert table.truncate(5) == 0
    with pytest.raises(KVInvariantError):
        table.truncate(6)
    assert table.release() == 2
    assert pool.num_free == 4


def test_truncating_a_shared_block_only_drops_a_reference() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    owner = BlockTable(pool)
    owner.append(4)
    shared = list(owner.blocks)
    for b in shared:
        pool.incref(b)
    other = BlockTable(pool)
    other.adopt(shared, 4)
    other.append(1)
    assert other.slots(0, 4) == owner.slots(0, 4)
    other.release()
    assert [pool.ref_count(b) for b in shared] == [1, 1]
    owner.release()
    assert pool.num_free == 4


def test_adopt_checks_its_arguments() -> None:
    pool = BlockPool(num_blocks=4, block_size=4)
    table = BlockTable(pool)
    with pytest.raises(KVInvariantError):
        table.adopt([0], 5)
    table.append(1)
    with pytest.raises(KVInvariantError):
        table.adopt([], 0)


def test_random_operations_keep_every_block_free_or_referenced() -> None:
    rng = random.Random(0)
    pool = BlockPool(num_blocks=24, block_size=4)
    tables: list[BlockTable] = []
    for _ in range(2000):
        op = rng.randrange(5)
        if op == 0 or not tables:
            tables.append(BlockTable(pool))
        elif op == 1:
            t, n = rng.choice(tables), rng.randint(0, 9)
            if t.blocks_needed(t.num_slots + n) <= pool.num_free:
                t.append(n)
            else:
                with pytest.raises(OutOfBlocks):
                    t.append(n)
        elif op == 2:
            t = rng.choice(tables)
            t.truncate(rng.randint(0, t.num_slots))
        elif op == 3:
            src = rng.choice(tables)
            full = src.num_slots // 4
            for b in src.blocks[:full]:
                pool.incref(b)
            fork = BlockTable(pool)
            fork.adopt(list(src.blocks[:full]), full * 4)
            tables.append(fork)
        else:
            tables.pop(rng.randrange(len(tables))).release()
        expected = [0] * pool.num_blocks
        for t in tables:
            assert len(t.blocks) == -(-t.num_slots // 4)
            for b in t.blocks:
                expected[b] += 1
        assert [pool.ref_count(b) for b in range(pool.num_blocks)] == expected
        pool.check()
    for t in tables:
        t.release()
    assert pool.num_free == pool.num_blocks

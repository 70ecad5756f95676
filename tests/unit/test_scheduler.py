"""Scheduler: chunked prefill, speculative lookahead, preemption, prefix sharing, abort, and KV invariants.

A fake engine writes (position, token) into a dict of KV slots and checks, before every step,
that each sequence's context reads back its own tokens: the block tables, the prefix cache and
the host tier together must hand every request the right KV.
"""

from __future__ import annotations

import random

import pytest

from specserve.engine.scheduler import BatchPlan, QueueFull, Scheduler, SchedulerConfig
from specserve.engine.sequence import Sequence, SequenceStatus
from specserve.kv.block_pool import BlockPool
from specserve.kv.host_tier import HostTier
from specserve.kv.radix import RadixCache

BS = 4


def next_token(tokens: list[int]) -> int:
    """The fake target model: greedy next token of a context."""
    return (tokens[-1] * 7 + len(tokens) * 3 + (tokens[-2] if len(tokens) > 1 else 0)) % 11


def reference(prompt: list[int], n: int) -> list[int]:
    out = list(prompt)
    for _ in range(n):
        out.append(next_token(out))
    return out[len(prompt):]


class FakeEngine:
    def __init__(self, pool: BlockPool, config: SchedulerConfig, cache: bool, host: int, seed: int = 0) -> None:
        self.rng = random.Random(seed)
        self.max_new = 6
        self.kv: dict[int, tuple[int, int]] = {}  # slot -> (position, token)
        self.host: dict[int, list[tuple[int, int] | None]] = {}
        tier = HostTier(host, self.copy_out, self.copy_in) if host else None
        self.sched = Scheduler(config, pool, RadixCache(pool, tier) if cache else None)

    def copy_out(self, block: int, slot: int) -> None:
        self.host[slot] = [self.kv.get(block * BS + i) for i in range(BS)]

    def copy_in(self, slot: int, block: int) -> None:
        for i, entry in enumerate(self.host[slot]):
            if entry is not None:
                self.kv[block * BS + i] = entry

    def check_context(self, seq: Sequence, upto: int) -> None:
        for pos in range(upto):
            assert self.kv.get(seq.block_table.slot(pos)) == (pos, seq.token_ids[pos]), (seq, pos)

    def step(self, lookahead: int = 0) -> BatchPlan:
        plan = self.sched.schedule(lookahead)
        for ch in plan.prefills:
            self.check_context(ch.seq, ch.start)
            for i, (tok, slot) in enumerate(zip(ch.token_ids, ch.slots, strict=True)):
                self.kv[slot] = (ch.start + i, tok)
            new = [next_token(ch.seq.token_ids)] if ch.completes else []
            assert self.sched.advance(ch.seq, ch.num_tokens, new)
        for d in plan.decodes:
            seq = d.seq
            self.check_context(seq, d.start)
            ctx = list(seq.token_ids)
            truth = []
            for _ in range(d.num_draft_tokens + 1):
                truth.append(next_token(ctx + truth))
            drafts = [t if self.rng.random() < 0.7 else (t + 1) % 11 for t in truth[:-1]]
            inputs = [ctx[-1], *drafts]
            for i, (tok, slot) in enumerate(zip(inputs, d.slots, strict=True)):
                self.kv[slot] = (d.start + i, tok)
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == truth[accepted]:
                accepted += 1
            assert self.sched.advance(seq, 1 + accepted, truth[: accepted + 1])
        for seq in [*self.sched.running]:
            if seq.num_output_tokens >= self.max_new:
                self.sched.finish(seq, "length")
        return plan

    def run(self, lookahead: int = 0, max_steps: int = 500) -> list[BatchPlan]:
        plans = []
        while self.sched.has_unfinished:
            plans.append(self.step(lookahead))
            assert len(plans) < max_steps, "scheduler made no progress"
        return plans


def make(
    num_blocks: int = 64, cache: bool = False, host: int = 0, seed: int = 0, **cfg: int
) -> tuple[Scheduler, FakeEngine]:
    eng = FakeEngine(BlockPool(num_blocks, BS), SchedulerConfig(**cfg), cache, host, seed)
    return eng.sched, eng


def check_refs(sched: Scheduler) -> None:
    """Every block is free or referenced, by exactly the tables and the cache that hold it."""
    pool = sched.pool
    expected = [0] * pool.num_blocks
    for seq in [*sched.running, *sched.waiting]:
        for b in seq.block_table.blocks:
            expected[b] += 1
    cached = sched.cache.device_blocks() if sched.cache else set()
    assert [pool.ref_count(b) - (b in cached) for b in range(pool.num_blocks)] == expected
    pool.check()
    if sched.cache:
        sched.cache.check()


@pytest.mark.parametrize(
    ("field", "value", "flag"),
    [("max_num_seqs", 0, "--max-num-seqs"), ("max_num_batched_tokens", 0, "--max-num-batched-tokens"),
     ("max_waiting", 0, "--max-waiting")],
)
def test_config_errors_name_the_flag(field: str, value: int, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        SchedulerConfig(**{field: value})


def test_bad_requests_are_rejected_with_a_reason() -> None:
    sched, _ = make(num_blocks=4)
    with pytest.raises(ValueError, match="at least one token"):
        sched.add("a", [])
    with pytest.raises(ValueError, match="--num-kv-blocks"):
        sched.add("b", [1] * 17)
    sched.add("c", [1])
    with pytest.raises(ValueError, match="already in use"):
        sched.add("c", [2])
    with pytest.raises(ValueError, match="--max-num-batched-tokens"):
        Scheduler(SchedulerConfig(max_num_batched_tokens=4), sched.pool).schedule(lookahead=4)


def test_full_waiting_queue_raises_queue_full() -> None:
    sched, _ = make(max_waiting=2)
    sched.add("a", [1, 2])
    sched.add("b", [1, 2])
    with pytest.raises(QueueFull):
        sched.add("c", [1, 2])
    sched.schedule()  # both admitted: room again
    sched.add("c", [1, 2])


def test_chunked_prefill_respects_the_token_budget() -> None:
    sched, eng = make(max_num_batched_tokens=16)
    sched.add("long", list(range(50)))
    sched.add("short", [3, 4, 5])
    plans = eng.run(lookahead=3)
    assert all(p.num_tokens <= 16 for p in plans)
    chunks = [c.num_tokens for p in plans for c in p.prefills if c.seq.request_id == "long"]
    assert chunks == [16, 16, 16, 2]
    assert [c.completes for p in plans for c in p.prefills if c.seq.request_id == "long"] == [False] * 3 + [True]
    assert sched.pool.num_free == sched.pool.num_blocks


def test_decodes_reserve_one_plus_lookahead_distinct_slots() -> None:
    sched, eng = make()
    for i in range(3):
        sched.add(str(i), [i + 1] * 5)
    eng.step()
    plan = sched.schedule(lookahead=4)
    assert [len(d.slots) for d in plan.decodes] == [5, 5, 5]
    assert all(d.start == d.seq.num_tokens - 1 for d in plan.decodes)
    slots = [s for d in plan.decodes for s in d.slots]
    assert len(set(slots)) == len(slots)
    used = sched.pool.num_used
    # rejected drafts: the next plan shrinks each table back (5 + 1 + 0 slots = 2 blocks each)
    for d in plan.decodes:
        sched.advance(d.seq, 1, [0])
    sched.schedule(lookahead=0)
    assert sched.pool.num_used == 6 < used


def test_max_num_seqs_bounds_the_running_set() -> None:
    sched, eng = make(max_num_seqs=2)
    for i in range(5):
        sched.add(str(i), [i, i + 1])
    plans = eng.run(lookahead=2)
    assert max(len(p.prefills) + len(p.decodes) for p in plans) == 2
    assert sched.pool.num_free == sched.pool.num_blocks


@pytest.mark.parametrize("lookahead", [0, 3])
def test_small_pool_preempts_instead_of_crashing_and_all_complete(lookahead: int) -> None:
    sched, eng = make(num_blocks=10, max_num_batched_tokens=64)
    eng.max_new = 14
    prompts = {str(i): [i + 1, i + 2, i + 3, i] * 2 + [i] for i in range(5)}
    seqs = {rid: sched.add(rid, p) for rid, p in prompts.items()}
    plans = eng.run(lookahead=lookahead)
    assert sum(len(p.preempted) for p in plans) > 0 and sched.num_preemptions > 0
    for rid, seq in seqs.items():
        assert seq.status is SequenceStatus.FINISHED
        assert seq.output_ids[:14] == reference(prompts[rid], 14)
    assert sched.pool.num_free == sched.pool.num_blocks


def test_preemption_takes_the_most_recently_arrived() -> None:
    sched, eng = make(num_blocks=6, max_num_batched_tokens=64)
    for i in range(3):
        sched.add(str(i), [i] * 8)  # 2 blocks each
    eng.step()
    plan = eng.step(lookahead=0)  # every sequence needs a third block: only the newest gives way
    assert [s.request_id for s in plan.preempted] == ["2"]
    assert sched.waiting[0].request_id == "2" and sched.waiting[0].status is SequenceStatus.PREEMPTED


def test_a_sequence_that_outgrows_the_whole_pool_finishes_with_length() -> None:
    sched, eng = make(num_blocks=2)
    eng.max_new = 100
    seq = sched.add("a", [1] * 6)
    eng.run(lookahead=2)
    assert seq.finish_reason == "length" and seq.num_tokens == 9
    assert seq.output_ids == reference([1] * 6, 3)
    assert sched.pool.num_free == 2


def test_prefix_sharing_between_requests() -> None:
    sched, eng = make(cache=True)
    common = list(range(1, 10))  # two full blocks shared, then a partial one
    sched.add("a", [*common, 1, 2])
    eng.run()
    assert sched.cache is not None
    cached = sched.cache.device_blocks()
    b = sched.add("b", [*common, 3, 3, 3])
    eng.step()
    assert b.num_cached_tokens == 8
    assert set(b.block_table.blocks[:2]) <= cached
    assert sched.cache.stats.hit_tokens == 8
    eng.run()
    assert b.output_ids == reference([*common, 3, 3, 3], eng.max_new)


def test_concurrent_requests_share_the_same_physical_blocks() -> None:
    sched, eng = make(cache=True)
    common = [5] * 12
    a = sched.add("a", [*common, 1])
    eng.step()  # a prefilled; its 3 full prompt blocks are now cached
    b = sched.add("b", [*common, 2, 2])
    eng.step()
    assert a.status is b.status is SequenceStatus.RUNNING
    assert b.block_table.blocks[:3] == a.block_table.blocks[:3]
    assert all(sched.pool.ref_count(x) == 3 for x in a.block_table.blocks[:3])  # a, b and the cache
    check_refs(sched)
    eng.run()
    assert a.output_ids == reference([*common, 1], eng.max_new)


def test_only_computed_kv_is_shared() -> None:
    sched, eng = make(cache=True)
    a = sched.add("a", list(range(1, 8)))
    eng.step()  # a: 7 positions computed, its 8th token sampled but its KV not yet written
    assert a.num_tokens == 8
    b = sched.add("b", [*a.token_ids, 9])
    eng.step()  # would read a's unwritten slot if the second block had been shared
    assert b.num_cached_tokens == 4
    eng.run()
    assert b.output_ids == reference([*range(1, 8), a.token_ids[7], 9], eng.max_new)


def test_preempted_sequence_recomputes_from_the_prefix_cache_and_host_tier() -> None:
    sched, eng = make(num_blocks=8, cache=True, host=16, max_num_batched_tokens=64)
    eng.max_new = 12
    prompts = {str(i): [i % 2 + 1] * 8 + [i, i + 1, i + 2] for i in range(6)}
    seqs = {rid: sched.add(rid, p) for rid, p in prompts.items()}
    eng.run(lookahead=2)
    assert sched.num_preemptions > 0
    assert sched.cache is not None and sched.cache.host is not None
    assert sched.cache.stats.hit_tokens > 0 and sched.cache.host.stats.device_to_host > 0
    for rid, seq in seqs.items():
        assert seq.output_ids[:12] == reference(prompts[rid], 12)
    check_refs(sched)
    sched.cache.evict(sched.pool.num_blocks)
    assert sched.pool.num_free == sched.pool.num_blocks


def test_abort_mid_prefill_and_mid_decode_frees_everything() -> None:
    sched, eng = make(max_num_batched_tokens=8)
    p = sched.add("prefill", list(range(30)))
    eng.step()
    assert p.in_prefill and sched.pool.num_used == 2
    assert sched.abort("prefill") is p
    assert sched.pool.num_free == sched.pool.num_blocks and p.finish_reason == "abort"
    d = sched.add("decode", [1, 2, 3])
    eng.step()
    eng.step(lookahead=5)
    assert not d.in_prefill and d.num_output_tokens >= 2
    sched.schedule(lookahead=5)  # slots reserved for an in-flight step
    assert sched.abort("decode") is d
    assert sched.pool.num_free == sched.pool.num_blocks
    assert not sched.advance(d, 1, [4])  # the in-flight step's result is dropped
    assert sched.abort("decode") is None and not sched.finish(d)
    w = sched.add("waiting", [1])
    assert sched.abort("waiting") is w and not sched.has_unfinished


@pytest.mark.parametrize(("cache", "host"), [(False, 0), (True, 0), (True, 3)])
def test_random_operations_keep_blocks_consistent(cache: bool, host: int) -> None:
    rng = random.Random(7 + host)
    sched, eng = make(num_blocks=12, cache=cache, host=host, seed=host, max_num_batched_tokens=12, max_num_seqs=4,
                      max_waiting=6)
    bases = [[rng.randrange(3) for _ in range(12)] for _ in range(3)]  # shared prefixes
    prompts: dict[str, list[int]] = {}
    for i in range(600):
        op = rng.randrange(6)
        if op <= 1:
            rid = f"r{i}"
            prompt = rng.choice(bases)[: rng.randrange(13)] + [rng.randrange(3) for _ in range(rng.randrange(1, 8))]
            try:
                sched.add(rid, prompt)
                prompts[rid] = prompt
            except QueueFull:
                assert sched.num_waiting >= 6  # preempted requests may exceed the bound
        elif op <= 3:
            plan = eng.step(lookahead=rng.randrange(4))
            assert plan.num_tokens <= 12
        elif op == 4 and prompts:
            sched.abort(rng.choice(sorted(prompts)))
        elif sched.running:
            sched.finish(rng.choice(sched.running))
        check_refs(sched)
    for rid in list(prompts):
        sched.abort(rid)
    assert not sched.has_unfinished
    check_refs(sched)
    if sched.cache is not None:
        sched.cache.evict(sched.pool.num_blocks)
    assert sched.pool.num_free == sched.pool.num_blocks

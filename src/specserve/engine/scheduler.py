"""Continuous batching on plain Python lists: waiting/running queues, chunked prefill, preemption.

Each `schedule(lookahead)` returns a `BatchPlan` for one step, under a token budget:
1. running sequences that decode get `1 + lookahead` KV slots each (speculative decoding verifies
   `lookahead` draft tokens after the input token), oldest first;
2. running sequences still prefilling get their next chunk;
3. waiting sequences are admitted in arrival order, their prompt matched against the prefix cache first.
When blocks run out the prefix cache evicts; if that is not enough, the most recently arrived
running sequence is preempted by recompute (its blocks freed, back to the front of the waiting
queue). A sequence whose KV can never fit the whole pool is finished with reason "length".

After running the step the engine calls `advance(seq, num_computed, new_token_ids)` per item, then
`finish(seq, reason)` for those that stopped. `abort(request_id)` works in any state.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from specserve.engine.sequence import Sequence, SequenceStatus
from specserve.kv.block_pool import BlockPool, BlockTable
from specserve.kv.radix import RadixCache


class QueueFull(RuntimeError):
    """The waiting queue is at `max_waiting`; the server answers 503 with Retry-After."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_waiting: int = 1024

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be at least 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"--max-num-batched-tokens must be at least 1, got {self.max_num_batched_tokens}")
        if self.max_waiting < 1:
            raise ValueError(f"--max-waiting must be at least 1 (requests queued before 503), got {self.max_waiting}")


@dataclass(frozen=True)
class PrefillChunk:
    """Compute KV for `token_ids` at positions start, start+1, ...; `completes`: the last logits give a token."""

    seq: Sequence
    start: int
    token_ids: tuple[int, ...]  # [n]
    slots: tuple[int, ...]  # [n] physical KV slots
    completes: bool

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class DecodeItem:
    """Input token `seq.token_ids[-1]` at position `start`; `slots` [1 + num_draft_tokens] for it and the drafts."""

    seq: Sequence
    start: int
    slots: tuple[int, ...]  # [1 + D]

    @property
    def num_draft_tokens(self) -> int:
        return len(self.slots) - 1


@dataclass(frozen=True)
class BatchPlan:
    prefills: tuple[PrefillChunk, ...]
    decodes: tuple[DecodeItem, ...]
    preempted: tuple[Sequence, ...]  # moved back to waiting this step
    finished: tuple[Sequence, ...]  # ended by the scheduler: their KV cannot fit the pool (reason "length")

    @property
    def num_tokens(self) -> int:
        return sum(p.num_tokens for p in self.prefills) + sum(len(d.slots) for d in self.decodes)

    @property
    def is_empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool, cache: RadixCache | None = None) -> None:
        if cache is not None and cache.pool is not pool:
            raise ValueError("the prefix cache must share the scheduler's block pool")
        self.config = config
        self.pool = pool
        self.cache = cache
        self.waiting: deque[Sequence] = deque()  # ordered by arrival (seq_no)
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._seqs: dict[str, Sequence] = {}
        self._next_no = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use (cached blocks included)."""
        return self.pool.num_used / self.pool.num_blocks

    def get(self, request_id: str) -> Sequence | None:
        return self._seqs.get(request_id)

    def add(
        self, request_id: str, prompt_ids: Iterable[int], params: object = None, arrival_time: float | None = None
    ) -> Sequence:
        """Queue a request; raises QueueFull at `max_waiting`, ValueError for a prompt that can never fit."""
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFull(f"{len(self.waiting)} requests are waiting (--max-waiting {self.config.max_waiting})")
        t = time.monotonic() if arrival_time is None else arrival_time
        seq = Sequence(request_id, prompt_ids, params, BlockTable(self.pool), t, self._next_no)
        if seq.num_tokens > self.pool.num_slots:
            raise ValueError(
                f"a prompt of {seq.num_tokens} tokens does not fit the KV cache ({self.pool.num_slots} token slots): "
                "raise --num-kv-blocks or shorten the prompt"
            )
        self._next_no += 1
        self._seqs[request_id] = seq
        self.waiting.append(seq)
        return seq

    def schedule(self, lookahead: int = 0) -> BatchPlan:
        """Plan one step; every running decode verifies up to `lookahead` draft tokens (0 = plain decoding)."""
        budget = self.config.max_num_batched_tokens
        if lookahead < 0:
            raise ValueError(f"lookahead (draft tokens per step) must be >= 0, got {lookahead}")
        if 1 + lookahead > budget:
            raise ValueError(
                f"--max-num-batched-tokens {budget} cannot hold one decode step of 1 + {lookahead} draft tokens: "
                "raise it or verify fewer draft tokens"
            )
        decodes: dict[Sequence, int] = {}  # seq -> slots this step
        prefills: dict[Sequence, int] = {}  # seq -> chunk length
        preempted: list[Sequence] = []
        finished: list[Sequence] = []
        order = sorted(self.running, key=lambda s: s.seq_no)

        def reserve(seq: Sequence, num_slots: int) -> bool:
            while not self._fit(seq, num_slots):
                victim = max(self.running, key=lambda s: s.seq_no)
                self._preempt(victim)
                preempted.append(victim)
                decodes.pop(victim, None)
                prefills.pop(victim, None)
                if victim is seq:
                    return False
            return True

        for seq in order:
            if seq.status is not SequenceStatus.RUNNING or seq.in_prefill:
                continue
            n = 1 + min(lookahead, self.pool.num_slots - seq.num_tokens)
            if n < 1:
                self.finish(seq, "length")
                finished.append(seq)
            elif n <= budget and reserve(seq, seq.num_computed_tokens + n):
                decodes[seq] = n
                budget -= n
        for seq in order:
            if seq.status is SequenceStatus.RUNNING and seq.in_prefill and budget > 0:
                n = min(seq.prefill_remaining, budget)
                if reserve(seq, seq.num_computed_tokens + n):
                    prefills[seq] = n
                    budget -= n
        # no admissions in a step that had to preempt: the freed blocks go to older sequences
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_tokens > self.pool.num_slots:
                self.finish(seq, "length")
                finished.append(seq)
                continue
            n = self._admit(seq, budget)
            if n == 0:
                break
            prefills[seq] = n
            budget -= n
        return BatchPlan(
            prefills=tuple(self._chunk(s, n) for s, n in prefills.items()),
            decodes=tuple(self._decode(s, n) for s, n in decodes.items()),
            preempted=tuple(preempted),
            finished=tuple(finished),
        )

    def advance(self, seq: Sequence, num_computed: int, new_token_ids: Iterable[int]) -> bool:
        """Apply a step's result; False (nothing changed) if the sequence was preempted or ended meanwhile.

        Prefill chunk: `num_computed` = chunk length, plus the sampled token if the chunk completed it.
        Decode: `num_computed` = 1 + accepted drafts, `new_token_ids` = accepted drafts + bonus token.
        """
        if seq.status is not SequenceStatus.RUNNING or self._seqs.get(seq.request_id) is not seq:
            return False
        was_prefill = seq.in_prefill
        seq.advance(num_computed, new_token_ids)
        if was_prefill and not seq.in_prefill and self.cache is not None:
            self.cache.insert(seq.token_ids[: seq.num_computed_tokens], seq.block_table.blocks)
        return True

    def finish(self, seq: Sequence, reason: str = "stop") -> bool:
        """End a sequence, handing its full computed blocks to the prefix cache; False if it had already ended."""
        if self._seqs.get(seq.request_id) is not seq:
            return False
        if seq.status is SequenceStatus.RUNNING and self.cache is not None:
            self.cache.insert(seq.token_ids[: seq.num_computed_tokens], seq.block_table.blocks)
        self._end(seq, reason)
        return True

    def abort(self, request_id: str) -> Sequence | None:
        """End a request in any state and free all its blocks; None if it is unknown or already ended."""
        seq = self._seqs.get(request_id)
        if seq is not None:
            self._end(seq, "abort")
        return seq

    def _end(self, seq: Sequence, reason: str) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        seq.reset()
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._seqs[seq.request_id]

    def _fit(self, seq: Sequence, num_slots: int) -> bool:
        """Resize the sequence's table to `num_slots`, evicting cached blocks if needed; False if still short."""
        need = seq.block_table.blocks_needed(num_slots)
        if need > self.pool.num_free and self.cache is not None:
            self.cache.evict(need - self.pool.num_free)
        if need > self.pool.num_free:
            return False
        seq.block_table.resize(num_slots)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.reset()
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        i = 0
        while i < len(self.waiting) and self.waiting[i].seq_no < seq.seq_no:
            i += 1
        self.waiting.insert(i, seq)

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Move the head of the waiting queue to running with a first chunk; 0 if its blocks do not fit."""
        blocks: list[int] = []
        cached = 0
        if self.cache is not None:
            blocks, cached = self.cache.match_prefix(seq.token_ids[: seq.num_tokens - 1], record=False)
        seq.block_table.adopt(blocks, cached)
        n = min(seq.num_tokens - cached, budget)
        if not self._fit(seq, cached + n):
            seq.block_table.release()
            return 0
        if self.cache is not None:
            self.cache.record(seq.num_tokens - 1, cached)
        seq.start_prefill(cached)
        self.waiting.popleft()
        self.running.append(seq)
        return n

    def _chunk(self, seq: Sequence, n: int) -> PrefillChunk:
        start = seq.num_computed_tokens
        return PrefillChunk(
            seq=seq,
            start=start,
            token_ids=tuple(seq.token_ids[start:start + n]),
            slots=tuple(seq.block_table.slots(start, start + n)),
            completes=n == seq.prefill_remaining,
        )

    def _decode(self, seq: Sequence, n: int) -> DecodeItem:
        start = seq.num_computed_tokens
        return DecodeItem(seq=seq, start=start, slots=tuple(seq.block_table.slots(start, start + n)))

"""One request's state inside the engine, on plain Python lists.

Token accounting: `token_ids` = prompt + output. `num_computed_tokens` positions have their KV
written. A sequence is admitted with a prefill target (all its tokens: the prompt, or prompt +
output after a preemption); chunks advance `num_computed_tokens` up to that target, and the last
chunk's logits give the next token. From then on it decodes: `num_computed_tokens ==
num_tokens - 1`, the last token is the next step's input.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from specserve.kv.block_pool import BlockTable, KVInvariantError


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    PREEMPTED = "preempted"  # waiting again, to be recomputed


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_ids: Iterable[int],
        params: object,
        block_table: BlockTable,
        arrival_time: float,
        seq_no: int,
    ) -> None:
        prompt = list(prompt_ids)
        if not prompt:
            raise ValueError(f"request {request_id!r}: the prompt needs at least one token")
        self.request_id = request_id
        self.prompt_ids = prompt
        self.output_ids: list[int] = []
        self.params = params  # sampling parameters, opaque to the scheduler
        self.block_table = block_table
        self.arrival_time = arrival_time
        self.seq_no = seq_no  # arrival order: larger = arrived later
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # computed tokens that came from the prefix cache at admission
        self.num_preemptions = 0
        self._tokens = list(prompt)
        self._prefill_target = 0

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )

    @property
    def token_ids(self) -> list[int]:
        """Prompt + output (do not mutate)."""
        return self._tokens

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def in_prefill(self) -> bool:
        return self.num_computed_tokens < self._prefill_target

    @property
    def prefill_remaining(self) -> int:
        return max(0, self._prefill_target - self.num_computed_tokens)

    def start_prefill(self, num_cached_tokens: int) -> None:
        """Admission: the first `num_cached_tokens` have KV already (prefix cache); prefill the rest."""
        if not 0 <= num_cached_tokens < self.num_tokens:
            raise KVInvariantError(f"{num_cached_tokens} cached tokens for a sequence of {self.num_tokens}")
        self.num_cached_tokens = num_cached_tokens
        self.num_computed_tokens = num_cached_tokens
        self._prefill_target = self.num_tokens
        self.status = SequenceStatus.RUNNING

    def advance(self, num_computed: int, new_token_ids: Iterable[int]) -> None:
        """After a step: `num_computed` more positions have KV, `new_token_ids` join the output."""
        end = self.num_computed_tokens + num_computed
        if num_computed < 0 or end > self.block_table.num_slots:
            raise KVInvariantError(
                f"{self.request_id!r}: KV for positions up to {end} but only {self.block_table.num_slots} reserved"
            )
        self.num_computed_tokens = end
        new = list(new_token_ids)
        self.output_ids.extend(new)
        self._tokens.extend(new)

    def reset(self) -> None:
        """Forget all KV (preemption by recompute); tokens are kept and recomputed later."""
        self.block_table.release()
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self._prefill_target = 0

"""`AsyncEngine`: the `ServingEngine` that runs requests one at a time.

The `LLM` lives in one worker thread that takes queued requests in order and runs each through
`LLM.generate_one`; every committed delta is detokenized there and handed to the event loop with
`loop.call_soon_threadsafe`. The queue is bounded (`--max-queue`): `submit` raises `QueueFull` instead of
growing. Aborting a request (client gone, shutdown) drops it from the queue, or makes the running one
stop at its next committed token.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from specserve.engine.llm import LLM
from specserve.server.detokenizer import IncrementalDetokenizer
from specserve.server.engine_api import (
    EngineClosed,
    EngineOutput,
    EngineRequest,
    EngineStats,
    QueueFull,
    RequestGroup,
)
from specserve.tokenizer import Tokenizer
from specserve.types import GenerationResult

log = logging.getLogger("specserve.server")


@dataclass
class _Job:
    request: EngineRequest
    index: int
    group: RequestGroup
    aborted: bool = False


@dataclass
class _Totals:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    verify_steps: int = 0
    accept_sum: int = 0
    position_accepted: list[int] = field(default_factory=list)

    def add(self, reason: str, prompt_tokens: int, res: GenerationResult | None, speculative: bool) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1
        self.prompt_tokens += prompt_tokens
        if res is None:
            return
        self.generation_tokens += res.num_tokens
        if speculative:
            self.verify_steps += len(res.accept_lengths)
            self.accept_sum += sum(res.accept_lengths)
            for length in res.accept_lengths:
                self.position_accepted.extend([0] * (length - 1 - len(self.position_accepted)))
                for i in range(length - 1):
                    self.position_accepted[i] += 1


class AsyncEngine:
    def __init__(self, llm: LLM, max_queue: int) -> None:
        if max_queue < 1:
            raise ValueError(f"--max-queue must be at least 1 (requests waiting before 503), got {max_queue}")
        self._llm = llm
        self._max_queue = max_queue
        self._cv = threading.Condition()
        self._waiting: deque[_Job] = deque()
        self._jobs: dict[str, _Job] = {}  # waiting or running
        self._running: _Job | None = None
        self._closed = False
        self._totals = _Totals()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    @property
    def tokenizer(self) -> Tokenizer:
        return self._llm.tokenizer

    @property
    def max_context(self) -> int:
        return self._llm.config.max_position_embeddings

    @property
    def ready(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closed

    def describe(self) -> dict[str, Any]:
        return {
            "model_path": str(self._llm.model_dir),
            "device": str(self._llm.device),
            "dtype": str(self._llm.dtype).removeprefix("torch."),
            "max_context_length": self.max_context,
            "speculative": dataclasses.asdict(self._llm.spec),
            "engine": "sequential",
        }

    def start(self) -> None:
        """Start the worker; call from the event loop that will consume the outputs."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._work, name="specserve-engine", daemon=True)
        self._thread.start()

    def submit(self, requests: list[EngineRequest]) -> RequestGroup:
        """Queue all requests or none: raises QueueFull or EngineClosed."""
        group = RequestGroup([r.request_id for r in requests], self._abort)
        with self._cv:
            if self._closed or self._loop is None:
                raise EngineClosed("the server is not accepting requests (shutting down)")
            if len(self._waiting) + len(requests) > self._max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are waiting (--max-queue {self._max_queue})")
            for i, r in enumerate(requests):
                job = _Job(r, i, group)
                self._waiting.append(job)
                self._jobs[r.request_id] = job
            self._cv.notify()
        return group

    def stats(self) -> EngineStats:
        with self._cv:
            t = self._totals
            return EngineStats(
                num_waiting=len(self._waiting), num_running=int(self._running is not None),
                max_queue=self._max_queue, prompt_tokens=t.prompt_tokens, generation_tokens=t.generation_tokens,
                finished=dict(t.finished), speculative=self._llm.spec.enabled, spec_verify_steps=t.verify_steps,
                spec_accept_length_sum=t.accept_sum, spec_position_accepted=tuple(t.position_accepted),
            )

    async def shutdown(self, timeout: float) -> None:
        """Take no more requests, abort the queued and the running one, wait for the worker."""
        with self._cv:
            self._closed = True
            dropped = list(self._waiting)
            self._waiting.clear()
            for job in dropped:
                self._jobs.pop(job.request.request_id, None)
            if self._running is not None:
                self._running.aborted = True
            self._cv.notify_all()
        for job in dropped:
            self._finish_unrun(job)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)

    # -- internals

    def _abort(self, request_id: str) -> None:
        with self._cv:
            job = self._jobs.get(request_id)
            if job is None:
                return
            job.aborted = True
            queued = job is not self._running
            if queued:
                self._waiting.remove(job)
                del self._jobs[request_id]
        if queued:
            self._finish_unrun(job)

    def _finish_unrun(self, job: _Job) -> None:
        with self._cv:
            self._totals.add("abort", 0, None, False)
        self._emit(job, EngineOutput(job.index, "", len(job.request.prompt_ids), 0, True, "abort"))

    def _emit(self, job: _Job, out: EngineOutput) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens any more
            self._loop.call_soon_threadsafe(job.group.put, out)

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._closed:
                    self._cv.wait()
                if not self._waiting:
                    return
                job = self._waiting.popleft()
                self._running = job
            try:
                self._run(job)
            finally:
                with self._cv:
                    self._running = None
                    self._jobs.pop(job.request.request_id, None)

    def _run(self, job: _Job) -> None:
        req, llm = job.request, self._llm
        params = req.params
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(llm.eos_ids))
        detok = IncrementalDetokenizer(llm.tokenizer.decode, req.skip_special_tokens, stop_ids, params.stop)
        n_prompt = len(req.prompt_ids)
        produced = 0

        def on_tokens(ids: list[int]) -> bool:
            nonlocal produced
            if job.aborted:
                return False
            produced += len(ids)
            text = detok.push(ids)
            if text:
                self._emit(job, EngineOutput(job.index, text, n_prompt, produced))
            return not job.aborted

        try:
            res = llm.generate_one(list(req.prompt_ids), params, on_tokens)
        except Exception as e:  # a failure of one request must not stop the worker
            log.exception("request %s failed", req.request_id)
            with self._cv:
                self._totals.add("error", n_prompt, None, False)
            self._emit(job, EngineOutput(job.index, "", n_prompt, produced, True, "error", f"{type(e).__name__}: {e}"))
            return
        with self._cv:
            self._totals.add(res.finish_reason, n_prompt, res, llm.spec.enabled)
        self._emit(job, EngineOutput(job.index, detok.finish(), n_prompt, res.num_tokens, True, res.finish_reason))

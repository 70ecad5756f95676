"""`BatchServingEngine`: the `ServingEngine` the server runs, on the continuous-batching `BatchEngine`.

The `BatchEngine` lives in one worker thread. `submit` and aborts only queue work under a lock (the
bounded queue answers `QueueFull` at once); the worker applies them between steps, runs `step()`,
detokenizes each request's new tokens and hands the deltas to the event loop with
`loop.call_soon_threadsafe`. An aborted request (client gone, shutdown) leaves the batch at the next
step boundary and its KV blocks go back to the pool.

Overlap (on unless `--disable-overlap-schedule`): a second thread detokenizes and delivers step N's outputs
while the worker already runs step N+1 (every delivery and finish goes through that thread, in order).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from specserve.engine.batch import BatchEngine
from specserve.engine.engine_config import RequestStats, StepOutput
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
from specserve.types import Grammar

log = logging.getLogger("specserve.server")


@dataclass
class _Job:
    request: EngineRequest
    index: int
    group: RequestGroup
    detok: IncrementalDetokenizer
    produced: int = 0


class BatchServingEngine:
    def __init__(self, llm: LLM, engine: BatchEngine, max_queue: int, overlap: bool = True) -> None:
        if max_queue < 1:
            raise ValueError(f"--max-queue must be at least 1 (requests waiting before 503), got {max_queue}")
        self._llm = llm
        self._engine = engine
        self._max_queue = max_queue
        self._cv = threading.Condition()
        self._inbox: list[_Job] = []
        self._aborts: set[str] = set()
        self._jobs: dict[str, _Job] = {}  # submitted and not finished (inbox included)
        self._closed = False
        self._unrun_aborts = 0  # aborted before they reached the engine
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._overlap = overlap
        self._posted: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._delivery: threading.Thread | None = None

    @property
    def engine(self) -> BatchEngine:
        return self._engine

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
            **self._engine.describe(),
            "overlap_schedule": self._overlap,
        }

    def start(self) -> None:
        """Start the worker; call from the event loop that will consume the outputs."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._work, name="specserve-engine", daemon=True)
        if self._overlap:
            self._delivery = threading.Thread(target=self._deliver_loop, name="specserve-delivery", daemon=True)
            self._delivery.start()
        self._thread.start()

    def submit(self, requests: list[EngineRequest]) -> RequestGroup:
        """Queue all requests or none: raises QueueFull or EngineClosed."""
        group = RequestGroup([r.request_id for r in requests], self._abort)
        with self._cv:
            if self._closed or self._loop is None:
                raise EngineClosed("the server is not accepting requests (shutting down)")
            # aborts pending for the worker still count: they may be running requests, not waiting ones
            waiting = self._engine.scheduler.num_waiting + len(self._inbox)
            if waiting + len(requests) > self._max_queue:
                raise QueueFull(f"{waiting} requests are waiting (--max-queue {self._max_queue})")
            for i, r in enumerate(requests):
                p = r.params
                stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self._llm.eos_ids))
                detok = IncrementalDetokenizer(self._llm.tokenizer, r.skip_special_tokens, stop_ids, p.stop)
                job = _Job(r, i, group, detok)
                self._inbox.append(job)
                self._jobs[r.request_id] = job
            self._cv.notify()
        return group

    def check_grammar(self, grammar: Grammar) -> int:
        return self._llm.grammars.compile(grammar)

    def stats(self) -> EngineStats:
        """The engine's snapshot, with what waits here before the engine sees it."""
        with self._cv:
            inbox = len(self._inbox)
            s = self._engine.stats()
        return dataclasses.replace(
            s, num_waiting=s.num_waiting + inbox, max_queue=self._max_queue,
            finished={**s.finished, "abort": s.finished.get("abort", 0) + self._unrun_aborts},
        )

    async def shutdown(self, timeout: float) -> None:
        """Take no more requests, abort every queued and running one, wait for the worker."""
        with self._cv:
            self._closed = True
            self._aborts.update(self._jobs)
            self._cv.notify_all()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)
        if self._delivery is not None:
            await asyncio.to_thread(self._delivery.join, timeout)
        if self._engine.pass_log is not None:
            self._engine.pass_log.close()

    # -- internals

    def _abort(self, request_id: str) -> None:
        with self._cv:
            job = self._jobs.get(request_id)
            if job is None:
                return
            if job in self._inbox:  # not in the engine yet: gone at once
                self._inbox.remove(job)
                del self._jobs[request_id]
                self._unrun_aborts += 1
            else:
                self._aborts.add(request_id)
                self._cv.notify()
                return
        self._emit(job, EngineOutput(job.index, "", len(job.request.prompt_ids), 0, True, "abort"))

    def _emit(self, job: _Job, out: EngineOutput) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens any more
            self._loop.call_soon_threadsafe(job.group.put, out)

    def _finish(self, job: _Job, reason: str, error: str | None = None, text: str = "",
                stats: RequestStats | None = None) -> None:
        with self._cv:
            self._jobs.pop(job.request.request_id, None)
        text = text + job.detok.finish() if error is None else ""
        meta = stats.meta_info(job.produced, self._engine.drafters is not None) if stats is not None else None
        self._emit(job, EngineOutput(job.index, text, len(job.request.prompt_ids), job.produced, True, reason, error,
                                     meta))

    def _post(self, fn: Callable[[], None]) -> None:
        """Run `fn` (a delivery or a finish) on the delivery thread, in order, or here without overlap."""
        if self._overlap:
            self._posted.put(fn)
        else:
            fn()

    def _deliver_loop(self) -> None:
        while (fn := self._posted.get()) is not None:
            try:
                fn()
            except Exception:  # one bad delivery must not stop the others
                log.exception("delivering engine output failed")

    def _work(self) -> None:
        try:
            self._run_steps()
        finally:
            self._posted.put(None)  # the delivery thread ends after what is queued

    def _run_steps(self) -> None:
        e = self._engine
        while True:
            if e.profile_measurable:  # once, after a background warm-up (`engine/warmup.py`), between steps
                try:
                    e.measure_due_profile()
                except Exception:
                    log.exception("measuring the adaptive cost profile failed; speculating without it")
            with self._cv:
                while not self._inbox and not self._aborts and not e.has_unfinished and not self._closed:
                    if e.profile_measurable:
                        break
                    self._cv.wait(timeout=0.5 if e.profile_due is not None else None)
                if self._closed and not self._inbox and not self._aborts and not e.has_unfinished:
                    return
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, set()
            for rid in aborts:  # first: their places in the waiting queue go to the new requests
                running = self._jobs.get(rid)
                if running is not None and e.abort(rid):
                    self._post(partial(self._finish, running, "abort"))
            for job in inbox:
                rid = job.request.request_id
                try:
                    e.add_request(rid, list(job.request.prompt_ids), job.request.params)
                except (ValueError, QueueFull) as err:  # the app checks lengths first; this is the engine's last word
                    self._post(partial(self._finish, job, "error", str(err)))
            if not e.has_unfinished:
                continue
            try:
                outs = e.step()
            except Exception as err:  # a bug must not kill the server: fail the batch, keep serving
                log.exception("engine step failed; failing the running requests")
                msg = f"{type(err).__name__}: {err}"
                for rid, job in list(self._jobs.items()):
                    if e.abort(rid):
                        self._post(partial(self._finish, job, "error", msg))
                continue
            self._post(partial(self._deliver_all, outs))

    def _deliver_all(self, outs: list[StepOutput]) -> None:
        for o in outs:
            self._deliver(o)

    def _deliver(self, o: StepOutput) -> None:
        job = self._jobs.get(o.request_id)
        if job is None:
            return
        job.produced += len(o.new_token_ids)
        text = job.detok.push(o.new_token_ids) if o.new_token_ids else ""
        if o.finish_reason is not None:
            self._finish(job, o.finish_reason, text=text, stats=o.stats)
        elif text:
            self._emit(job, EngineOutput(job.index, text, len(job.request.prompt_ids), job.produced))


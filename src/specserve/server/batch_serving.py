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
from pathlib import Path
from typing import Any

from specserve.engine.adaptive import AdaptivePolicy
from specserve.engine.batch import BatchEngine
from specserve.engine.engine_config import EngineConfig, StepOutput
from specserve.engine.llm import LLM
from specserve.engine.pass_log import PassLog
from specserve.engine.profile import engine_profile
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
        e = self._engine
        return {
            "model_path": str(self._llm.model_dir),
            "device": str(self._llm.device),
            "dtype": str(self._llm.dtype).removeprefix("torch."),
            "max_context_length": self.max_context,
            "speculative": dataclasses.asdict(self._llm.spec),
            "engine": "continuous-batching",
            "engine_config": dataclasses.asdict(e.config),
            "num_kv_blocks": e.pool.num_blocks,
            "prefix_cache": e.cache is not None,
            "host_tier_blocks": e.host.capacity if e.host is not None else 0,
            "speculative_adaptive": e.policy is not None,
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
                detok = IncrementalDetokenizer(self._llm.tokenizer.decode, r.skip_special_tokens, stop_ids, p.stop)
                job = _Job(r, i, group, detok)
                self._inbox.append(job)
                self._jobs[r.request_id] = job
            self._cv.notify()
        return group

    def stats(self) -> EngineStats:
        e = self._engine
        c = e.counters
        with self._cv:
            waiting = e.scheduler.num_waiting + len(self._inbox)
        cache = e.cache.stats if e.cache is not None else None
        host = e.host.stats if e.host is not None else None
        return EngineStats(
            num_waiting=waiting, num_running=e.scheduler.num_running, max_queue=self._max_queue,
            prompt_tokens=c.prompt_tokens, generation_tokens=c.generation_tokens,
            finished={**c.finished, "abort": c.finished.get("abort", 0) + self._unrun_aborts},
            speculative=e.drafters is not None, spec_verify_steps=c.verify_rounds, spec_accept_length_sum=c.accept_sum,
            spec_position_accepted=tuple(c.position_accepted),
            kv_blocks_total=e.pool.num_blocks, kv_blocks_free=e.pool.num_free,
            kv_blocks_cached=e.cache.num_device_blocks if e.cache is not None else 0,
            num_preemptions=e.scheduler.num_preemptions,
            prefix_hit_tokens=cache.hit_tokens if cache else 0, prefix_miss_tokens=cache.miss_tokens if cache else 0,
            host_hit_tokens=cache.host_hit_tokens if cache else 0,
            host_blocks_used=e.host.num_used if e.host is not None else 0,
            device_to_host_blocks=host.device_to_host if host else 0,
            host_to_device_blocks=host.host_to_device if host else 0,
            engine_steps=c.steps, spec_steps=c.spec_steps, engine_step_seconds=c.step_s,
            engine_forward_seconds=c.forward_s,
            adaptive_choices=dict(e.policy.choices) if e.policy is not None else {},
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

    def _finish(self, job: _Job, reason: str, error: str | None = None, text: str = "") -> None:
        with self._cv:
            self._jobs.pop(job.request.request_id, None)
        text = text + job.detok.finish() if error is None else ""
        self._emit(job, EngineOutput(job.index, text, len(job.request.prompt_ids), job.produced, True, reason, error))

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
            with self._cv:
                while not self._inbox and not self._aborts and not e.has_unfinished and not self._closed:
                    self._cv.wait()
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
            self._finish(job, o.finish_reason, text=text)
        elif text:
            self._emit(job, EngineOutput(job.index, text, len(job.request.prompt_ids), job.produced))


def build_batch_engine(llm: LLM, config: EngineConfig, adaptive: bool = True,
                       profile_path: str | None = None, trace_path: str | None = None) -> BatchEngine:
    """The continuous-batching engine for a loaded `LLM`; with speculation and `adaptive`, its cost profile
    is loaded from `profile_path` (or the per-machine default) or measured there first. `trace_path`: a
    JSON-lines log of every decode pass (`engine/pass_log.py`)."""
    engine = BatchEngine(llm.model, llm.eos_ids, llm.tokenizer.decode, config, llm.drafter_builder)
    if trace_path:
        engine.pass_log = PassLog(Path(trace_path))
    if adaptive and llm.drafter_builder is not None and engine.max_draft > 0:
        profile, path = engine_profile(engine, Path(profile_path) if profile_path else None)
        log.info("adaptive speculation: cost profile %s", path)
        engine.policy = AdaptivePolicy(profile, engine.max_draft, stepwise=llm.drafter_builder.stepwise)
    return engine

"""The serving sweep: each concurrency level sends every prompt (or conversation, one turn at a time) with
exactly C requests in flight, and its figures are aggregated with the server's before/after counters; one
request and its stream are `serving_client.py`'s, the per-level statistics `metrics.py`'s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from tqdm import tqdm

from specserve.bench.conversations import Conversation
from specserve.bench.metrics import RequestResult, aggregate_level, summarize_ms
from specserve.bench.prompts import Prompt
from specserve.bench.server_probe import (
    accept_length,
    prefix_cache_from_metrics,
    scrape_metrics,
    server_config,
    spec_step_fraction,
    take_snapshot,
)
from specserve.bench.serving_client import (
    ServingConfig,
    build_body,
    client_session,
    normalize_base_url,
    send_body,
    send_request,
)

WARMUP_TOKENS = 4


@dataclass
class InFlight:
    """Requests currently sent and not finished, and the most seen at once (one level's counter)."""

    now: int = 0
    peak: int = 0

    def enter(self) -> None:
        self.now += 1
        self.peak = max(self.peak, self.now)

    def leave(self) -> None:
        self.now -= 1


async def run_level(client: aiohttp.ClientSession, cfg: ServingConfig, prompts: Sequence[Prompt], concurrency: int,
                    ignore_eos: bool = False, progress: bool = True) -> dict[str, Any]:
    """All `prompts` with exactly `concurrency` requests in flight (fewer only at the tail)."""
    if concurrency < 1:
        raise ValueError(f"--concurrency values must be >= 1, got {concurrency}")
    base = normalize_base_url(cfg.base_url)
    before = await take_snapshot(client, base)
    metrics_before = await scrape_metrics(client, base)
    gate = asyncio.Semaphore(concurrency)
    in_flight = InFlight()
    bar = tqdm(total=len(prompts), desc=f"concurrency {concurrency}", unit="req", disable=not progress, leave=True)

    async def one(prompt: Prompt) -> RequestResult:
        async with gate:
            in_flight.enter()
            try:
                return await send_request(client, cfg, prompt, prompt.max_tokens or cfg.output_len, ignore_eos)
            finally:
                in_flight.leave()
                bar.update(1)

    t0 = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in prompts))
    duration = time.perf_counter() - t0
    bar.close()
    level = aggregate_level(results, concurrency, duration, in_flight.peak)
    level["accept_length"], level["accept_length_source"] = accept_length(before, await take_snapshot(client, base))
    level["spec_step_fraction"] = spec_step_fraction(metrics_before, await scrape_metrics(client, base))
    return level


def build_turn_body(cfg: ServingConfig, conv: Conversation, turn: int, answers: list[str],
                    ignore_eos: bool) -> dict[str, Any]:
    """Request `turn` of `conv` with the whole history: chat messages, or the transcript for completions."""
    max_tokens = conv.max_tokens or cfg.output_len
    if conv.single is not None:
        return build_body(cfg, conv.single, max_tokens, ignore_eos)
    if cfg.endpoint == "chat":
        prompt = Prompt(messages=tuple((m["role"], m["content"]) for m in conv.messages(turn, answers)))
    else:
        prompt = Prompt(text=conv.transcript(turn, answers))
    return build_body(cfg, prompt, max_tokens, ignore_eos)


#: called after every turn with (conversation, turn, request body, result, answer text); for tests and traces
OnTurn = Callable[[Conversation, int, dict[str, Any], RequestResult, str], None]


async def run_conversation_level(client: aiohttp.ClientSession, cfg: ServingConfig,
                                 conversations: Sequence[Conversation], concurrency: int, ignore_eos: bool = False,
                                 progress: bool = True, on_turn: OnTurn | None = None) -> dict[str, Any]:
    """All `conversations` with `concurrency` of them in flight, one turn at a time each (a turn is sent when the
    previous one's answer is in); the level's figures as `run_level`'s, and TTFT of first and later turns, the
    prefix cache's hit rate and host-tier moves from /metrics. A failed turn ends its conversation: the turns
    left are counted as failed ("skipped")."""
    if concurrency < 1:
        raise ValueError(f"--concurrency values must be >= 1, got {concurrency}")
    base = normalize_base_url(cfg.base_url)
    before = await take_snapshot(client, base)
    metrics_before = await scrape_metrics(client, base)
    queue = list(reversed(conversations))
    in_flight = InFlight()
    done: list[tuple[Conversation, int, RequestResult]] = []
    bar = tqdm(total=sum(c.num_turns for c in conversations), desc=f"concurrency {concurrency}", unit="turn",
               disable=not progress, leave=True)

    async def worker() -> None:
        while queue:
            conv = queue.pop()
            answers: list[str] = []
            for turn in range(conv.num_turns):
                if len(answers) < turn:  # an earlier turn failed: this one cannot be built
                    result = RequestResult(error=f"skipped: turn {len(answers)} of its conversation failed",
                                           prompt_tokens=None, usage_tokens=None, streamed_tokens=0, timing=None)
                else:
                    body = build_turn_body(cfg, conv, turn, answers, ignore_eos)
                    in_flight.enter()
                    try:
                        result, answer = await send_body(client, cfg, body)
                    finally:
                        in_flight.leave()
                    if result.ok:
                        answers.append(answer)
                    if on_turn is not None:
                        on_turn(conv, turn, body, result, answer)
                done.append((conv, turn, result))
                bar.update(1)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(conversations)))))
    duration = time.perf_counter() - t0
    bar.close()
    results = [r for _, _, r in done]
    level = aggregate_level(results, concurrency, duration, in_flight.peak)
    for record, (conv, turn, _) in zip(level["requests"], done, strict=True):
        record["conversation"], record["turn"] = conv.id, turn
    level["num_conversations"] = len(conversations)
    level["ttft_first_turn_ms"] = summarize_ms([r.timing.ttft_s for _, t, r in done if t == 0 and r.timing])
    level["ttft_later_turns_ms"] = summarize_ms([r.timing.ttft_s for _, t, r in done if t > 0 and r.timing])
    level["accept_length"], level["accept_length_source"] = accept_length(before, await take_snapshot(client, base))
    metrics_after = await scrape_metrics(client, base)
    level["spec_step_fraction"] = spec_step_fraction(metrics_before, metrics_after)
    level["prefix_cache"] = prefix_cache_from_metrics(metrics_before, metrics_after)
    return level


async def warm_up(client: aiohttp.ClientSession, cfg: ServingConfig, prompt: Prompt) -> dict[str, Any]:
    """One short request; with --ignore-eos it also finds out whether the server accepts the field."""
    max_tokens = min(WARMUP_TOKENS, cfg.output_len)
    result = await send_request(client, cfg, prompt, max_tokens, cfg.ignore_eos)
    applied = cfg.ignore_eos
    note = None
    if cfg.ignore_eos and result.error is not None and result.error.startswith("HTTP 4"):
        note = f"server rejected ignore_eos ({result.error[:120]}); sweeping without it"
        applied = False
        result = await send_request(client, cfg, prompt, max_tokens, False)
    return {"ok": result.ok, "error": result.error, "ignore_eos_applied": applied, "note": note}


async def run_sweep(cfg: ServingConfig, prompts: Sequence[Prompt], concurrencies: Sequence[int], warmup: bool = True,
                    progress: bool = True, conversations: Sequence[Conversation] = ()) -> dict[str, Any]:
    """Server configuration, warm-up outcome and one entry per concurrency level (each sends all `prompts`, or
    all `conversations` where given: `run_conversation_level`)."""
    if not concurrencies:
        raise ValueError("--concurrency needs at least one level, e.g. 1,4,16")
    async with client_session(cfg.request_timeout_s, max(concurrencies) + 4, cfg.api_key) as client:
        server = await server_config(client, normalize_base_url(cfg.base_url))
        first = prompts[0] if prompts else Prompt(messages=tuple(
            (m["role"], m["content"]) for m in conversations[0].messages(0, [])))
        warm = await warm_up(client, cfg, first) if warmup else None
        ignore_eos = warm["ignore_eos_applied"] if warm is not None else cfg.ignore_eos
        if conversations:
            levels = [await run_conversation_level(client, cfg, conversations, c, ignore_eos, progress)
                      for c in concurrencies]
        else:
            levels = [await run_level(client, cfg, prompts, c, ignore_eos, progress) for c in concurrencies]
    return {"server": server, "warmup": warm, "levels": levels}

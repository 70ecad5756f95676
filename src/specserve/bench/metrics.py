"""Serving metrics as pure functions: per-request timing from streamed chunks, per-level aggregation.

Definitions follow SGLang's bench_serving and vLLM's `bench serve`:
  TTFT  time from sending the request to the first streamed chunk that carries content.
  E2E   time from sending the request to the end of the stream.
  TPOT  (E2E - TTFT) / (output_tokens - 1) per request; requests with <= 1 output token have none.
  ITL   for every content chunk after the first: the gap since the previous content chunk divided
        by the number of tokens the chunk carries, recorded once per token (SGLang's rule, so a
        speculative server that streams 3 tokens per chunk shows a third of the chunk gap, 3 times).
        The tokens of the first chunk get no ITL entry.
Percentiles use numpy's linear interpolation, as both reference clients do. Times are seconds
inside the code and milliseconds in the report.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np

PERCENTILES: tuple[int, ...] = (50, 90, 99)


@dataclass(frozen=True)
class Chunk:
    """One streamed chunk that carried content: arrival time since the request was sent, and tokens in it."""

    t_s: float
    tokens: int

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise ValueError(f"Chunk.tokens must be >= 1 (chunks without tokens are skipped), got {self.tokens}")
        if self.t_s < 0:
            raise ValueError(f"Chunk.t_s must be >= 0 seconds since the request was sent, got {self.t_s}")


@dataclass(frozen=True)
class RequestTiming:
    ttft_s: float
    e2e_s: float
    tpot_s: float | None  # None when the request produced <= 1 output token
    itl_s: tuple[float, ...]


def request_timing(chunks: Sequence[Chunk], e2e_s: float, output_tokens: int) -> RequestTiming:
    """TTFT, TPOT and ITL of one request from its content chunks (in arrival order) and its end time."""
    if not chunks:
        raise ValueError("request_timing needs at least one content chunk")
    if e2e_s < chunks[-1].t_s:
        raise ValueError(f"e2e_s ({e2e_s}) is earlier than the last chunk ({chunks[-1].t_s})")
    ttft = chunks[0].t_s
    itl: list[float] = []
    for prev, cur in pairwise(chunks):
        gap = cur.t_s - prev.t_s
        itl.extend([gap / cur.tokens] * cur.tokens)
    tpot = (e2e_s - ttft) / (output_tokens - 1) if output_tokens > 1 else None
    return RequestTiming(ttft_s=ttft, e2e_s=e2e_s, tpot_s=tpot, itl_s=tuple(itl))


@dataclass(frozen=True)
class RequestResult:
    """The outcome of one benchmark request. `timing` is None exactly when the request failed."""

    error: str | None
    prompt_tokens: int | None  # usage.prompt_tokens, when the server reported usage
    usage_tokens: int | None  # usage.completion_tokens of the final usage chunk
    streamed_tokens: int  # sum of the per-chunk token counts seen in the stream
    timing: RequestTiming | None

    def __post_init__(self) -> None:
        if (self.error is None) == (self.timing is None):
            raise ValueError("RequestResult needs exactly one of error (failed) or timing (succeeded)")

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def output_tokens(self) -> int:
        """The server's count when it reported one, else the count from the stream."""
        return self.usage_tokens if self.usage_tokens is not None else self.streamed_tokens


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be within [0, 100], got {q}")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def summarize_ms(values_s: Sequence[float]) -> dict[str, float] | None:
    """mean/p50/p90/p99 in milliseconds of values given in seconds; None when there are none."""
    if not values_s:
        return None
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    out = {"mean": float(ms.mean())}
    for q in PERCENTILES:
        out[f"p{q}"] = float(np.percentile(ms, q))
    return out


def _rate(amount: float, duration_s: float) -> float | None:
    return amount / duration_s if duration_s > 0 else None


def request_record(r: RequestResult) -> dict[str, Any]:
    """The compact per-request entry stored in the run JSON (no ITL lists: they are aggregated)."""
    t = r.timing
    return {
        "ok": r.ok,
        "error": r.error,
        "prompt_tokens": r.prompt_tokens,
        "output_tokens": r.output_tokens if r.ok else None,
        "usage_tokens": r.usage_tokens,
        "streamed_tokens": r.streamed_tokens,
        "ttft_ms": t.ttft_s * 1000.0 if t else None,
        "tpot_ms": t.tpot_s * 1000.0 if t and t.tpot_s is not None else None,
        "e2e_ms": t.e2e_s * 1000.0 if t else None,
    }


def aggregate_level(
    results: Sequence[RequestResult], concurrency: int, duration_s: float, max_in_flight: int, max_messages: int = 5
) -> dict[str, Any]:
    """The per-concurrency entry of the run JSON. Throughputs count successful requests only."""
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    messages: list[str] = []
    for r in failed:
        if r.error is not None and r.error not in messages and len(messages) < max_messages:
            messages.append(r.error)
    timings = [r.timing for r in ok if r.timing is not None]
    input_tokens = sum(r.prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    with_usage = [r for r in ok if r.usage_tokens is not None]
    return {
        "concurrency": concurrency,
        "num_requests": len(results),
        "completed": len(ok),
        "errors": len(failed),
        "error_messages": messages,
        "duration_s": duration_s,
        "max_in_flight": max_in_flight,
        "request_throughput": _rate(len(ok), duration_s),
        "input_throughput": _rate(input_tokens, duration_s),
        "output_throughput": _rate(output_tokens, duration_s),
        "total_throughput": _rate(input_tokens + output_tokens, duration_s),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "token_counts": {
            "requests_with_usage": len(with_usage),
            "usage_tokens": sum(r.usage_tokens or 0 for r in with_usage),
            "streamed_tokens": sum(r.streamed_tokens for r in with_usage),
            "mismatched_requests": sum(1 for r in with_usage if r.usage_tokens != r.streamed_tokens),
        },
        "ttft_ms": summarize_ms([t.ttft_s for t in timings]),
        "tpot_ms": summarize_ms([t.tpot_s for t in timings if t.tpot_s is not None]),
        "itl_ms": summarize_ms([x for t in timings for x in t.itl_s]),
        "e2e_ms": summarize_ms([t.e2e_s for t in timings]),
        "requests": [request_record(r) for r in results],
    }

"""What the serving benchmark's client costs the server it measures: aiohttp (the sweep's client) vs httpx.

    python benchmarks/client_cpu.py --model demo --concurrency 1,16 --rounds 3

On a machine with few cores the client of a served benchmark runs beside the server and takes CPU from it, the
more the more streamed events per second it reads (one per request and engine step: most with plain decoding
at high concurrency). This script starts one plain `specserve serve` (NONE) and sends the same levels through
both HTTP clients in turn (the order alternates from round to round): `specserve bench serving`'s own level
(`run_level`, aiohttp) and the same requests read with httpx's `aiter_lines` (what the sweep used before session
23), both parsing every event with the sweep's `StreamReader`. Per level and client it measures this process's
CPU seconds (user + system) over the events read, and the output tok/s the server reached meanwhile.

Prints ONE JSON object: per concurrency and client the per-round CPU ms per event and tok/s, their medians, and
aiohttp's tok/s over httpx's (median of the per-round ratios).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from specserve.bench.datasets import Prompt, load_dataset, sample_prompts
from specserve.bench.serving import ServingConfig, StreamReader, build_body, client_session, run_level
from specserve.bench.tune import start_server, stop_server

SEED = 0


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def level_aiohttp(cfg: ServingConfig, prompts: Sequence[Prompt], c: int) -> int:
    """The sweep's level; returns the output tokens streamed (one event each from a plain server)."""
    async with client_session(cfg.request_timeout_s, c + 4) as client:
        level = await run_level(client, cfg, prompts, c, ignore_eos=True, progress=False)
    if level["errors"]:
        raise RuntimeError(f"aiohttp level failed: {level['error_messages']}")
    return int(level["total_output_tokens"])


async def level_httpx(cfg: ServingConfig, prompts: Sequence[Prompt], c: int) -> int:
    """The same requests read with httpx's line iterator and parsed alike."""
    gate = asyncio.Semaphore(c)
    limits = httpx.Limits(max_connections=c + 4, max_keepalive_connections=c + 4)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(cfg.request_timeout_s)) as client:

        async def one(prompt: Prompt) -> int:
            reader = StreamReader()
            start = time.perf_counter()
            async with gate, client.stream("POST", cfg.url, json=build_body(cfg, prompt, cfg.output_len, True)) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not reader.feed_line(line, start):
                        break
            return reader.streamed_tokens

        return sum(await asyncio.gather(*(one(p) for p in prompts)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--concurrency", default="1,16", help="levels, e.g. 1,16")
    ap.add_argument("--requests-per-slot", type=int, default=12, help="requests per level = this x concurrency")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    levels = [int(c) for c in a.concurrency.split(",")]
    clients: dict[str, Callable[[ServingConfig, Sequence[Prompt], int], Awaitable[int]]] = {
        "aiohttp": level_aiohttp, "httpx": level_httpx}
    dataset = load_dataset("coding", 32, SEED)
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_server(a.model, ["--speculative-algorithm", "NONE"], Path(tmp) / "server.log", 300.0)
        try:
            cfg = ServingConfig(base_url=url, model=a.model, output_len=a.output_len, ignore_eos=True)
            asyncio.run(level_aiohttp(cfg, dataset.prompts, 4))  # warm-up: every prompt once
            runs: dict[int, dict[str, list[tuple[float, float]]]] = {c: {n: [] for n in clients} for c in levels}
            for r in range(a.rounds):
                for c in levels:
                    prompts = sample_prompts(dataset, a.requests_per_slot * c, SEED)
                    for name in list(clients)[:: 1 if r % 2 == 0 else -1]:
                        c0, t0 = cpu_s(), time.perf_counter()
                        events = asyncio.run(clients[name](cfg, prompts, c))
                        wall, cpu = time.perf_counter() - t0, cpu_s() - c0
                        runs[c][name].append((1e3 * cpu / events, events / wall))
                        print(f"round {r + 1}, concurrency {c}, {name}: {1e3 * cpu / events:.3f} ms CPU per event, "
                              f"{events / wall:.1f} tok/s", file=sys.stderr, flush=True)
        finally:
            stop_server(proc)
    out: dict[str, Any] = {}
    for c, by in runs.items():
        entry: dict[str, Any] = {name: {"cpu_ms_per_event": [round(x, 4) for x, _ in v],
                                        "tok_s": [round(t, 1) for _, t in v],
                                        "cpu_ms_per_event_median": round(statistics.median(x for x, _ in v), 4),
                                        "tok_s_median": round(statistics.median(t for _, t in v), 1)}
                                 for name, v in by.items()}
        ratios = [ta / th for (_, ta), (_, th) in zip(by["aiohttp"], by["httpx"], strict=True)]
        entry["aiohttp_over_httpx_tok_s"] = round(statistics.median(ratios), 3)
        out[str(c)] = entry
    print(json.dumps({"benchmark": "client_cpu", "model": a.model, "output_len": a.output_len,
                      "requests_per_slot": a.requests_per_slot, "rounds": a.rounds, "levels": out}, indent=1))


if __name__ == "__main__":
    main()

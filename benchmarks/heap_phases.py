"""Where a server's memory goes, request kind by kind: glibc's heap in use and free, and RSS, between phases.

    python benchmarks/heap_phases.py --model smollm2 --kinds stream,chat --requests 60 --rounds 3 \
        --serve-args=--enforce-eager --out runs/heap_phases.json

Starts `specserve serve` (plus --serve-args), then per round sends --requests requests of each kind in turn (4 at a
time; the kinds of `benchmarks/soak.py`) and after each phase reads the server's `mallinfo2()` through gdb
(`uordblks`: bytes in use; `fordblks`: free bytes kept in the heap) and its VmRSS. In-use bytes that grow phase
after phase are memory something keeps; free bytes that grow are fragmentation. Python's own objects are
allocated mostly outside malloc (pymalloc arenas), so growth here is native: torch, oneDNN, tokenizers.
Needs gdb and permission to attach (ptrace). Prints ONE JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
from soak import KINDS, SERVE_ARGS, one, rss_mib

from specserve.bench.tune import start_server, stop_server


def heap_mib(pid: int) -> tuple[float, float]:
    """(in use, free in the heap) MiB of the process's glibc heap, read with gdb."""
    out = subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "p mallinfo2()"], capture_output=True, text=True,
                         check=False).stdout
    m = re.search(r"uordblks = (\d+), fordblks = (\d+)", out)
    if m is None:
        raise RuntimeError(f"gdb could not read mallinfo2() of {pid} (is gdb installed, may it attach?): {out[-300:]}")
    return int(m.group(1)) / 2**20, int(m.group(2)) / 2**20


async def phase(url: str, kind: str, n: int, rng: random.Random) -> None:
    async with aiohttp.ClientSession() as session:
        gate = asyncio.Semaphore(4)

        async def send() -> None:
            async with gate:
                await one(session, url, kind, rng)

        await asyncio.gather(*(send() for _ in range(n)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--kinds", default="stream,chat", help=f"comma-separated, of {', '.join(KINDS)}")
    ap.add_argument("--requests", type=int, default=60, help="requests per kind and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serve-args", default="--enforce-eager")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    if unknown := set(kinds) - set(KINDS):
        ap.error(f"--kinds: unknown {sorted(unknown)}; choose from {', '.join(KINDS)}")
    log = (args.out or Path("runs/heap_phases.json")).with_suffix(".server.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    extra = [*SERVE_ARGS, *shlex.split(args.serve_args)]
    proc, url = start_server(args.model, extra, log, 900)
    rng = random.Random(args.seed)
    phases: list[dict[str, Any]] = []

    def record(rnd: int, kind: str, seconds: float) -> None:
        used, free = heap_mib(proc.pid)
        phases.append({"round": rnd, "kind": kind, "heap_in_use_mib": round(used, 1), "heap_free_mib": round(free, 1),
                       "rss_mib": round(rss_mib(proc.pid), 1), "seconds": round(seconds, 1)})
        print(json.dumps(phases[-1]), file=sys.stderr, flush=True)

    try:
        record(-1, "start", 0.0)
        for rnd in range(args.rounds):
            for kind in kinds:
                t0 = time.perf_counter()
                asyncio.run(phase(url, kind, args.requests, rng))
                record(rnd, kind, time.perf_counter() - t0)
    finally:
        stop_server(proc)
    after_first = [p for p in phases if p["round"] >= 1]
    per_request = None
    if after_first:  # growth from the end of round 0 (caches filled) on, per request
        first = next(p for p in phases if p["round"] == 0 and p["kind"] == kinds[-1])
        n = args.requests * len(after_first)
        per_request = round((after_first[-1]["heap_in_use_mib"] - first["heap_in_use_mib"]) * 1024 / n, 1)
    report = {"model": args.model, "serve_args": extra, "kinds": kinds, "requests": args.requests,
              "phases": phases, "heap_in_use_growth_kib_per_request_after_round_0": per_request,
              "command": shlex.join(sys.argv)}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

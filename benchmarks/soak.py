"""Soak: a real server under agent-like traffic for minutes, watched for errors and memory growth.

    python benchmarks/soak.py --model smollm2 --minutes 10 --clients 8 --out runs/soak.json

Starts `specserve serve --model MODEL --tool-call-parser smollm2` (plus --serve-args) and runs --clients
concurrent clients for --minutes. Each loops over a seeded mix of requests: streamed chat answers (a third of
them dropped after a few chunks, the client closing the connection), plain chat answers, json_object and
json_schema answers, forced tool calls, and two-turn sessions that send a tool result back. It records every
status code, checks every structured answer parses, samples the server's RSS every --sample-s seconds, and at the
end (after the clients stop) the KV blocks in use, which must be back to those the prefix cache holds.

Prints ONE JSON object: requests by kind and status, 5xx count, failed parses, RSS after the warm-up (the first
--warmup-min minutes) and at the end with their ratio and a least-squares slope (MiB per minute) over the
post-warm-up samples, the blocks check. Exit code 0 when there were no 5xx, every structured answer parsed and the
RSS after the warm-up grew by less than --max-rss-growth; 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from specserve.bench.tune import log_tail, start_server, stop_server

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file of the workspace",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                     "required": ["path"]}}},
    {"type": "function", "function": {"name": "run_tests", "description": "Run tests matching a pattern",
                                      "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}},
                                                     "required": ["pattern"]}}},
]
SCHEMA = {"type": "object", "properties": {"file": {"type": "string"}, "ok": {"type": "boolean"},
                                           "lines": {"type": "integer"}}, "required": ["file", "ok", "lines"]}
TASKS = [
    "Write a Python function that merges two sorted lists.",
    "Explain what a Python decorator is, with an example.",
    "Fix this code: def add(a, b) return a + b",
    "Write a unit test for a function that reverses a string.",
    "How do I read a JSON file in Python?",
    "Write a class for a stack with push, pop and peek.",
]
KINDS = ("stream", "stream_drop", "chat", "json_object", "json_schema", "tool_required", "two_turns")
#: the server flags every request of `one` relies on: its model name and the tool-call parser
SERVE_ARGS = ("--served-model-name", "soak", "--tool-call-parser", "smollm2")


async def one(session: aiohttp.ClientSession, url: str, kind: str, rng: random.Random) -> tuple[int, bool]:
    """Send one request of `kind`; (HTTP status, whether its answer was as expected)."""
    task = rng.choice(TASKS)
    body: dict[str, Any] = {"model": "soak", "messages": [{"role": "user", "content": task}],
                            "max_tokens": rng.choice((32, 64, 96)), "temperature": rng.choice((0.0, 0.7)),
                            "seed": rng.randrange(1 << 30)}
    if kind in ("stream", "stream_drop"):
        body["stream"] = True
        keep = rng.randrange(1, 6) if kind == "stream_drop" else None
        async with session.post(url + "/v1/chat/completions", json=body) as r:
            seen, done = 0, False
            async for line in r.content:
                if line.startswith(b"data: [DONE]"):
                    done = True
                elif line.startswith(b"data: "):
                    seen += 1
                    if keep is not None and seen >= keep:
                        break  # the client goes away mid-stream: the connection closes with the context
            return r.status, done or keep is not None
    if kind == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif kind == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
    elif kind in ("tool_required", "two_turns"):
        body |= {"tools": TOOLS, "tool_choice": "required"}
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        status, answer = r.status, await r.json()
    if status != 200:
        return status, False
    message = answer["choices"][0]["message"]
    if kind in ("json_object", "json_schema"):
        try:
            value = json.loads(message.get("content") or "")
        except json.JSONDecodeError:
            return status, False
        return status, isinstance(value, dict) and (kind == "json_object" or set(SCHEMA["required"]) <= set(value))
    if kind in ("tool_required", "two_turns"):
        calls = message.get("tool_calls") or []
        if not calls:
            return status, False
        if kind == "two_turns":
            body.pop("tool_choice")
            body["messages"] = [*body["messages"], message,
                                {"role": "tool", "tool_call_id": calls[0]["id"], "content": "def main():\n    pass\n"},
                                {"role": "user", "content": "What does that file do?"}]
            async with session.post(url + "/v1/chat/completions", json=body) as r2:
                await r2.read()
                return r2.status, r2.status == 200
    return status, True


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (minute, MiB) points."""
    if len(points) < 2:
        return 0.0
    mx = statistics.fmean(p[0] for p in points)
    my = statistics.fmean(p[1] for p in points)
    den = sum((p[0] - mx) ** 2 for p in points)
    return sum((p[0] - mx) * (p[1] - my) for p in points) / den if den else 0.0


async def soak(url: str, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    counts: dict[str, dict[str, int]] = {k: {} for k in KINDS}
    bad: dict[str, int] = dict.fromkeys(KINDS, 0)
    rss: list[tuple[float, float]] = []
    t0 = time.monotonic()
    end = t0 + args.minutes * 60
    timeout = aiohttp.ClientTimeout(total=300)

    async def client(i: int) -> None:
        rng = random.Random(args.seed * 1000 + i)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while time.monotonic() < end:
                kind = rng.choice(KINDS)
                try:
                    status, ok = await one(session, url, kind, rng)
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    status, ok = 0, False
                    print(f"client {i}: {kind}: {type(e).__name__}: {e}", file=sys.stderr)
                counts[kind][str(status)] = counts[kind].get(str(status), 0) + 1
                bad[kind] += not ok

    async def sampler() -> None:
        while time.monotonic() < end:
            rss.append(((time.monotonic() - t0) / 60, rss_mib(pid)))
            done = sum(sum(c.values()) for c in counts.values())
            print(f"{rss[-1][0]:5.1f} min: {done} requests, RSS {rss[-1][1]:.0f} MiB", file=sys.stderr, flush=True)
            await asyncio.sleep(args.sample_s)

    await asyncio.gather(sampler(), *(client(i) for i in range(args.clients)))
    await asyncio.sleep(2)  # the last aborted streams are noticed
    rss.append(((time.monotonic() - t0) / 60, rss_mib(pid)))
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as r:
        metrics = await r.text()
    gauges = {name: float(v) for line in metrics.splitlines() if not line.startswith("#")
              for name, v in [line.rsplit(" ", 1)] if name.endswith(("kv_blocks_total", "kv_blocks_free",
                                                                     "kv_blocks_cached"))}
    total = next(v for k, v in gauges.items() if k.endswith("kv_blocks_total"))
    free = next(v for k, v in gauges.items() if k.endswith("kv_blocks_free"))
    cached = next(v for k, v in gauges.items() if k.endswith("kv_blocks_cached"))
    after = [p for p in rss if p[0] >= args.warmup_min]
    first, last = (after[0][1], after[-1][1]) if after else (rss[0][1], rss[-1][1])
    fivexx = sum(n for c in counts.values() for s, n in c.items() if s.startswith("5"))
    return {
        "minutes": args.minutes, "clients": args.clients,
        "requests": sum(sum(c.values()) for c in counts.values()), "by_kind": counts, "unexpected_answers": bad,
        "status_5xx": fivexx, "connection_errors": sum(c.get("0", 0) for c in counts.values()),
        "rss_mib": {"start": rss[0][1], "after_warmup": first, "end": last, "growth": last / first - 1,
                    "slope_mib_per_min": slope(after), "samples": [[round(m, 2), round(v, 1)] for m, v in rss]},
        "kv_blocks": {"total": total, "free": free, "cached": cached, "all_back": free + cached == total},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--warmup-min", type=float, default=2.0)
    ap.add_argument("--sample-s", type=float, default=15.0)
    ap.add_argument("--max-rss-growth", type=float, default=0.05, help="allowed RSS growth after the warm-up")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--serve-args", default="--speculative-algorithm SUFFIX",
                    help="appended to `specserve serve` (e.g. '--enforce-eager')")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    log = (args.out.with_suffix(".server.log") if args.out else Path("soak.server.log"))
    log.parent.mkdir(parents=True, exist_ok=True)
    extra = [*SERVE_ARGS, *args.serve_args.split()]
    proc, url = start_server(args.model, extra, log, 1800)
    try:
        result = asyncio.run(soak(url, proc.pid, args))
    finally:
        stop_server(proc)
    result |= {"model": args.model, "serve_args": extra, "command": " ".join(sys.argv),
               "server_exit_code": proc.returncode}
    if proc.returncode not in (0, None):
        result["server_log_tail"] = log_tail(log)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    ok = (result["status_5xx"] == 0 and result["rss_mib"]["growth"] < args.max_rss_growth
          and result["unexpected_answers"]["json_object"] == 0 and result["unexpected_answers"]["json_schema"] == 0
          and result["unexpected_answers"]["tool_required"] == 0 and result["kv_blocks"]["all_back"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""A bounded load test: a real server subprocess on the tiny model under many concurrent, mixed clients.

Round one (plain decoding, continuous batching): 64 concurrent async clients send 500 requests — about
half streamed, /v1/completions and /v1/chat/completions mixed, 4..24 tokens each, some sampled with a
seed, and one in ten a stream that the client closes after a chunk or two. Nothing may fail: every
answer is 200 (no 5xx, no 503: the queue is large enough), every request that ran to its end has the
OpenAI shape and respects max_tokens, every request finishes exactly once in the engine's counters,
and afterwards the server is idle again: nothing running or queued, every KV block back in the pool
(or held by the prefix cache, which gives them back on demand), the server's memory near its level
after a warm-up. Round two does the same, smaller, with NGRAM speculation and adaptive widths.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from server_util import ServerProcess, running_server
from specserve.bench.server_probe import parse_prometheus
from specserve.engine.pass_log import read_pass_log

CLIENTS = 64
REQUESTS = 500
# A stream the client closes asks for far more than it reads: 400 tokens, i.e. 400 sequential decode steps of
# a loaded server (plain decoding), while the client closes after one or two events or DISCONNECT_AFTER_S,
# whichever comes first (a stream can stay silent for a while: tokens that decode to no text, e.g. the
# end-of-text token under ignore_eos, send nothing). So a closed stream's request is still running when it goes.
DISCONNECT_TOKENS = 400
DISCONNECT_AFTER_S = 0.1
PREFIX = "# utilities shared by the service\nimport os\nimport sys\n\n"  # shared: the prefix cache gets hits
PROMPTS = ["def fizzbuzz(n):", "class Stack:\n    def push(self, x):", "for i in range(10):", "import json\n",
           "def parse(text: str) -> dict:", "while True:\n    line = f.readline()", "return sorted(items, key="]
FINISHED = 'specserve_requests_finished_total{{finish_reason="{}"}}'


@dataclass(frozen=True)
class Plan:
    """One client request."""

    chat: bool
    stream: bool
    disconnect_after: int  # events read before closing the stream; 0 = read to the end
    max_tokens: int
    body: dict[str, Any]


@dataclass(frozen=True)
class Outcome:
    plan: Plan
    status: int
    closed_early: bool  # we closed the stream before its end
    finish_reason: str | None  # None: not seen (closed early, or a malformed answer)
    completion_tokens: int | None
    problems: tuple[str, ...]  # shape violations found in the answer


def make_plans(n: int, seed: int, quiet_tail: int = 0) -> list[Plan]:
    """`n` requests; every tenth a stream closed early, none among the last `quiet_tail` (sent as the load ebbs)."""
    rng = random.Random(seed)
    plans = []
    for i in range(n):
        chat = rng.random() < 0.5
        disconnect = i % 10 == 3 and i < n - quiet_tail
        stream = disconnect or rng.random() < 0.45  # about half streamed in all
        max_tokens = DISCONNECT_TOKENS if disconnect else rng.randint(4, 24)
        prompt = (PREFIX if rng.random() < 0.5 else "") + rng.choice(PROMPTS)
        body: dict[str, Any] = {"max_tokens": max_tokens, "stream": stream}
        body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
        if stream:
            body["stream_options"] = {"include_usage": True}
        if disconnect:
            body["ignore_eos"] = True
        if rng.random() < 0.3:
            body.update(temperature=0.9, top_p=0.95, seed=rng.randint(0, 10_000))
        else:
            body["temperature"] = 0
        plans.append(Plan(chat, stream, rng.choice((1, 2)) if disconnect else 0, max_tokens, body))
    return plans


def check_final(plan: Plan, reason: Any, tokens: Any) -> list[str]:
    problems = []
    if reason not in ("stop", "length"):
        problems.append(f"finish_reason {reason!r}")
    if not isinstance(tokens, int) or not 0 <= tokens <= plan.max_tokens:
        problems.append(f"completion_tokens {tokens!r} for max_tokens {plan.max_tokens}")
    elif reason == "length" and tokens != plan.max_tokens:
        problems.append(f"finish_reason length after {tokens} of {plan.max_tokens} tokens")
    return problems


async def send(client: httpx.AsyncClient, plan: Plan) -> Outcome:
    path = "/v1/chat/completions" if plan.chat else "/v1/completions"
    if not plan.stream:
        r = await client.post(path, json=plan.body)
        if r.status_code != 200:
            return Outcome(plan, r.status_code, False, None, None, (r.text[:200],))
        data = r.json()
        [choice] = data["choices"]
        problems = check_final(plan, choice["finish_reason"], data["usage"]["completion_tokens"])
        text = choice["message"]["content"] if plan.chat else choice["text"]
        if not isinstance(text, str):
            problems.append(f"text {text!r}")
        return Outcome(plan, 200, False, choice["finish_reason"], data["usage"]["completion_tokens"], tuple(problems))
    events: list[dict[str, Any]] = []
    done = False

    async def read(r: httpx.Response) -> None:
        nonlocal done
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                return
            events.append(json.loads(line.removeprefix("data: ")))
            if plan.disconnect_after and len(events) >= plan.disconnect_after:
                return

    async with client.stream("POST", path, json=plan.body) as r:
        if r.status_code != 200:
            return Outcome(plan, r.status_code, False, None, None, ((await r.aread()).decode()[:200],))
        if plan.disconnect_after:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(read(r), DISCONNECT_AFTER_S)
        else:
            await read(r)
    # (leaving the block before the end of the stream closed the connection)
    reasons = [c["finish_reason"] for e in events for c in e.get("choices", []) if c.get("finish_reason")]
    if plan.disconnect_after and not done:
        return Outcome(plan, 200, True, reasons[0] if reasons else None, None, ())
    problems = [f"error event {e['error']}" for e in events if "error" in e]
    usage = events[-1].get("usage") if events else None
    if not done or len(reasons) != 1 or not usage or events[-1]["choices"] != []:
        problems.append(f"stream shape: done={done}, finish reasons {reasons}, last event {events[-1:]}")
        return Outcome(plan, 200, False, None, None, tuple(problems))
    problems += check_final(plan, reasons[0], usage["completion_tokens"])
    return Outcome(plan, 200, False, reasons[0], usage["completion_tokens"], tuple(problems))


async def load(url: str, plans: list[Plan], clients: int) -> list[Outcome]:
    """`clients` workers, each sending the next unsent plan as soon as its previous request ended."""
    todo = list(reversed(plans))
    outcomes: list[Outcome] = []
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

        async def worker() -> None:
            while todo:
                outcomes.append(await send(client, todo.pop()))

        await asyncio.gather(*(worker() for _ in range(clients)))
    return outcomes


def scrape(url: str) -> dict[str, float]:
    return parse_prometheus(httpx.get(url + "/metrics", timeout=10).text)


def idle(m: dict[str, float]) -> bool:
    # Blocks the prefix cache holds are not in the free list, but the cache gives them back whenever the
    # pool runs short: at rest, free + cached is the whole pool, or a block leaked.
    return (m["specserve_num_running_reqs"] == 0 and m["specserve_num_queue_reqs"] == 0
            and m["specserve_kv_blocks_free"] + m["specserve_kv_blocks_cached"] == m["specserve_kv_blocks_total"])


def wait_idle(url: str, timeout_s: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    m = scrape(url)
    while not idle(m) and time.monotonic() < deadline:
        time.sleep(0.2)
        m = scrape(url)
    return m


def rss_bytes(pid: int) -> int:
    try:
        import psutil
    except ImportError:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"no VmRSS in /proc/{pid}/status") from None
    return int(psutil.Process(pid).memory_info().rss)


def finished(m: dict[str, float], reason: str) -> float:
    return m.get(FINISHED.format(reason), 0.0)


def run_round(srv: ServerProcess, plans: list[Plan], clients: int,
              every_close_aborts: bool) -> tuple[list[Outcome], dict[str, float]]:
    """Send `plans`, check every answer, wait for the server to be idle; the outcomes and the final metrics.

    `every_close_aborts`: each stream closed before its finish was seen must have aborted its request (true
    when the request cannot finish first: plain decoding under load, see DISCONNECT_TOKENS)."""
    before = scrape(srv.url)
    outcomes = asyncio.run(load(srv.url, plans, clients))
    assert len(outcomes) == len(plans)
    bad = [(o.status, o.problems, o.plan.body) for o in outcomes if o.status != 200 or o.problems]
    assert not bad, f"{len(bad)} bad answers, e.g. {bad[:3]}\n{srv.log_tail()}"
    assert all(o.finish_reason in ("stop", "length") for o in outcomes if not o.closed_early)
    after = wait_idle(srv.url)
    assert idle(after), {k: v for k, v in after.items() if "kv_blocks" in k or "_reqs" in k}
    delta = {r: finished(after, r) - finished(before, r) for r in ("stop", "length", "abort", "error")}
    # every request ended exactly once; only closed streams abort (unless their request had finished first)
    assert sum(delta.values()) == len(plans) and delta["error"] == 0, delta
    closed = [o for o in outcomes if o.closed_early]
    assert len(closed) == sum(1 for p in plans if p.disconnect_after) > 0
    unfinished = sum(1 for o in closed if o.finish_reason is None)
    assert 0 < delta["abort"] <= len(closed), delta
    if every_close_aborts:
        assert delta["abort"] >= unfinished, (delta, unfinished)
    errors = {k: v for k, v in after.items() if k.startswith("specserve_http_requests_total") and 'status="5' in k}
    assert not errors, errors
    return outcomes, after


@contextlib.contextmanager
def one_thread_server(args: list[str], log: Path) -> Iterator[ServerProcess]:
    """The server with one torch thread: two threads on two busy cores stall each other for 100+ ms a forward."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")  # read by the subprocess's torch; this process has imported torch already
        with running_server(args, log) as srv:
            yield srv


@pytest.fixture(scope="module")
def loaded_server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    d = tmp_path_factory.mktemp("load")
    args = ["--model", str(tiny_dir), "--device", "cpu", "--served-model-name", "tiny", "--max-num-seqs", "32",
            "--max-queue", "512", "--num-kv-blocks", "384", "--kv-block-size", "16"]
    with one_thread_server(args, d / "log") as srv:
        yield srv


def test_mixed_load_leaves_no_5xx_no_leaked_blocks_and_flat_memory(loaded_server: ServerProcess) -> None:
    srv = loaded_server
    # warm-up: every code path once, the allocator primed
    run_round(srv, make_plans(CLIENTS, seed=1), CLIENTS, every_close_aborts=False)
    rss_warm = rss_bytes(srv.proc.pid)
    outcomes, m = run_round(srv, make_plans(REQUESTS, seed=0, quiet_tail=CLIENTS), CLIENTS, every_close_aborts=True)
    streamed = sum(o.plan.stream for o in outcomes)
    chats = sum(o.plan.chat for o in outcomes)
    assert 0.35 * REQUESTS < streamed < 0.65 * REQUESTS and 0.35 * REQUESTS < chats < 0.65 * REQUESTS
    assert m["specserve_kv_blocks_cached"] > 0  # the shared prefix stayed cached
    rss_after = rss_bytes(srv.proc.pid)
    # memory back to its starting level: no per-request state kept (a small allowance for allocator noise)
    assert rss_after < 1.5 * rss_warm + 100 * 2**20, (rss_warm, rss_after)
    assert srv.proc.poll() is None


def test_ngram_adaptive_under_load(tiny_dir: Path, tmp_path: Path) -> None:
    args = ["--model", str(tiny_dir), "--device", "cpu", "--served-model-name", "tiny", "--max-num-seqs", "16",
            "--max-queue", "512", "--num-kv-blocks", "256", "--speculative-algorithm", "NGRAM",
            "--speculative-adaptive-profile", str(tmp_path / "profile.json"),  # adaptive is the default
            "--speculative-adaptive-trace", str(tmp_path / "trace.jsonl")]
    with one_thread_server(args, tmp_path / "log") as srv:
        assert httpx.get(srv.url + "/server_info").json()["speculative_adaptive"] is True
        # (a loop the n-gram drafter predicts can be accepted a dozen tokens a step: a closed stream may finish)
        _, m = run_round(srv, make_plans(200, seed=2), 32, every_close_aborts=False)
    widths = {k: v for k, v in m.items() if k.startswith("specserve_spec_adaptive_width_steps_total")}
    assert sum(widths.values()) > 0 and m["specserve_spec_accept_length_count"] > 0, widths
    # the trace holds a line per decode pass (steps of prefills alone have none): plain passes give a token each
    passes = read_pass_log(tmp_path / "trace.jsonl")
    assert 0 < sum(p["width"] > 0 for p in passes) <= m["specserve_spec_steps_total"]
    assert all(p["tokens"] == p["batch"] for p in passes if p["width"] == 0)
    assert all(0 < p["forward_s"] <= p["seconds"] for p in passes)
    prefills = read_pass_log(tmp_path / "trace.jsonl", kind="prefill")  # and a line per prefill pass
    assert 0 < sum(p["tokens"] for p in prefills) <= m["specserve_prompt_tokens_total"]

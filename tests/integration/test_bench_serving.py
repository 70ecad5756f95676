"""The serving benchmark client against a real stub server process whose timings are known.

Timing checks compare against the stub's configured sleeps: the lower bounds hold by construction
(a client cannot see a chunk before the stub sends it), the upper bounds leave tens of
milliseconds for a loaded 2-core machine.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from specserve.bench.cli import main
from specserve.bench.metrics import RequestResult
from specserve.bench.prompts import CODING_PROMPTS, Prompt
from specserve.bench.serving import run_level, run_sweep
from specserve.bench.serving_client import ServingConfig, client_session, send_request

SLACK_MS = 80.0  # scheduling noise allowed above a configured delay
LEVEL_KEYS = {"concurrency", "num_requests", "completed", "errors", "error_messages", "duration_s", "max_in_flight",
              "request_throughput", "input_throughput", "output_throughput", "total_throughput", "total_input_tokens",
              "total_output_tokens", "token_counts", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "requests",
              "accept_length", "accept_length_source", "spec_step_fraction"}


def configure(url: str, **fields: Any) -> None:
    """New stub configuration (defaults for the fields not given) with zeroed counters."""
    httpx.post(f"{url}/stub/config", json=fields, timeout=10).raise_for_status()


def stub_stats(url: str) -> dict[str, Any]:
    return dict(httpx.get(f"{url}/stub/stats", timeout=10).json())


def prompts(n: int) -> list[Prompt]:
    return [Prompt(text=CODING_PROMPTS[i % len(CODING_PROMPTS)]) for i in range(n)]


def level(cfg: ServingConfig, ps: Sequence[Prompt], concurrency: int) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        async with client_session(30.0, 8) as client:
            return await run_level(client, cfg, ps, concurrency, progress=False)

    return asyncio.run(go())


def one_request(cfg: ServingConfig) -> RequestResult:
    async def go() -> RequestResult:
        async with client_session(30.0, 8) as client:
            return await send_request(client, cfg, prompts(1)[0], cfg.output_len, ignore_eos=False)

    return asyncio.run(go())


def test_timings_match_the_stub(stub: str) -> None:
    configure(stub, ttft_ms=100, chunk_gap_ms=20, tokens_per_chunk=1)
    lv = level(ServingConfig(base_url=stub, model="m", output_len=6), prompts(3), concurrency=1)
    assert lv["completed"] == 3 and lv["errors"] == 0
    assert 98 <= lv["ttft_ms"]["p50"] <= 100 + SLACK_MS
    assert 0.7 * 20 <= lv["itl_ms"]["mean"] <= 20 + SLACK_MS / 5
    assert 0.7 * 20 <= lv["tpot_ms"]["p50"] <= 20 + SLACK_MS / 5
    assert lv["e2e_ms"]["p50"] >= 100 + 5 * 20 - 2
    assert lv["total_output_tokens"] == 18 and lv["total_input_tokens"] > 0
    for r in lv["requests"]:
        assert r["ttft_ms"] <= r["e2e_ms"]
        assert r["usage_tokens"] == r["streamed_tokens"] == r["output_tokens"] == 6


@pytest.mark.parametrize(("endpoint", "token_info", "continuous"), [
    ("completions", "logprobs", False), ("chat", "logprobs", False), ("completions", "usage", True),
])
def test_multi_token_chunks_divide_the_gap(stub: str, endpoint: str, token_info: str, continuous: bool) -> None:
    configure(stub, ttft_ms=40, chunk_gap_ms=30, tokens_per_chunk=3, token_info=token_info)
    cfg = ServingConfig(base_url=stub, model="m", endpoint=endpoint, output_len=9, continuous_usage=continuous)
    r = one_request(cfg)
    assert r.ok and r.timing is not None
    assert r.usage_tokens == r.streamed_tokens == 9
    itl = r.timing.itl_s  # 3 chunks of 3 tokens: the first chunk's tokens have none, the others a third of a gap
    assert len(itl) == 6
    assert itl[0] == itl[1] == itl[2] and itl[3] == itl[4] == itl[5]
    assert 0.7 * 10 / 1000 <= sum(itl) / 6 <= (10 + SLACK_MS / 3) / 1000
    assert r.timing.tpot_s == pytest.approx((r.timing.e2e_s - r.timing.ttft_s) / 8)
    assert r.timing.ttft_s >= 0.038


def test_without_token_info_counts_one_token_per_chunk_and_shows_the_mismatch(stub: str) -> None:
    configure(stub, ttft_ms=20, chunk_gap_ms=30, tokens_per_chunk=3, token_info="none")
    lv = level(ServingConfig(base_url=stub, model="m", output_len=9), prompts(2), concurrency=2)
    assert lv["total_output_tokens"] == 18  # usage wins for the output count
    assert lv["token_counts"] == {"requests_with_usage": 2, "usage_tokens": 18, "streamed_tokens": 6,
                                  "mismatched_requests": 2}
    assert lv["itl_ms"]["p50"] >= 30 * 0.7  # one entry per chunk gap, not divided


@pytest.mark.parametrize("concurrency", [1, 4])
def test_concurrency_is_bounded_exactly(stub: str, concurrency: int) -> None:
    configure(stub, ttft_ms=60, chunk_gap_ms=10, tokens_per_chunk=1)
    lv = level(ServingConfig(base_url=stub, model="m", output_len=8), prompts(3 * concurrency), concurrency)
    assert lv["completed"] == 3 * concurrency
    assert lv["max_in_flight"] == concurrency
    assert stub_stats(stub)["max_in_flight"] == concurrency


def test_server_errors_are_counted_and_the_level_finishes(stub: str) -> None:
    configure(stub, ttft_ms=10, chunk_gap_ms=5, fail_every=3)
    lv = level(ServingConfig(base_url=stub, model="m", output_len=4), prompts(6), concurrency=2)
    assert (lv["completed"], lv["errors"]) == (4, 2)
    assert len(lv["error_messages"]) == 2  # distinct: each names its request
    assert all(m.startswith("HTTP 500: ") and "stub failure" in m for m in lv["error_messages"])
    assert lv["total_output_tokens"] == 16
    assert sum(1 for r in lv["requests"] if not r["ok"]) == 2


def test_unreachable_url_is_reported_not_raised(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "run.json"
    rc = main(["serving", "--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--concurrency", "1,2",
               "--num-prompts", "3", "--no-progress", "--out", str(out)])
    assert rc == 1
    run = json.loads(out.read_text())
    assert [(lv["completed"], lv["errors"]) for lv in run["levels"]] == [(0, 3), (0, 3)]
    assert run["levels"][0]["error_messages"][0].startswith("ClientConnectorError")
    assert run["warmup"]["ok"] is False and run["server"]["source"] is None
    assert all(lv["ttft_ms"] is None and lv["accept_length"] is None for lv in run["levels"])
    err = capsys.readouterr().err
    assert "no request succeeded at concurrency 1, 2" in err and "Traceback" not in err


def test_cli_run_json_has_every_field_consistent(stub: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    configure(stub, ttft_ms=20, chunk_gap_ms=5, tokens_per_chunk=2, token_info="logprobs", accept_length=2.5)
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "def add(a, b):"}\n{broken\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    out = tmp_path / "run.json"
    argv = ["serving", "--base-url", f"{stub}/v1", "--model", "m", "--concurrency", "1,2", "--num-prompts", "4",
            "--dataset", str(data), "--output-len", "5", "--seed", "3", "--ignore-eos", "--no-progress",
            "--out", str(out)]
    assert main(argv) == 0
    run = json.loads(out.read_text())
    assert run["kind"] == "serving" and run["schema_version"] == 1
    assert run["command_line"] == ["specserve", "bench", *argv]
    assert run["started_at"] <= run["finished_at"]
    assert run["config"]["concurrency"] == [1, 2] and run["config"]["seed"] == 3
    assert run["server"]["source"] == "server_info"
    assert run["server"]["info"]["internal_states"][0]["avg_spec_accept_length"] == 2.5
    assert run["dataset"]["skipped_lines"] == 1 and run["dataset"]["errors"][0].startswith(f"{data}:2: invalid JSON")
    assert run["warmup"] == {"ok": True, "error": None, "ignore_eos_applied": True, "note": None}
    for lv in run["levels"]:
        assert set(lv) == LEVEL_KEYS
        assert (lv["num_requests"], lv["completed"], lv["errors"]) == (4, 4, 0)
        assert lv["accept_length"] == 2.5
        assert lv["accept_length_source"] == "server_info:spec_cumulative_num_accept_tokens"
        assert lv["token_counts"]["usage_tokens"] == lv["token_counts"]["streamed_tokens"] == 20
        assert lv["ttft_ms"]["p50"] <= lv["e2e_ms"]["p50"]
        for stats in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert set(lv[stats]) == {"mean", "p50", "p90", "p99"}
        for r in lv["requests"]:
            assert r["ttft_ms"] <= r["e2e_ms"] and r["output_tokens"] == r["streamed_tokens"] == 5
    body = stub_stats(stub)["last_body"]
    assert body["ignore_eos"] is True and body["seed"] == 3 and body["max_tokens"] == 5
    assert body["stream_options"] == {"include_usage": True}
    assert "skipped dataset line" in capsys.readouterr().err


def test_ignore_eos_is_dropped_when_the_server_rejects_it(stub: str) -> None:
    configure(stub, ttft_ms=5, chunk_gap_ms=5, reject_ignore_eos=True)
    cfg = ServingConfig(base_url=stub, model="m", output_len=3, ignore_eos=True)
    result = asyncio.run(run_sweep(cfg, prompts(2), [1], progress=False))
    assert result["warmup"]["ignore_eos_applied"] is False and "rejected ignore_eos" in result["warmup"]["note"]
    assert result["levels"][0]["completed"] == 2
    assert "ignore_eos" not in stub_stats(stub)["last_body"]


def test_accept_length_falls_back_to_prometheus_metrics(stub: str) -> None:
    configure(stub, ttft_ms=5, chunk_gap_ms=5, server_info=False, metrics=True, accept_length=3.25)
    result = asyncio.run(run_sweep(ServingConfig(base_url=stub, model="m", output_len=3), prompts(2), [1, 2],
                                   progress=False))
    assert result["server"]["source"] == "v1/models"
    for lv in result["levels"]:
        assert lv["accept_length"] == pytest.approx(3.25)
        assert lv["accept_length_source"] == "metrics:specserve_spec_accept_length_sum"
    configure(stub, ttft_ms=5, chunk_gap_ms=5, server_info=False, metrics=False)
    result = asyncio.run(run_sweep(ServingConfig(base_url=stub, model="m", output_len=3), prompts(1), [1],
                                   warmup=False, progress=False))
    assert result["levels"][0]["accept_length"] is None and result["levels"][0]["accept_length_source"] is None

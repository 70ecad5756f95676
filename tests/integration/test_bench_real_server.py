"""`specserve bench serving` against real `specserve serve` processes (tiny model): plain and NGRAM.

Every field of the run JSON is checked for presence and for consistency with the others, with the
request (ignore_eos: exactly --output-len tokens), with the tokenizer (prompt tokens) and, for the
accept length, with the same prompts decoded offline by the same NGRAM configuration.
The plain server reports no speculation: `avg_spec_accept_length` null in /server_info and no
accept metric in /metrics, so every level's accept length and its source are null.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from server_util import ServerProcess, start_server
from specserve.bench.datasets import load_dataset, sample_prompts
from specserve.cli import main
from specserve.config import SpeculativeConfig
from specserve.engine.llm import LLM
from specserve.types import SamplingParams

NUM_PROMPTS, OUTPUT_LEN, CONCURRENCY, SEED = 4, 8, (1, 2), 0
NGRAM_FLAGS = ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4",
               "--no-speculative-adaptive"]  # every step verifies: the accept length is comparable offline
LEVEL_KEYS = {"concurrency", "num_requests", "completed", "errors", "error_messages", "duration_s", "max_in_flight",
              "request_throughput", "input_throughput", "output_throughput", "total_throughput", "total_input_tokens",
              "total_output_tokens", "token_counts", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "requests",
              "accept_length", "accept_length_source", "spec_step_fraction"}
REQUEST_KEYS = {"ok", "error", "prompt_tokens", "output_tokens", "usage_tokens", "streamed_tokens", "ttft_ms",
                "tpot_ms", "e2e_ms"}


@pytest.fixture(scope="module")
def servers(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    logs = tmp_path_factory.mktemp("server-logs")
    started: dict[str, ServerProcess] = {}
    try:
        for name, flags in (("plain", []), ("ngram", NGRAM_FLAGS)):
            started[name] = start_server(["--model", str(tiny_dir), "--device", "cpu", *flags], logs / f"{name}.log")
        yield started
    finally:
        for srv in started.values():
            srv.stop()


def sweep(url: str, model: str, out: Path, *extra: str, concurrency: str = "1,2", prompts: int = NUM_PROMPTS) -> Any:
    argv = ["bench", "serving", "--base-url", url, "--model", model, "--concurrency", concurrency, "--num-prompts",
            str(prompts), "--dataset", "coding", "--output-len", str(OUTPUT_LEN), "--seed", str(SEED),
            "--ignore-eos", "--no-progress", "--out", str(out), *extra]
    assert main(argv) == 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(servers: dict[str, ServerProcess], tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    out = tmp_path_factory.mktemp("runs")
    return {name: sweep(srv.url, str(tiny_dir), out / f"{name}.json", "--continuous-usage")
            for name, srv in servers.items()}


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)


def check_stats(stats: Any) -> None:
    assert set(stats) == {"mean", "p50", "p90", "p99"}
    assert 0 <= stats["p50"] <= stats["p90"] <= stats["p99"]


def check_run(run: Any, model: str, algorithm: str) -> None:
    """Everything but the accept length, which depends on the server."""
    assert run["kind"] == "serving" and run["schema_version"] == 1
    assert isinstance(run["command_line"], list) and run["started_at"] <= run["finished_at"]
    cfg = run["config"]
    assert (cfg["model"], cfg["concurrency"], cfg["num_prompts"], cfg["output_len"]) == (
        model, list(CONCURRENCY), NUM_PROMPTS, OUTPUT_LEN)
    assert cfg["temperature"] == 0.0 and cfg["seed"] == SEED and cfg["ignore_eos"] and cfg["continuous_usage"]
    assert run["dataset"]["name"] == "coding" and run["dataset"]["skipped_lines"] == 0
    info = run["server"]["info"]
    assert run["server"]["source"] == "server_info" and info["served_model_name"] == model
    assert info["speculative"]["algorithm"] == algorithm
    assert run["warmup"] == {"ok": True, "error": None, "ignore_eos_applied": True, "note": None}
    assert [lv["concurrency"] for lv in run["levels"]] == list(CONCURRENCY)
    prompt_tokens = []
    for lv in run["levels"]:
        assert set(lv) == LEVEL_KEYS
        assert (lv["num_requests"], lv["completed"], lv["errors"], lv["error_messages"]) == (NUM_PROMPTS, 4, 0, [])
        assert lv["max_in_flight"] == lv["concurrency"]
        # the fixed-width NGRAM server speculates in every step that decodes (not in prefill-only steps); the plain
        # server exports no speculative counters
        share = lv["spec_step_fraction"]
        assert share is None if algorithm == "NONE" else 0.5 < share <= 1.0
        d = lv["duration_s"]
        assert d > 0 and len(lv["requests"]) == NUM_PROMPTS
        assert lv["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
        assert lv["total_input_tokens"] == sum(r["prompt_tokens"] for r in lv["requests"])
        assert close(lv["request_throughput"], NUM_PROMPTS / d)
        assert close(lv["output_throughput"], lv["total_output_tokens"] / d)
        assert close(lv["input_throughput"], lv["total_input_tokens"] / d)
        assert close(lv["total_throughput"], (lv["total_input_tokens"] + lv["total_output_tokens"]) / d)
        # tokens counted from the stream (per-chunk usage deltas) equal the usage the server reports at the end
        assert lv["token_counts"] == {"requests_with_usage": NUM_PROMPTS, "usage_tokens": NUM_PROMPTS * OUTPUT_LEN,
                                      "streamed_tokens": NUM_PROMPTS * OUTPUT_LEN, "mismatched_requests": 0}
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            check_stats(lv[key])
        reqs = lv["requests"]
        for r in reqs:
            assert set(r) == REQUEST_KEYS and r["ok"] and r["error"] is None and r["prompt_tokens"] > 0
            assert r["output_tokens"] == r["usage_tokens"] == r["streamed_tokens"] == OUTPUT_LEN
            assert 0 < r["ttft_ms"] <= r["e2e_ms"]
            assert close(r["tpot_ms"], (r["e2e_ms"] - r["ttft_ms"]) / (OUTPUT_LEN - 1))
            assert r["e2e_ms"] <= d * 1000.0
        for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
            values = [r[key] for r in reqs]
            assert close(lv[key]["mean"], sum(values) / len(values))
            assert min(values) <= lv[key]["p50"] <= lv[key]["p99"] <= max(values)
        assert lv["ttft_ms"]["p99"] <= lv["e2e_ms"]["p99"]
        prompt_tokens.append(sorted(r["prompt_tokens"] for r in reqs))
    assert prompt_tokens[0] == prompt_tokens[1]  # every level sends the same prompts


def offline(tiny_dir: Path, spec: SpeculativeConfig) -> tuple[list[int], float]:
    """Prompt token counts of the sweep's prompts and their accept length, decoded in this process."""
    llm = LLM(str(tiny_dir), device="cpu", speculative=spec)
    prompts = sample_prompts(load_dataset("coding", NUM_PROMPTS, SEED), NUM_PROMPTS, SEED)
    ids = [llm.encode(p.as_text()) for p in prompts]
    params = SamplingParams(max_new_tokens=OUTPUT_LEN, ignore_eos=True)
    steps = [n for x in ids for n in llm.generate([x], params)[0].accept_lengths] if spec.enabled else [1]
    return sorted(len(x) for x in ids), sum(steps) / len(steps)


def test_plain_server_run_is_complete_and_consistent(runs: Any, tiny_dir: Path) -> None:
    run = runs["plain"]
    check_run(run, str(tiny_dir), "NONE")
    assert run["server"]["info"]["avg_spec_accept_length"] is None
    prompt_tokens, _ = offline(tiny_dir, SpeculativeConfig())
    for lv in run["levels"]:
        assert lv["accept_length"] is None and lv["accept_length_source"] is None
        assert sorted(r["prompt_tokens"] for r in lv["requests"]) == prompt_tokens


def test_ngram_server_reports_each_levels_own_accept_length(runs: Any, tiny_dir: Path) -> None:
    run = runs["ngram"]
    check_run(run, str(tiny_dir), "NGRAM")
    assert run["server"]["info"]["speculative"]["num_draft_tokens"] == 4
    spec = SpeculativeConfig.resolve("NGRAM", num_draft_tokens=4)
    prompt_tokens, expected = offline(tiny_dir, spec)
    for lv in run["levels"]:
        assert lv["accept_length_source"] == "server_info:spec_cumulative_num_accept_tokens"
        # the level's own delta (not the server's running average, which includes the warm-up request)
        assert lv["accept_length"] == pytest.approx(expected, rel=1e-9)
        assert 1.0 <= lv["accept_length"] <= spec.num_draft_tokens
        assert sorted(r["prompt_tokens"] for r in lv["requests"]) == prompt_tokens
    assert [lv["total_input_tokens"] for lv in run["levels"]] == [
        lv["total_input_tokens"] for lv in runs["plain"]["levels"]]


def test_without_per_chunk_usage_chunks_are_retokenized_or_the_gap_reported(servers: dict[str, ServerProcess],
                                                                            tiny_dir: Path, tmp_path: Path) -> None:
    """NGRAM streams several tokens in a chunk. Without per-chunk usage the client re-tokenizes each chunk's text
    with the served model's tokenizer (found through /server_info), as SGLang's bench_serving counts; with
    `--tokenizer none` it counts one token a chunk, sees fewer, and says so."""
    retok = sweep(servers["ngram"].url, str(tiny_dir), tmp_path / "retok.json", concurrency="1", prompts=2)
    [lv] = retok["levels"]
    streamed, usage = lv["token_counts"]["streamed_tokens"], lv["token_counts"]["usage_tokens"]
    # re-tokenized text: near the generated count (a random tiny model's text re-tokenizes into other pieces)
    assert usage == 2 * OUTPUT_LEN and 0.5 * usage <= streamed <= 2 * usage
    run = sweep(servers["ngram"].url, str(tiny_dir), tmp_path / "run.json", "--tokenizer", "none", concurrency="1",
                prompts=2)
    assert run["levels"][0]["token_counts"]["streamed_tokens"] < streamed  # several tokens a chunk, counted once
    [lv] = run["levels"]
    reqs = lv["requests"]
    assert all(r["usage_tokens"] == r["output_tokens"] == OUTPUT_LEN for r in reqs)
    assert all(1 <= r["streamed_tokens"] <= r["usage_tokens"] for r in reqs)
    counts = lv["token_counts"]
    assert counts["usage_tokens"] == 2 * OUTPUT_LEN == lv["total_output_tokens"]
    assert counts["streamed_tokens"] == sum(r["streamed_tokens"] for r in reqs)
    assert counts["mismatched_requests"] == sum(r["streamed_tokens"] != r["usage_tokens"] for r in reqs)

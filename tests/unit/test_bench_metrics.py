"""Pure parts of the serving benchmark: timing maths, aggregation, stream parsing, server probing."""

from __future__ import annotations

from pathlib import Path

import pytest

from specserve.bench.metrics import Chunk, RequestResult, aggregate_level, request_timing, summarize_ms
from specserve.bench.prompts import Prompt
from specserve.bench.server_probe import (
    ServerSnapshot,
    accept_length,
    accept_length_from_metrics,
    find_numbers,
    parse_prometheus,
    spec_step_fraction,
)
from specserve.bench.serving_client import ServingConfig, StreamReader, build_body, normalize_base_url


def test_request_timing_divides_each_chunk_gap_by_its_tokens() -> None:
    chunks = [Chunk(0.100, 1), Chunk(0.130, 3), Chunk(0.190, 2)]
    t = request_timing(chunks, e2e_s=0.200, output_tokens=6)
    assert t.ttft_s == pytest.approx(0.100)
    assert t.itl_s == pytest.approx([0.010] * 3 + [0.030] * 2)
    assert t.tpot_s == pytest.approx((0.200 - 0.100) / 5)
    assert t.e2e_s == pytest.approx(0.200)


def test_request_timing_first_chunk_tokens_get_no_itl_and_one_token_has_no_tpot() -> None:
    t = request_timing([Chunk(0.05, 4)], e2e_s=0.06, output_tokens=4)
    assert t.itl_s == ()
    assert t.tpot_s == pytest.approx(0.01 / 3)
    assert request_timing([Chunk(0.05, 1)], e2e_s=0.05, output_tokens=1).tpot_s is None


def test_request_timing_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="at least one content chunk"):
        request_timing([], e2e_s=1.0, output_tokens=1)
    with pytest.raises(ValueError, match="earlier than the last chunk"):
        request_timing([Chunk(0.5, 1)], e2e_s=0.4, output_tokens=1)
    with pytest.raises(ValueError, match="tokens must be >= 1"):
        Chunk(0.1, 0)


def test_summarize_ms_uses_linear_percentiles_in_milliseconds() -> None:
    s = summarize_ms([i / 1000 for i in range(1, 101)])  # 1 .. 100 ms
    assert s is not None
    assert s["mean"] == pytest.approx(50.5)
    assert s["p50"] == pytest.approx(50.5)
    assert s["p90"] == pytest.approx(90.1)
    assert s["p99"] == pytest.approx(99.01)
    assert summarize_ms([]) is None


def _ok(ttft: float, e2e: float, usage: int | None, streamed: int, prompt: int = 10) -> RequestResult:
    chunks = [Chunk(ttft, 1)] + [Chunk(ttft + (e2e - ttft) * (i + 1) / (streamed - 1), 1) for i in range(streamed - 1)]
    timing = request_timing(chunks, e2e, usage if usage is not None else streamed)
    return RequestResult(error=None, prompt_tokens=prompt, usage_tokens=usage, streamed_tokens=streamed, timing=timing)


def _failed(message: str) -> RequestResult:
    return RequestResult(error=message, prompt_tokens=None, usage_tokens=None, streamed_tokens=0, timing=None)


def test_request_result_needs_exactly_one_of_error_and_timing() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        RequestResult(error=None, prompt_tokens=None, usage_tokens=None, streamed_tokens=0, timing=None)
    assert _ok(0.1, 0.3, usage=None, streamed=5).output_tokens == 5
    assert _ok(0.1, 0.3, usage=7, streamed=5).output_tokens == 7


def test_aggregate_level_counts_only_successes_and_keeps_distinct_errors() -> None:
    results = [_ok(0.1, 0.5, usage=5, streamed=5), _ok(0.3, 0.7, usage=8, streamed=4),
               _failed("HTTP 500: boom"), _failed("HTTP 500: boom"), _failed("ConnectError: refused")]
    level = aggregate_level(results, concurrency=2, duration_s=2.0, max_in_flight=2, max_messages=5)
    assert (level["num_requests"], level["completed"], level["errors"]) == (5, 2, 3)
    assert level["error_messages"] == ["HTTP 500: boom", "ConnectError: refused"]
    assert level["request_throughput"] == pytest.approx(1.0)
    assert level["output_throughput"] == pytest.approx((5 + 8) / 2.0)
    assert level["input_throughput"] == pytest.approx(20 / 2.0)
    assert level["total_throughput"] == pytest.approx(33 / 2.0)
    assert level["token_counts"] == {"requests_with_usage": 2, "usage_tokens": 13, "streamed_tokens": 9,
                                     "mismatched_requests": 1}
    assert level["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert level["e2e_ms"]["p50"] == pytest.approx(600.0)
    assert len(level["requests"]) == 5 and level["requests"][2]["error"] == "HTTP 500: boom"
    assert aggregate_level(results, 2, 0.0, 2)["request_throughput"] is None


def test_stream_reader_counts_tokens_from_usage_then_logprobs_then_one_per_chunk() -> None:
    r = StreamReader()
    r.feed({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, 0.01)  # role chunk: no content
    r.feed({"choices": [{"delta": {"content": "a"}, "logprobs": {"content": [{}, {}]}}]}, 0.10)
    r.feed({"choices": [{"text": "b"}]}, 0.12)
    r.feed({"choices": [{"text": "c", "logprobs": {"tokens": ["x", "y", "z"]}}]}, 0.15)
    r.feed({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 6}}, 0.16)
    assert [(c.t_s, c.tokens) for c in r.chunks] == [(0.10, 2), (0.12, 1), (0.15, 3)]
    assert (r.streamed_tokens, r.usage_tokens, r.prompt_tokens) == (6, 6, 9)

    cumulative = StreamReader()
    cumulative.feed({"choices": [{"text": "a"}], "usage": {"completion_tokens": 2}}, 0.1)
    cumulative.feed({"choices": [{"text": ""}], "usage": {"completion_tokens": 3}}, 0.2)  # no text: rolls over
    cumulative.feed({"choices": [{"text": "b"}], "usage": {"completion_tokens": 5}}, 0.3)
    assert [(c.t_s, c.tokens) for c in cumulative.chunks] == [(0.1, 2), (0.3, 3)]
    assert cumulative.streamed_tokens == cumulative.usage_tokens == 5

    final_usage_in_last_chunk = StreamReader()  # not continuous usage: the total must not land on one chunk
    final_usage_in_last_chunk.feed({"choices": [{"text": "a"}], "usage": None}, 0.1)
    final_usage_in_last_chunk.feed({"choices": [{"text": "b"}], "usage": {"completion_tokens": 2}}, 0.2)
    assert [c.tokens for c in final_usage_in_last_chunk.chunks] == [1, 1]
    assert final_usage_in_last_chunk.usage_tokens == 2


def test_stream_reader_retokenizes_chunks_without_token_info(tmp_path: Path) -> None:
    """Rule 3 (SGLang's bench_serving): a chunk's text re-tokenized when neither usage nor logprobs say."""
    from specserve.bench.serving_cli import chunk_counter

    count = chunk_counter("demo", "http://127.0.0.1:9", None)
    assert count is not None
    r = StreamReader(count_tokens=count)
    r.feed({"choices": [{"text": "def fizzbuzz(n):"}]}, 0.1)  # several tokens in one chunk (speculation)
    r.feed({"choices": [{"text": "x", "logprobs": {"tokens": ["x", "y"]}}]}, 0.2)  # logprobs still win
    assert [c.tokens for c in r.chunks] == [count("def fizzbuzz(n):"), 2] and r.chunks[0].tokens > 1
    assert chunk_counter(None, "http://127.0.0.1:9", None) is None  # no server to ask: one token a chunk
    with pytest.raises(ValueError, match="--tokenizer"):
        chunk_counter(str(tmp_path / "absent"), "http://127.0.0.1:9", None)


def test_stream_reader_raises_on_error_events_and_non_objects() -> None:
    with pytest.raises(ValueError, match="server error in stream"):
        StreamReader().feed({"error": {"message": "out of memory"}}, 0.1)
    with pytest.raises(ValueError, match="not a JSON object"):
        StreamReader().feed([1, 2], 0.1)


def test_build_body_for_both_endpoints() -> None:
    cfg = ServingConfig(base_url="http://127.0.0.1:1/v1/", model="m", endpoint="chat", output_len=7, seed=3,
                        continuous_usage=True)
    body = build_body(cfg, Prompt(text="hi"), 7, ignore_eos=True)
    assert body["messages"] == [{"role": "user", "content": "hi"}]
    assert body["stream"] is True and body["max_tokens"] == 7 and body["seed"] == 3 and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert cfg.url == "http://127.0.0.1:1/v1/chat/completions"
    plain = ServingConfig(base_url="http://127.0.0.1:1", model="m")
    body = build_body(plain, Prompt(messages=(("system", "be brief"), ("user", "hi"))), 4, ignore_eos=False)
    assert body["prompt"] == "system: be brief\nuser: hi"
    assert "seed" not in body and "ignore_eos" not in body
    assert body["stream_options"] == {"include_usage": True}
    assert normalize_base_url(" http://h:1/v1 ") == "http://h:1"


@pytest.mark.parametrize(("kwargs", "flag"), [
    ({"base_url": "127.0.0.1:8000"}, "--base-url"),
    ({"endpoint": "embeddings"}, "--endpoint"),
    ({"output_len": 0}, "--output-len"),
    ({"temperature": -1.0}, "--temperature"),
    ({"model": ""}, "--model"),
])
def test_serving_config_errors_name_the_flag(kwargs: dict[str, object], flag: str) -> None:
    args: dict[str, object] = {"base_url": "http://127.0.0.1:1", "model": "m", **kwargs}
    with pytest.raises(ValueError, match=flag):
        ServingConfig(**args)  # type: ignore[arg-type]


def test_find_numbers_searches_nested_json() -> None:
    info = {"a": 1, "internal_states": [{"avg_spec_accept_length": 2.0}, {"avg_spec_accept_length": 3}],
            "x": {"avg_spec_accept_length": None}}
    assert sorted(find_numbers(info, "avg_spec_accept_length")) == [2.0, 3.0]


def test_parse_prometheus_reads_labels_timestamps_and_skips_comments() -> None:
    text = ('# HELP x y\n# TYPE a counter\na_total 3\nb{model="m",le="1"} 2.5 1700000000\nc NaN\nbroken\n'
            'd{label="with space"} 7\n')
    samples = parse_prometheus(text)
    assert samples["a_total"] == 3.0
    assert samples['b{model="m",le="1"}'] == 2.5
    assert samples['d{label="with space"}'] == 7.0
    assert "broken" not in samples


def test_accept_length_from_metrics_sum_count_vllm_counters_and_gauge() -> None:
    before = parse_prometheus("x_accept_length_sum 10\nx_accept_length_count 5\n")
    after = parse_prometheus("x_accept_length_sum 40\nx_accept_length_count 15\n")
    assert accept_length_from_metrics(before, after) == (pytest.approx(3.0), "x_accept_length_sum")

    vllm_before = parse_prometheus(
        'vllm:spec_decode_num_drafts_total{m="a"} 10\nvllm:spec_decode_num_accepted_tokens_total{m="a"} 5\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 100\n')
    vllm_after = parse_prometheus(
        'vllm:spec_decode_num_drafts_total{m="a"} 30\nvllm:spec_decode_num_accepted_tokens_total{m="a"} 35\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 900\n')
    value, source = accept_length_from_metrics(vllm_before, vllm_after)
    assert value == pytest.approx(1.0 + 30 / 20) and source == "vllm:spec_decode_num_accepted_tokens_total"

    gauge = parse_prometheus('sglang:spec_accept_length{dp="0"} 2.0\nsglang:spec_accept_length{dp="1"} 4.0\n')
    assert accept_length_from_metrics({}, gauge) == (pytest.approx(3.0), "sglang:spec_accept_length")
    assert accept_length_from_metrics({}, parse_prometheus("requests_total 4\n")) == (None, None)


def test_accept_length_prefers_level_counters_then_server_average_then_metrics() -> None:
    before = ServerSnapshot(info_accept_length=2.0, info_counters=(100.0, 50.0), metrics=None)
    after = ServerSnapshot(info_accept_length=2.2, info_counters=(400.0, 100.0), metrics=None)
    assert accept_length(before, after) == (pytest.approx(6.0), "server_info:spec_cumulative_num_accept_tokens")
    idle = ServerSnapshot(info_accept_length=2.2, info_counters=(100.0, 50.0), metrics=None)
    assert accept_length(before, idle) == (2.2, "server_info:avg_spec_accept_length")
    scraped = ServerSnapshot(None, None, parse_prometheus("specserve_spec_accept_length 1.5\n"))
    assert accept_length(ServerSnapshot(None, None, {}), scraped) == (1.5, "metrics:specserve_spec_accept_length")
    assert accept_length(ServerSnapshot(None, None, None), ServerSnapshot(None, None, None)) == (None, None)


def test_spec_step_fraction_from_step_counters() -> None:
    before = {"specserve_engine_steps_total": 100.0, "specserve_spec_steps_total": 40.0}
    after = {"specserve_engine_steps_total": 300.0, "specserve_spec_steps_total": 90.0}
    assert spec_step_fraction(before, after) == 0.25  # 50 of the level's 200 steps speculated
    assert spec_step_fraction(before, before) is None  # no step in between
    assert spec_step_fraction(None, after) is None
    assert spec_step_fraction({}, {"vllm:num_drafts_total": 3.0}) is None  # another server: not reported

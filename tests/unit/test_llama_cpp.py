"""llama.cpp peer plumbing: the parsers read what the real tools print (captured from llama.cpp of the
llama-cpp-python 0.3.36 sdist), and failures surface as LlamaCppError naming the step."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from specserve.bench import llama_cpp
from specserve.bench.llama_cpp import LlamaCpp, LlamaCppError

BENCH_JSON = """[
  {
    "build_commit": "0c1e570", "n_threads": 2, "type_k": "f16", "n_prompt": 0, "n_gen": 128,
    "avg_ts": 599.724560, "stddev_ts": 449.342896,
    "samples_ns": [ 1582592001, 149514562, 148459190 ],
    "samples_ts": [ 80.88, 856.104, 862.19 ]
  }
]
"""

BATCHED_JSONL = """
main: n_kv_max = 4096
{"n_kv_max": 4096, "n_batch": 2048, "pp": 8, "tg": 128, "pl": 1, "n_kv": 136, "t_pp": 0.003743, "speed_pp": 2137.3, "t_tg": 0.149135, "speed_tg": 858.28, "t": 0.152878, "speed": 889.59}
{"n_kv_max": 4096, "n_batch": 2048, "pp": 8, "tg": 128, "pl": 16, "n_kv": 2176, "t_pp": 0.016677, "speed_pp": 7675.2, "t_tg": 0.811998, "speed_tg": 2522.17, "t": 0.828675, "speed": 2625.87}
"""  # noqa: E501

PERF = """0.00.074.226 I common_perf_print:    sampling time =       0.98 ms
0.00.074.248 I common_perf_print:        load time =      12.63 ms
0.00.074.262 I common_perf_print: prompt eval time =       3.55 ms /     8 tokens (    0.44 ms per token,  2254.16 tokens per second)
0.00.074.263 I common_perf_print:        eval time =      35.57 ms /    31 runs   (    1.15 ms per token,   871.47 tokens per second)
0.00.074.264 I common_perf_print:       total time =      41.85 ms /    39 tokens
"""  # noqa: E501

LOOKUP = """0.00.079.928 I encoded    8 tokens in    0.006 seconds, speed: 14318.955 t/s
0.00.079.939 I decoded   72 tokens in    0.041 seconds, speed: 1762.460 t/s
0.00.079.939 I n_draft      = 8
0.00.079.940 I n_predict    = 72
0.00.079.940 I n_drafted    = 64
0.00.079.941 I t_draft      = 0.13 ms, 1.98 us per token, 503937.01 tokens per second
0.00.079.942 I n_accept     = 52
0.00.079.942 I accept       = 81.250%
""" + PERF


def test_bench_json_gives_every_repetition() -> None:
    assert llama_cpp.parse_bench_json(BENCH_JSON) == [80.88, 856.104, 862.19]
    with pytest.raises(LlamaCppError, match="no test"):
        llama_cpp.parse_bench_json("[]")


def test_batched_bench_rows_by_parallel_sequences() -> None:
    rows = llama_cpp.parse_batched_jsonl(BATCHED_JSONL)
    assert set(rows) == {1, 16}
    assert rows[16] == {"t_pp": 0.016677, "t_tg": 0.811998, "tg": 128.0}
    with pytest.raises(LlamaCppError):
        llama_cpp.parse_batched_jsonl("main: nothing\n")


def test_perf_lines() -> None:
    perf = llama_cpp.parse_perf(PERF)
    assert perf["total"] == (41.85, 39)
    assert perf["prompt eval"] == (3.55, 8)
    assert perf["eval"] == (35.57, 31)
    with pytest.raises(LlamaCppError, match="no timing"):
        llama_cpp.parse_perf("load time = 3 ms")


def test_lookup_statistics_and_accept_length() -> None:
    s = llama_cpp.parse_speculation(LOOKUP)
    assert (s["n_predict"], s["n_drafted"], s["n_accept"]) == (72, 64, 52)
    assert (s["encode_s"], s["decode_s"]) == (0.006, 0.041)
    assert s["accept_length"] == pytest.approx(72 / 20)  # 20 target passes: each ends on a non-draft token
    with pytest.raises(LlamaCppError):
        llama_cpp.parse_speculation(PERF)


def test_token_ids_and_generated_texts() -> None:
    assert llama_cpp.parse_token_ids("[534, 892, 1864]\n") == [534, 892, 1864]
    with pytest.raises(LlamaCppError):
        llama_cpp.parse_token_ids("error: no model\n")
    assert llama_cpp.completion_text('\n    """\n    Return a list of the\n\n') == '\n    """\n    Return a list of the'
    out = '\n\ndef fizzbuzz(n):\n    """\n    Return a list\n\n\n\n'
    assert llama_cpp.lookup_text(out, "def fizzbuzz(n):") == '\n    """\n    Return a list\n\n\n\n'


def _tool(bin_dir: Path, name: str, script: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_tools_run_and_fail_loudly(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _tool(bin_dir, "llama-tokenize", 'for a; do [ "$a" = --no-escape ] && echo "[1, 2, $OMP_NUM_THREADS]"; done\n')
    _tool(bin_dir, "llama-bench", 'echo "model not found" >&2\nexit 3\n')
    llama = LlamaCpp(tmp_path, bin_dir)
    assert llama_cpp.tokenize(llama, tmp_path / "m.gguf", "x") == [1, 2, 1]  # the text verbatim (--no-escape)
    with pytest.raises(LlamaCppError, match="llama-bench exited 3: model not found"):
        llama.run("llama-bench", [], threads=2)
    with pytest.raises(LlamaCppError, match="llama-lookup is missing"):
        llama.run("llama-lookup", [], threads=1)


def test_build_reuses_a_complete_build_and_convert_checks_the_dtype(tmp_path: Path) -> None:
    bin_dir = tmp_path / "build" / "bin"
    bin_dir.mkdir(parents=True)
    for name in llama_cpp.TOOLS:
        _tool(bin_dir, name, "exit 0\n")
    llama = llama_cpp.build(tmp_path, progress=False)  # no cmake run: every tool is there
    assert llama == LlamaCpp(tmp_path, bin_dir)
    with pytest.raises(ValueError, match="--dtype 'int8'"):
        llama_cpp.convert(llama, tmp_path, "int8", tmp_path / "m.gguf")


def test_a_failing_conversion_names_the_converter(tmp_path: Path) -> None:
    llama = LlamaCpp(tmp_path, tmp_path)  # no convert_hf_to_gguf.py here
    with pytest.raises(LlamaCppError, match="convert_hf_to_gguf failed"):
        llama_cpp.convert(llama, tmp_path, "float32", tmp_path / "m.gguf")


def test_a_run_without_its_closing_statistics_is_tried_again(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    count = tmp_path / "count"
    _tool(bin_dir, "llama-completion", f'echo x >> {count}\n[ $(wc -l < {count}) -ge 2 ] && echo "total time" >&2\n'
                                       "exit 0\n")
    _tool(bin_dir, "llama-lookup", "exit 0\n")
    llama = LlamaCpp(tmp_path, bin_dir)
    _, err = llama.run("llama-completion", [], threads=1, done="total time")
    assert "total time" in err and count.read_text().count("x") == 2
    with pytest.raises(LlamaCppError, match="three times without 'n_accept'"):
        llama.run("llama-lookup", [], threads=1, done="n_accept")

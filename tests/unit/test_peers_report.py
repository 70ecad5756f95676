"""`bench peers` arithmetic: greedy agreement through text, merged batch-1 rows, the summary's ratios and the
report's table and plot; bad flags exit 2 naming the flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from specserve.bench.cli import main as bench_main
from specserve.bench.peers import (
    PeersConfig,
    Row,
    agreement,
    markdown,
    matrix,
    merge,
    plot,
    summarize,
    token_pieces,
)


def test_token_pieces_follow_the_decoded_text() -> None:
    vocab = {1: "def", 2: " f", 3: "(x", 4: "):"}

    def decode(ids: list[int]) -> str:
        return "".join(vocab[i] for i in ids)

    assert token_pieces(decode, [1, 2, 3, 4]) == ["def", " f", "(x", "):"]
    assert token_pieces(decode, []) == []


def test_agreement_counts_leading_reference_tokens() -> None:
    ref = ["\n", "    ", "return", " x"]
    assert agreement(ref, "\n    return x") == 4
    assert agreement(ref, "\n    return x\n\n") == 4  # a longer generation reproduces all of them
    assert agreement(ref, "\n    retur") == 2
    assert agreement(ref, "    return x") == 0


def _row(peer: str, tok_s: float, rnd: int, method: str = "plain", texts: list[str] | None = None,
         accept: float | None = None) -> Row:
    return Row(peer, method, 1, "float32", 2, rnd, tokens=100, seconds=100 / tok_s, accept_length=accept,
               texts=texts or [])


def test_merge_sums_prompts_and_weights_accept_length_by_tokens() -> None:
    a = Row("llama.cpp", "ngram", 1, "float32", 1, 0, tokens=30, seconds=1.0, accept_length=3.0, texts=["a"])
    b = Row("llama.cpp", "ngram", 1, "float32", 1, 0, tokens=10, seconds=1.0, accept_length=1.0, texts=["b"])
    m = merge([a, b])
    assert (m.tokens, m.seconds, m.texts) == (40, 2.0, ["a", "b"])
    assert m.accept_length == pytest.approx(2.5)


def test_summary_ratios_are_per_round_and_agreement_is_against_the_reference() -> None:
    ref = {(1, "float32"): [["x", "y"], ["p", "q"]]}
    rows = [_row("specserve", 100, 0, texts=["xy", "pq"]), _row("specserve", 200, 1, texts=["xy", "pq"]),
            _row("llama.cpp", 300, 0, texts=["xy", "pz"]), _row("llama.cpp", 400, 1, texts=["xy", "pz"]),
            _row("specserve", 150, 0, method="ngram", accept=2.0)]
    summary = {(r["peer"], r["method"]): r for r in summarize(rows, ref)}
    llama = summary[("llama.cpp", "plain")]
    assert llama["tok_s"] == 350.0 and (llama["tok_s_min"], llama["tok_s_max"]) == (300.0, 400.0)
    assert llama["over_specserve"] == pytest.approx(2.5)  # median of 3.0 and 2.0, not 350 / 150
    assert llama["identical_outputs"] == "1/2" and llama["mean_common_prefix"] == 1.5
    assert summary[("specserve", "plain")]["identical_outputs"] == "2/2"
    ngram = summary[("specserve", "ngram")]
    assert ngram["accept_length"] == 2.0 and "identical_outputs" not in ngram  # no texts recorded
    table = markdown(list(summary.values()), {"float32/t2": 1.0})
    assert "| 1 | float32 | 2 | llama.cpp | plain | 350 (300-400) | 2.50x |" in table
    assert "float32/t2 1.0 (1000 tok/s)" in table
    grid = matrix(list(summary.values())).splitlines()
    assert grid[0] == "| peer | method | batch 1, f32, 2 thr |"
    assert grid[2:] == ["| llama.cpp | plain | 350 |", "| specserve | plain | 150 |",
                        "| specserve | ngram | 150 (2.00) |"]


def test_plot_writes_a_png(tmp_path: Path) -> None:
    rows = [_row("specserve", 100, 0), _row("llama.cpp", 300, 0), _row("specserve", 150, 0, method="ngram")]
    plot(summarize(rows, {}), tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(("kwargs", "flag"), [({"peers": ("vllm",)}, "--peers"), ({"dtypes": ("int8",)}, "--dtype"),
                                              ({"threads": (0,)}, "--threads"), ({"rounds": 0}, "--rounds"),
                                              ({"speculative": ("medusa",)}, "--speculative"),
                                              ({"dtypes": ("int4",)}, "transformers"),
                                              ({"speculative": ("suffix",), "peers": ("llama.cpp",)}, "specserve")])
def test_bad_config_names_the_flag(kwargs: dict, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        PeersConfig(**kwargs)


def test_cli_rejects_a_bad_flag_with_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert bench_main(["peers", "--peers", "llama.cpp,vllm", "--out-dir", str(tmp_path)]) == 2
    assert "--peers: unknown ['vllm']" in capsys.readouterr().err

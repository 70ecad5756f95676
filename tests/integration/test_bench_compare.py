"""`bench compare`: tables and a PNG from two real serving runs (against the stub) and acceptance runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from specserve.bench.cli import main
from specserve.bench.compare import render_report
from specserve.bench.runs import load_runs

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def serving_run(stub: str, out: Path, **stub_config: Any) -> Path:
    httpx.post(f"{stub}/stub/config", json=stub_config, timeout=10).raise_for_status()
    assert main(["serving", "--base-url", stub, "--model", "m", "--concurrency", "1,2", "--num-prompts", "2",
                 "--output-len", "4", "--no-progress", "--no-warmup", "--out", str(out)]) == 0
    return out


def acceptance_run(path: Path, tasks: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps({"kind": "acceptance", "tasks": tasks, "config": {"model": "tiny"}}))
    return path


def task(name: str, accept: float | None, spec: float, plain: float) -> dict[str, Any]:
    return {"name": name, "accept_length": accept, "spec_tokens_per_s": spec, "plain_tokens_per_s": plain,
            "speedup": spec / plain}


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > 10_000


def test_compare_two_real_serving_runs(stub: str, tmp_path: Path) -> None:
    base = serving_run(stub, tmp_path / "plain.json", ttft_ms=20, chunk_gap_ms=10, accept_length=None)
    spec = serving_run(stub, tmp_path / "spec.json", ttft_ms=20, chunk_gap_ms=10, tokens_per_chunk=2,
                       accept_length=2.0)
    report, plot = tmp_path / "report.md", tmp_path / "report.png"
    assert main(["compare", str(base), str(spec), "--out", str(report), "--plot", str(plot)]) == 0
    text = report.read_text()
    for title in ("### Output throughput (tok/s)", "### TTFT p50 (ms)", "### TPOT p50 (ms)", "### Accept length"):
        assert title in text
    assert "| concurrency | plain (baseline) | spec | best |" in text
    throughput = text.split("### Output throughput (tok/s)")[1].split("###")[0]
    rows = [r for r in throughput.splitlines() if r.startswith(("| 1 |", "| 2 |"))]
    assert len(rows) == 2 and all("×)" in r and "**" in r for r in rows)
    accept = text.split("### Accept length")[1].split("###")[0]
    assert "| 1 | - | 2.00 | - |" in accept  # the baseline reports none: no ratio, no winner
    assert_png(plot)


def test_compare_acceptance_runs_marks_winners_and_ratios(tmp_path: Path) -> None:
    a = acceptance_run(tmp_path / "eagle.json", [task("fizzbuzz", 3.0, 90.0, 30.0), task("lru_cache", 2.0, 60.0, 30.0)])
    b = acceptance_run(tmp_path / "dflash.json", [task("fizzbuzz", 4.5, 120.0, 30.0),
                                                  task("lru_cache", 2.0, 45.0, 30.0),
                                                  task("graph_bfs", 5.0, 150.0, 30.0)])
    report, plot = tmp_path / "acc.md", tmp_path / "acc.png"
    argv = ["compare", str(a), str(b), "--labels", "EAGLE3,DFlash", "--out", str(report), "--plot", str(plot)]
    assert main(argv) == 0
    text = report.read_text()
    accept = text.split("### Accept length")[1].split("###")[0]
    assert "| fizzbuzz | 3.00 | **4.50 (1.50×)** | DFlash |" in accept
    assert "| lru_cache | **2.00** | **2.00 (1.00×)** | tie |" in accept
    assert "| graph_bfs | - | 5.00 | - |" in accept
    assert "| **mean** (2 common tasks) | 2.50 | **3.25 (1.30×)** | DFlash |" in accept
    speedup = text.split("### Speedup over plain decoding")[1].split("###")[0]
    assert "| lru_cache | **2.00** | 1.50 (0.75×) | EAGLE3 |" in speedup
    assert_png(plot)


def test_mixed_kinds_get_one_section_each(stub: str, tmp_path: Path) -> None:
    run = serving_run(stub, tmp_path / "serve.json", ttft_ms=5, chunk_gap_ms=5)
    acc = acceptance_run(tmp_path / "acc.json", [task("fizzbuzz", 2.5, 50.0, 25.0)])
    runs = load_runs([run, acc])
    assert [r.kind for r in runs] == ["serving", "acceptance"]
    text = render_report(runs)
    assert "## Serving" in text and "## Acceptance" in text
    plot = tmp_path / "mixed.png"
    assert main(["compare", str(run), str(acc), "--out", str(tmp_path / "m.md"), "--plot", str(plot)]) == 0
    assert_png(plot)


@pytest.mark.parametrize(("content", "message"), [
    ("{not json", "invalid JSON (line 1"),
    ('{"kind": "other"}', "not a serving or acceptance run"),
    ('{"kind": "acceptance", "tasks": [{"accept_length": 2}]}', "every entry of 'tasks' needs 'name'"),
    ('{"levels": "no"}', "'levels' must be a list of objects"),
])
def test_bad_inputs_are_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str,
                                     message: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    assert main(["compare", str(bad), "--out", str(tmp_path / "r.md")]) == 2
    err = capsys.readouterr().err
    assert f"error: {bad}: " in err and message in err and "Traceback" not in err
    assert not (tmp_path / "r.md").exists()


def test_labels_must_match_the_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    acc = acceptance_run(tmp_path / "a.json", [task("fizzbuzz", 2.0, 20.0, 10.0)])
    assert main(["compare", str(acc), "--labels", "x,y", "--out", str(tmp_path / "r.md")]) == 2
    assert "--labels names 2 runs but 1 files were given" in capsys.readouterr().err

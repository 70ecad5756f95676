"""`specserve bench tune`: the grid, the plan, the winners, and one real tune on the tiny model.

The real tune serves NONE and two NGRAM configurations, skips two invalid ones (NGRAM with a DDTree),
changes a chain's draft to steps+1, and meets an EAGLE3 server that cannot start (missing drafter):
that one is reported with its log tail, the others still run, and the exit code says 1.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from specserve.bench.tune import parse_grid, pick_winners, plan_grid
from specserve.cli import main

GRID = "NGRAM:draft=4,8;tree=chain,ddtree EAGLE3:steps=3;draft=4,8;path=/nonexistent-drafter"
SERVED = ["NONE", "NGRAM:draft=4;tree=chain", "NGRAM:draft=8;tree=chain"]
FAILED = "EAGLE3:steps=3;draft=4;path=/nonexistent-drafter"


def test_grid_expands_to_the_cartesian_product_with_notes() -> None:
    plan, notes = plan_grid(parse_grid("EAGLE3:steps=3,5;topk=1;draft=4,8;path=/d NGRAM:tree=ddtree "
                                       "EAGLE3:steps=2;topk=2,4;draft=8;path=/d NONE"), "model-dir")
    assert [c.name for c in plan] == [
        "NONE", "EAGLE3:steps=3;topk=1;draft=4;path=/d", "EAGLE3:steps=5;topk=1;draft=6;path=/d",
        "EAGLE3:steps=2;topk=4;draft=8;path=/d"]  # NONE first although listed last; duplicates dropped
    assert dict(plan[0].flags) == {"speculative-algorithm": "NONE"}
    assert dict(plan[3].flags) == {"speculative-algorithm": "EAGLE3", "speculative-num-steps": 2,
                                   "speculative-eagle-topk": 4, "speculative-num-draft-tokens": 8,
                                   "speculative-draft-model-path": "/d"}
    assert plan[3].tokens()[:2] == ["--speculative-algorithm", "EAGLE3"]
    assert (plan[2].speculative.num_steps, plan[2].speculative.num_draft_tokens) == (5, 6)
    assert any("draft=8 became draft=4" in n for n in notes)
    assert any("draft=4 became draft=6" in n for n in notes) and any("draft=8 became draft=6" in n for n in notes)
    skipped = [n for n in notes if n.startswith("skipped")]
    assert len(skipped) == 2
    assert "NGRAM:tree=ddtree" in skipped[0] and "--speculative-tree ddtree needs" in skipped[0]
    # topk 2, steps 2: at most 2 + 1*4 = 6 drafts, so 8 verify tokens do not fit
    assert "EAGLE3:steps=2;topk=2;draft=8;path=/d" in skipped[1] and "too large" in skipped[1]


@pytest.mark.parametrize(("grid", "message"), [
    ("FOO:draft=4", "unknown algorithm 'FOO'"),
    ("NGRAM:draft", "expected key=v1,v2"),
    ("NGRAM:draft=", "expected key=v1,v2"),
    ("NGRAM:draft=x", "draft=x must be a positive integer"),
    ("NGRAM:width=4", "unknown key 'width'"),
    ("EAGLE3:tree=bush", "tree=bush must be one of chain"),
    ("NGRAM:block=8", "takes no 'block'"),
    ("NONE:draft=4", "takes no 'draft'"),
    ("NGRAM:draft=4;draft=8", "given twice"),
    ("   ", "--grid is empty"),
])
def test_bad_grid_is_a_clear_error(grid: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tune"
    assert main(["bench", "tune", "--model", "demo", "--grid", grid, "--out-dir", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("error: --grid")
    assert not out.exists()  # nothing served, nothing written


def test_winners_are_the_fastest_per_level_and_ratios_are_to_none() -> None:
    outcomes: list[dict[str, Any]] = [
        {"name": "NONE", "flags": {"speculative-algorithm": "NONE"}, "levels": {1: 100.0, 8: 400.0, 32: None}},
        {"name": "A", "flags": {"speculative-algorithm": "NGRAM"}, "levels": {1: 250.0, 8: 400.0, 32: 90.0}},
        {"name": "B", "flags": {"speculative-algorithm": "EAGLE3"}, "levels": {1: 200.0, 8: 300.0}},
    ]
    w = pick_winners(outcomes, [1, 8, 32, 64])
    assert [x["config"] for x in w] == ["A", "NONE", "A", None]  # a tie goes to the first (the baseline)
    assert w[0]["ratio_to_baseline"] == 2.5 and w[0]["flags"] == {"speculative-algorithm": "NGRAM"}
    assert w[1]["ratio_to_baseline"] == 1.0 and w[1]["output_tok_s"] == 400.0
    assert w[2]["output_tok_s"] == 90.0 and w[2]["ratio_to_baseline"] is None  # baseline failed at 32
    assert w[3]["output_tok_s"] is None and w[3]["ratio_to_baseline"] is None


def test_tune_on_the_tiny_model(tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tune"
    code = main(["bench", "tune", "--model", str(tiny_dir), "--device", "cpu", "--grid", GRID, "--concurrency", "1,2",
                 "--num-prompts", "4", "--output-len", "8", "--ignore-eos", "--seed", "0", "--server-timeout", "120",
                 "--no-progress", "--out-dir", str(out)])
    assert code == 1  # the EAGLE3 server could not start; the rest ran
    report = json.loads((out / "tune.json").read_text())
    assert report["kind"] == "tune" and report["baseline"] == "NONE" and report["concurrency"] == [1, 2]
    assert isinstance(report["command_line"], list)
    assert [c["name"] for c in report["configs"]] == [*SERVED, FAILED]
    ngram = report["configs"][2]
    assert ngram["flags"] == {"speculative-algorithm": "NGRAM", "speculative-num-draft-tokens": 8,
                              "speculative-tree": "chain"}
    failed = report["configs"][3]
    assert failed["run"] is None and "exited with code 2" in failed["error"]
    assert "nonexistent-drafter" in failed["log_tail"]
    notes = report["notes"]
    assert sum(n.startswith("skipped NGRAM:draft=") and "tree=ddtree" in n for n in notes) == 2
    assert any("draft=8 became draft=4" in n for n in notes)

    throughput: dict[str, dict[int, float]] = {}
    for cfg in report["configs"][:3]:
        assert cfg["error"] is None
        run = json.loads((out / cfg["run"]).read_text())
        info = run["server"]["info"]["speculative"]  # the flags reached the server
        assert info["algorithm"] == cfg["flags"]["speculative-algorithm"]
        assert info["num_draft_tokens"] == cfg["flags"].get("speculative-num-draft-tokens", 1)
        assert all((lv["completed"], lv["errors"]) == (4, 0) for lv in run["levels"])
        assert all((lv["accept_length"] is None) == (cfg["name"] == "NONE") for lv in run["levels"])
        throughput[cfg["name"]] = {lv["concurrency"]: lv["output_throughput"] for lv in run["levels"]}
        with pytest.raises(httpx.ConnectError):  # its server was stopped
            httpx.get(run["config"]["base_url"] + "/health", timeout=5)

    assert [w["concurrency"] for w in report["winners"]] == [1, 2]
    for w in report["winners"]:
        c = w["concurrency"]
        best = max(SERVED, key=lambda name: throughput[name][c])
        assert w["config"] == best and w["output_tok_s"] == throughput[best][c]
        assert w["flags"] == next(x["flags"] for x in report["configs"] if x["name"] == best)
        assert w["baseline_output_tok_s"] == throughput["NONE"][c]
        assert w["ratio_to_baseline"] == pytest.approx(throughput[best][c] / throughput["NONE"][c])

    md = (out / "tune.md").read_text()
    for w in report["winners"]:
        assert f"| {w['concurrency']} | {w['config']} | {w['output_tok_s']:.1f} |" in md
        assert f"{w['ratio_to_baseline']:.2f}× |" in md
    assert f"**{FAILED} failed:**" in md and "skipped NGRAM:draft=4;tree=ddtree" in md
    assert "### Output throughput (tok/s)" in md and "| NONE (baseline) |" in md
    assert "concurrency 1:" in capsys.readouterr().out

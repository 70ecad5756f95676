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


@pytest.mark.parametrize(("argv", "message"), [
    (["--engine", "vllm", "--grid", "NGRAM:draft=4"], "vllm has no flag for draft; vLLM's ngram drafts"),
    (["--engine", "sglang", "--grid", "NGRAM:steps=4"], "sglang has no flag for steps"),
    (["--engine", "sglang", "--grid", "NGRAM", "--launcher", "/bin/false"], "cannot tell the sglang version"),
    (["--engine", "sglang", "--grid", "NGRAM", "--launcher", "/bin/false", "--engine-version", "0.5.23"],
     "the sglang baseline did not start (server exited with code 1"),
    (["--grid", "NGRAM", "--launcher", "/opt/x/bin/python"], "are for --engine sglang|vllm"),
])
def test_engine_tune_bad_input_is_one_line(argv: list[str], message: str, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "tune"
    assert main(["bench", "tune", "--model", "/m", "--no-progress", "--server-timeout", "30", "--out-dir", str(out),
                 *argv]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("note:")]
    assert len(err) == 1 and message in err[0] and err[0].startswith("error:"), err
    assert not out.exists()  # nothing half-written


def test_engine_dry_run_says_what_each_release_does(capsys: pytest.CaptureFixture[str]) -> None:
    grid = "EAGLE3:steps=3;topk=1,4;path=/d DFLASH:block=16;path=/d NGRAM NONE"
    lines = {}
    for version in ("0.5.10", "0.5.23"):
        assert main(["bench", "tune", "--engine", "sglang", "--engine-version", version, "--model", "/m", "--grid",
                     grid, "--out-dir", "/nonexistent", "--dry-run", "--launcher", "/opt/sglang/bin/python"]) == 0
        lines[version] = {d["name"]: d for d in map(json.loads, capsys.readouterr().out.splitlines())}
    old, new = lines["0.5.10"], lines["0.5.23"]
    assert list(old) == list(new) == ["NONE", "EAGLE3:steps=3;topk=1;path=/d", "EAGLE3:steps=3;topk=4;path=/d",
                                      "DFLASH:block=16;path=/d;tree=chain", "NGRAM"]
    assert set(old["NONE"]) == {"name", "argv", "env", "notes"}
    assert old["NONE"]["argv"][:3] == ["/opt/sglang/bin/python", "-m", "sglang.launch_server"]
    assert old["DFLASH:block=16;path=/d;tree=chain"]["argv"] is None
    assert "no --speculative-algorithm DFLASH" in old["DFLASH:block=16;path=/d;tree=chain"]["skipped"]
    assert new["DFLASH:block=16;path=/d;tree=chain"]["argv"] is not None
    chain, tree = old["EAGLE3:steps=3;topk=1;path=/d"], old["EAGLE3:steps=3;topk=4;path=/d"]
    assert chain["env"] == {"SGLANG_ENABLE_SPEC_V2": "True"} and tree["env"] == {}
    assert any("non-overlap path" in n for n in tree["notes"])
    assert any("page size 1 runs on the overlap" in n for n in new["EAGLE3:steps=3;topk=4;path=/d"]["notes"])


def engine_tune(path: Path, version: str, flags: dict[str, Any]) -> Path:
    """A tune.json of an SGLang tune whose winner at concurrency 30 has `flags`."""
    path.write_text(json.dumps({"kind": "tune", "engine": "sglang", "engine_version": version, "winners": [
        {"concurrency": 30, "config": "picked", "flags": flags, "output_tok_s": 300.0,
         "baseline_output_tok_s": 200.0, "ratio_to_baseline": 1.5}]}))
    return path


def test_tune_then_freeze_from_tune(tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`bench tune --engine specserve` on a small grid, then `deploy freeze --from-tune` of the winner; the same
    tune refused for another engine, and an SGLang tune's winner refused for a release that lacks its flags."""
    out = tmp_path / "tune"
    assert main(["bench", "tune", "--engine", "specserve", "--model", str(tiny_dir), "--device", "cpu", "--grid",
                 "NGRAM:draft=4", "--concurrency", "1", "--num-prompts", "2", "--output-len", "8", "--ignore-eos",
                 "--seed", "0", "--server-timeout", "120", "--no-progress", "--out-dir", str(out)]) == 0
    report = json.loads((out / "tune.json").read_text())
    assert report["engine"] == "specserve" and (out / "tune.png").is_file()
    winner = report["winners"][0]["config"]
    serve = tmp_path / "serve.yaml"
    serve.write_text(f"model: {tiny_dir}\ndevice: cpu\napi-key: s3cret\ntool-call-parser: qwen25\n"
                     "speculative-algorithm: STANDALONE\nspeculative-num-steps: 3\n")
    deploy = tmp_path / "deploy"
    assert main(["deploy", "freeze", "--config", str(serve), "--from-tune", str(out / "tune.json"),
                 "--concurrency", "1", "--out", str(deploy)]) == 0
    frozen = (deploy / "serve.yaml").read_text()
    want = "NGRAM" if winner != "NONE" else "NONE"
    assert f"speculative-algorithm: {want}" in frozen and "tool-call-parser: qwen25" in frozen
    assert "speculative-num-steps: 3" not in (deploy / "tuned.yaml").read_text()  # the tune's flags replace them
    assert "SPECSERVE_API_KEY=s3cret" in (deploy / "specserve.env").read_text()
    assert f"`bench tune` winner at concurrency 1: `{winner}`" in (deploy / "production.md").read_text()
    capsys.readouterr()
    assert main(["deploy", "freeze", "--config", str(serve), "--from-tune", str(out / "tune.json"),
                 "--concurrency", "1", "--engine", "sglang", "--out", str(tmp_path / "x")]) == 2
    assert "was tuned on specserve" in capsys.readouterr().err and not (tmp_path / "x").exists()

    sglang_tune = engine_tune(tmp_path / "sglang-tune.json", "0.5.23",
                              {"speculative-algorithm": "NGRAM", "speculative-num-draft-tokens": 8})
    hicache = tmp_path / "hicache.yaml"
    hicache.write_text(serve.read_text() + "enable-hierarchical-cache: true\nhicache-size: 4\n")
    export = tmp_path / "sglang"
    assert main(["deploy", "freeze", "--engine", "sglang", "--config", str(hicache), "--from-tune", str(sglang_tune),
                 "--concurrency", "30", "--out", str(export)]) == 0
    facts = json.loads((export / "export.json").read_text())
    argv = facts["argv"]
    assert argv[argv.index("--speculative-algorithm") + 1] == "NGRAM" and "--enable-hierarchical-cache" in argv
    assert argv[argv.index("--tool-call-parser") + 1] == "qwen25" and argv[argv.index("--api-key") + 1] == "$API_KEY"
    assert "API_KEY=s3cret" in (export / "sglang.env").read_text()
    assert "1.50x the plain-decoding baseline" in (export / "production.md").read_text()

    dflash = engine_tune(tmp_path / "dflash-tune.json", "0.5.10", {
        "speculative-algorithm": "DFLASH", "speculative-draft-model-path": "/d", "speculative-dflash-block-size": 8})
    capsys.readouterr()
    assert main(["deploy", "freeze", "--engine", "sglang", "--config", str(serve), "--from-tune", str(dflash),
                 "--concurrency", "30", "--out", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err.strip()
    assert "SGLang 0.5.10 would not run this export" in err and "--force" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "refused").exists()

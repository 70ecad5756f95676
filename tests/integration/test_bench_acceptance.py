"""`specserve bench acceptance`: per-task accept length and speedup, same process; custom suites; a reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specserve.bench.acceptance import repeated_ngram_fraction
from specserve.bench.acceptance_cli import seed_summary
from specserve.bench.suites import load_jsonl_tasks
from specserve.cli import main


def test_repeated_ngram_fraction() -> None:
    assert repeated_ngram_fraction([1, 2, 3, 4, 5, 6]) == 0.0
    assert repeated_ngram_fraction([1, 2, 3, 4] * 3) == pytest.approx(5 / 9)
    assert repeated_ngram_fraction([1, 2]) == 0.0


def test_acceptance_on_a_custom_suite_with_a_reference(tmp_path: Path, tiny_dir: Path, tiny_draft_dir: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    suite = tmp_path / "suite.jsonl"
    suite.write_text(
        json.dumps({"name": "loop", "prompt": "a = 1\nb = 2\na = 1\nb = 2\n", "kind": "after_newline"}) + "\n"
        + json.dumps({"name": "chat", "messages": [{"role": "user", "content": "write fizzbuzz"}]}) + "\n"
    )
    out = tmp_path / "acc.json"
    code = main(["bench", "acceptance", "--model", str(tiny_dir), "--device", "cpu", "--dtype", "float32",
                 "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", str(tiny_draft_dir),
                 "--speculative-num-steps", "3", "--suite", str(suite), "--max-new-tokens", "16",
                 "--reference-draft", str(tiny_draft_dir), "--out", str(out)])
    capsys.readouterr()
    assert code == 0
    report = json.loads(out.read_text())
    assert report["kind"] == "acceptance"
    assert [t["name"] for t in report["tasks"]] == ["loop", "chat"]
    for t in report["tasks"]:
        assert 1.0 <= t["accept_length"] <= 4.0
        assert t["new_tokens"] == 16 and t["identical_to_plain"] is True
        assert t["percent_of_reference"] == pytest.approx(100.0)  # same drafter, same greedy path
        assert len(t["accept_per_position"]) <= 3
        assert t["speedup"] == pytest.approx(t["spec_tokens_per_s"] / t["plain_tokens_per_s"], rel=1e-2)
    s = report["summary"]
    assert s["identical_to_plain"] == "2/2" and s["percent_of_reference"] == pytest.approx(100.0)
    assert s["round_cost_plain_steps"] == pytest.approx(s["accept_length"] / s["speedup"], rel=1e-2)
    assert [t["kind"] for t in report["tasks"]] == ["after_newline", None]
    by_kind = s["by_kind"]["after_newline"]
    assert by_kind["tasks"] == 1 and by_kind["accept_length"] == report["tasks"][0]["accept_length"]
    assert s["headline_accept_length"] == by_kind["accept_length_nonlooping"]  # None where the task loops
    assert s["loop_threshold"] == 0.25
    d = report["diagnosis"]  # greedy: where the drafter misses; the reference is the same drafter, so no difference
    assert d["by_depth"] and all(0.0 <= x["rate"] <= 1.0 and x["depth"] <= 3 for x in d["by_depth"])
    assert sum(c["reached"] for c in d["by_class"].values()) == sum(x["reached"] for x in d["by_depth"])
    assert all(n == 0 for c in d["versus_reference"].values() for n in c.values())
    assert report["config"]["speculative"]["algorithm"] == "STANDALONE"


def test_acceptance_bad_suite_line(tmp_path: Path, tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    suite = tmp_path / "bad.jsonl"
    suite.write_text('{"name": "ok", "prompt": "x"}\n{"name": broken\n')
    kinds = tmp_path / "kinds.jsonl"
    kinds.write_text('{"name": "ok", "prompt": "x", "kind": "middle"}\n')
    with pytest.raises(ValueError, match=r"kinds\.jsonl:1: kind 'middle'"):
        load_jsonl_tasks(kinds)
    code = main(["bench", "acceptance", "--model", str(tiny_dir), "--speculative-algorithm", "NGRAM",
                 "--suite", str(suite)])
    err = capsys.readouterr().err
    assert code == 2 and "bad.jsonl:2" in err and "Traceback" not in err


def test_acceptance_over_seeds(tmp_path: Path, tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--seeds N: sampled runs at seeds --seed ..., each reproducing a one-seed run, with their mean and spread;
    refused for greedy decoding."""
    suite = tmp_path / "suite.jsonl"
    suite.write_text(json.dumps({"name": "loop", "prompt": "a = 1\nb = 2\na = 1\nb = 2\n"}) + "\n")
    base = ["bench", "acceptance", "--model", str(tiny_dir), "--device", "cpu", "--dtype", "float32",
            "--speculative-algorithm", "NGRAM", "--suite", str(suite), "--max-new-tokens", "24",
            "--temperature", "1.0", "--seed", "3"]
    assert main([*base, "--seeds", "3"]) == 0
    report = json.loads(capsys.readouterr().out)
    seeds = report["seeds"]
    assert seeds["seeds"] == [3, 4, 5] and [r["seed"] for r in report["runs"]] == [3, 4, 5]
    assert seeds["accept_length"] == [r["summary"]["accept_length"] for r in report["runs"]]
    assert seeds == seed_summary(seeds["accept_length"], 3)
    assert main([*base[:-1], "4"]) == 0  # the second run alone
    assert json.loads(capsys.readouterr().out)["summary"]["accept_length"] == seeds["accept_length"][1]
    assert main([*base[:-4], "--seeds", "2"]) == 2
    assert "--seeds" in capsys.readouterr().err


def test_seed_summary() -> None:
    s = seed_summary([2.0, 3.0, 4.0], 0)
    assert (s["mean"], s["sd"], s["se"]) == (3.0, 1.0, round(1 / 3**0.5, 4)) and s["seeds"] == [0, 1, 2]



def test_the_warm_up_decodes_the_longest_prompt_at_the_full_length(tiny_dir: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """So every offline engine is built (its KV pool sized for the longest task) and every chain length compiled
    before the timed tasks: a task that rebuilt an engine would time its steps' compilation."""
    from specserve.bench.acceptance import run_acceptance
    from specserve.bench.suites import Task
    from specserve.config import SpeculativeConfig
    from specserve.engine.llm import LLM
    from specserve.types import SamplingParams

    llm = LLM(str(tiny_dir), device="cpu", dtype="float32", speculative=SpeculativeConfig.resolve("NGRAM"))
    calls: list[tuple[int, int]] = []  # (prompt tokens, new tokens) of each plain decode
    plain = llm.generate_plain
    monkeypatch.setattr(llm, "generate_plain",
                        lambda ps, sp: calls.append((len(ps[0]), sp.max_new_tokens)) or plain(ps, sp))
    tasks = [Task(f"t{n}", "x = 1\n" * n) for n in (1, 30, 10)]
    run_acceptance(llm, tasks, SamplingParams(max_new_tokens=8), progress=False)
    lengths = [len(llm.encode(t.prompt or "")) for t in tasks]
    assert calls[0] == (max(lengths), 8) and [n for n, _ in calls[1:]] == lengths

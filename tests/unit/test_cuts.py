"""Cut kinds (`bench/cuts.py`), the per-kind and non-looping figures (`bench/by_kind.py`), and the bundled
held-out suite's make-up."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from specserve.bench.by_kind import kind_summary, pooled_accept
from specserve.bench.cuts import CUT_KINDS, cut_file
from specserve.bench.suites import load_suite

SOURCE = "".join(f"    value_{i} = compute_something(alpha_{i}, beta)  # line {i}\n" if i % 5 else "\n"
                 for i in range(90))


@pytest.mark.parametrize("seed", range(20))
def test_each_kind_ends_where_it_says(seed: int) -> None:
    rng = random.Random(seed)
    lines = SOURCE.splitlines(keepends=True)
    for kind in CUT_KINDS:
        cut = cut_file(SOURCE, kind, rng, context_lines=6)
        assert cut is not None and cut.kind == kind
        line = lines[cut.line - 1]
        assert line.strip() and 30 <= cut.line <= 60  # a code line of the middle third
        assert SOURCE.startswith(cut.prompt) or ("\n" + cut.prompt) in SOURCE  # a context starting at a line
        assert cut.prompt.count("\n") <= 6
        last = cut.prompt.rsplit("\n", 1)[-1]  # what the context holds of its last line
        if kind == "after_newline":
            assert cut.prompt.endswith(line)
        elif kind == "line_end":
            assert last == line.rstrip("\n")
        else:
            assert line.startswith(last) and line.lstrip().startswith(last.lstrip())
            assert last.strip() and len(line.rstrip("\n")) > len(last)  # code before the cut and after it
        word = [c.isalnum() or c == "_" for c in (last[-1:] or " ", line[len(last)])]
        assert cut.in_identifier == (kind == "mid_line" and all(word))


def test_mid_line_cuts_fall_inside_identifiers_too() -> None:
    rng = random.Random(0)
    cuts = [cut_file(SOURCE, "mid_line", rng) for _ in range(50)]
    inside = sum(c.in_identifier for c in cuts if c is not None)
    assert 5 < inside < 50


def test_cut_errors_and_files_without_a_fitting_line() -> None:
    with pytest.raises(ValueError, match="cut kind 'middle'"):
        cut_file(SOURCE, "middle", random.Random(0))
    assert cut_file("# only comments\n" * 30, "line_end", random.Random(0)) is None
    assert cut_file("x\n" * 30, "mid_line", random.Random(0)) is None  # no line with code either side


@pytest.mark.parametrize("kind", CUT_KINDS)
def test_lines_longer_than_the_context_are_not_cut(kind: str) -> None:
    long = "    table = [" + ", ".join(str(n) for n in range(40)) + "]\n"  # 150 characters
    short = "    value = compute(alpha, beta)\n"
    text = "".join(long if i % 2 else short for i in range(90))
    rng = random.Random(0)
    for _ in range(30):
        cut = cut_file(text, kind, rng, context_chars=100)
        assert cut is not None and text.splitlines(keepends=True)[cut.line - 1] == short
        assert cut.prompt.strip() and short.startswith(cut.prompt)  # the line before is too long to hold
    assert cut_file(long * 90, kind, rng, context_chars=100) is None


def row(kind: str | None, accept: float, steps: int, loop: float | None) -> dict[str, object]:
    return {"kind": kind, "accept_length": accept, "verify_steps": steps, "loop_4gram": loop}


def test_kind_summary_leaves_looping_tasks_out_and_takes_the_worst_kind() -> None:
    rows = [row("line_end", 2.0, 10, 0.1), row("line_end", 6.0, 10, 0.6),  # the second loops
            row("after_newline", 3.0, 10, 0.0), row("after_newline", 4.0, 30, 0.2),
            row("mid_line", 1.5, 20, 0.0)]
    s = kind_summary(rows, threshold=0.25)
    assert s["nonlooping_tasks"] == 4
    assert s["accept_length_nonlooping"] == pytest.approx((20 + 30 + 120 + 30) / 70, abs=1e-4)
    assert s["by_kind"]["line_end"] == {"tasks": 2, "nonlooping_tasks": 1, "accept_length": 4.0,
                                        "accept_length_nonlooping": 2.0, "loop_4gram": 0.35}
    assert s["by_kind"]["after_newline"]["accept_length_nonlooping"] == 3.75
    assert s["headline_accept_length"] == 1.5  # mid_line, the worst kind
    assert kind_summary(rows, threshold=1.0)["by_kind"]["line_end"]["accept_length_nonlooping"] == 4.0


def test_kind_summary_without_kinds_or_step_counts() -> None:
    s = kind_summary([row(None, 2.0, 0, None), row(None, 4.0, 0, 0.9), row(None, 3.0, 0, 0.1)])
    assert "by_kind" not in s and s["nonlooping_tasks"] == 1  # no loop measure: not known to be calm
    assert s["headline_accept_length"] == s["accept_length_nonlooping"] == 3.0
    assert pooled_accept([]) is None
    all_loop = kind_summary([row("mid_line", 5.0, 3, 0.9), row("line_end", 2.0, 3, 0.0)])
    assert all_loop["by_kind"]["mid_line"]["accept_length_nonlooping"] is None
    assert all_loop["headline_accept_length"] is None  # a kind with no calm task has no figure to compare


def test_without_loop_measures_there_is_no_nonlooping_figure() -> None:
    rows = [row("line_end", 2.0, 10, None), row("mid_line", 3.0, 10, None)]  # through a server, no tokenizer
    s = kind_summary(rows)
    assert s["nonlooping_tasks"] == 0 and s["accept_length_nonlooping"] is None
    assert s["by_kind"]["line_end"] == {"tasks": 1, "nonlooping_tasks": 0, "accept_length": 2.0,
                                        "accept_length_nonlooping": None, "loop_4gram": None}
    assert s["headline_accept_length"] is None
    s = kind_summary([row(None, 2.0, 10, None)])
    assert s["accept_length_nonlooping"] is None and s["headline_accept_length"] is None


def test_pooled_accept_weights_by_steps_and_ignores_rows_without_any() -> None:
    rows = [row(None, 2.0, 10, None), row(None, 5.0, 30, None)]
    assert pooled_accept(rows) == (20 + 150) / 40
    assert pooled_accept([*rows, row(None, 9.0, 0, None), {"accept_length": 9.0, "verify_steps": None}]) == 4.25
    assert pooled_accept([row(None, 2.0, 0, None), {"accept_length": 5.0, "verify_steps": None}]) == 3.5


def test_bundled_heldout_suite_is_balanced_over_packages_and_kinds() -> None:
    tasks = load_suite("heldout-code")
    kinds = Counter(t.kind for t in tasks)
    assert set(kinds) == set(CUT_KINDS) and len(set(kinds.values())) == 1
    packages = Counter(t.name.split("/")[0] for t in tasks)
    assert len(packages) >= 6 and len(set(packages.values())) == 1
    for t in tasks:
        assert t.prompt and t.kind
        assert t.prompt.endswith("\n") == (t.kind == "after_newline")
    pip = load_suite("heldout-pip")
    assert len(pip) == 64 and all(t.kind is None and t.prompt and t.prompt.endswith("\n") for t in pip)

"""`train/val_cuts.py`: the validation contexts, each file cut at every kind over the rounds."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from specserve.bench.cuts import CUT_KINDS
from specserve.train import corpus
from specserve.train.val_cuts import validation_cuts

SOURCE = "".join(f"    value_{i} = compute(alpha_{i}, beta)\n" for i in range(90))


@pytest.mark.parametrize("n_files", [3, 4, 5])
def test_each_file_is_cut_at_every_kind_over_three_rounds(monkeypatch: pytest.MonkeyPatch, n_files: int) -> None:
    files = [Path(f"/lib/pkg/mod_{n}.py") for n in range(n_files)]  # 3: kinds once followed the files
    files.append(Path("/lib/pkg/__init__.py"))  # empty: no context, and no kind spent on it
    monkeypatch.setattr(corpus, "stdlib_files", lambda: files)
    monkeypatch.setattr(corpus, "is_validation", lambda p, fraction=0.02: True)
    monkeypatch.setattr(corpus, "read_text", lambda p: "" if p.name == "__init__.py" else SOURCE)
    tasks = validation_cuts(3 * n_files)
    kinds: dict[str, set[str | None]] = {}
    for t in tasks:
        kinds.setdefault(t.name.split(":")[0], set()).add(t.kind)
    assert len(kinds) == n_files and all(k == set(CUT_KINDS) for k in kinds.values())
    assert set(Counter(t.kind for t in tasks).values()) == {n_files}
    assert [t.kind for t in tasks[:3]] == list(CUT_KINDS)

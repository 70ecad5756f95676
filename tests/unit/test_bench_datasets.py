"""Prompt sources of the serving sweep: built-in sets, JSONL parsing with per-line errors, sampling."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specserve.bench.datasets import load_dataset, sample_prompts
from specserve.bench.prompts import CODING_PROMPTS, DatasetError, Prompt, random_prompts


def test_malformed_lines_are_skipped_and_reported_with_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    lines = [
        json.dumps({"prompt": "write fizzbuzz", "max_tokens": 5}),
        "{not json",
        "",
        json.dumps(["a list"]),
        json.dumps({"text": "wrong key"}),
        json.dumps({"messages": [{"role": "user", "content": "hi"}]}),
        json.dumps({"messages": [{"role": "user"}]}),
        json.dumps({"prompt": "x", "max_tokens": 0}),
    ]
    path.write_text("\n".join(lines) + "\n")
    ds = load_dataset(str(path), num_prompts=4)
    assert ds.prompts == (Prompt(text="write fizzbuzz", max_tokens=5), Prompt(messages=(("user", "hi"),)))
    assert [e.split(": ", 1)[0] for e in ds.errors] == [f"{path}:{n}" for n in (2, 4, 5, 7, 8)]
    assert "invalid JSON" in ds.errors[0]
    assert "expected a JSON object" in ds.errors[1]
    assert '"prompt"' in ds.errors[2]
    assert '"role" and "content"' in ds.errors[3]
    assert '"max_tokens"' in ds.errors[4]


def test_unusable_files_are_dataset_errors(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="no such file"):
        load_dataset(str(tmp_path / "missing.jsonl"), num_prompts=1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    with pytest.raises(DatasetError, match=rf"no usable prompt line; first problem: {bad}:1: invalid JSON"):
        load_dataset(str(bad), num_prompts=1)


def test_builtin_datasets() -> None:
    coding = load_dataset("coding", num_prompts=3)
    assert len(coding.prompts) == len(CODING_PROMPTS) >= 20
    assert len(set(CODING_PROMPTS)) == len(CODING_PROMPTS)
    rand = load_dataset("random", num_prompts=5, seed=1, random_input_len=12)
    assert len(rand.prompts) == 5 and all(len((p.text or "").split()) == 12 for p in rand.prompts)
    assert rand.prompts == random_prompts(5, 12, seed=1)
    assert rand.prompts != random_prompts(5, 12, seed=2)


def test_sample_prompts_is_seeded_and_cycles() -> None:
    ds = load_dataset("coding", num_prompts=1)
    picked = sample_prompts(ds, 45, seed=7)
    assert picked == sample_prompts(ds, 45, seed=7)
    assert picked[:20] != sample_prompts(ds, 45, seed=8)[:20]
    assert sorted(p.text or "" for p in picked[:20]) == sorted(CODING_PROMPTS)
    assert picked[20:40] == picked[:20]
    with pytest.raises(ValueError, match="--num-prompts"):
        sample_prompts(ds, 0, seed=0)


def test_prompt_needs_exactly_one_form() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        Prompt()
    with pytest.raises(ValueError, match="exactly one"):
        Prompt(text="a", messages=(("user", "b"),))
    assert Prompt(text="a").as_messages() == [{"role": "user", "content": "a"}]

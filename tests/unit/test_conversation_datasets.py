"""Conversation datasets: JSONL "turns" lines, histories (chat messages, completion transcripts that extend the
previous turn's prompt), and the seeded `agentic` generator over installed packages' source files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specserve.bench.conversations import Conversation, agentic_conversations
from specserve.bench.datasets import load_dataset, sample_conversations


def write(tmp_path: Path, *lines: object) -> Path:
    path = tmp_path / "d.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines), encoding="utf-8")
    return path


def test_turns_lines_make_a_conversation_dataset(tmp_path: Path) -> None:
    path = write(tmp_path, {"id": "a", "turns": ["hi", [{"role": "tool", "content": "out"}, "now?"]]},
                 {"prompt": "single"}, {"turns": []}, {"turns": [{"role": "bot", "content": "x"}]})
    ds = load_dataset(str(path), 4)
    assert [c.id for c in ds.conversations] == ["a", "line2"] and len(ds.errors) == 2
    a, single = ds.conversations
    assert a.turns == ((("user", "hi"),), (("tool", "out"), ("user", "now?")))
    assert single.single is not None and single.num_turns == 1 and single.messages(0, []) == [
        {"role": "user", "content": "single"}]
    assert a.messages(1, ["A"]) == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "A"},
                                    {"role": "tool", "content": "out"}, {"role": "user", "content": "now?"}]
    first, second = a.transcript(0, []), a.transcript(1, ["A"])
    assert second.startswith(first + "A\n") and second.endswith("user: now?\nassistant: ")
    assert len(sample_conversations(ds, 5, 0)) == 5


def test_prompt_only_files_stay_single_prompt_datasets(tmp_path: Path) -> None:
    ds = load_dataset(str(write(tmp_path, {"prompt": "x"}, {"prompt": "y"})), 2)
    assert ds.conversations == () and len(ds.prompts) == 2


def test_agentic_is_seeded_and_shows_real_source() -> None:
    a, b = agentic_conversations(4, seed=3, file_chars=400), agentic_conversations(4, seed=3, file_chars=400)
    assert a == b and agentic_conversations(4, seed=4, file_chars=400) != a
    for conv in a:
        assert 2 <= conv.num_turns <= 4
        (_, instruction), (role, tool) = conv.turns[0]
        assert role == "tool" and tool.startswith("$ cat ") and len(tool) <= 400 + 200
        path = conv.id.split(":", 1)[1]
        assert path.endswith(".py") and path in instruction
        assert conv.turns[1][0][0] == "tool" and "FAILED" in conv.turns[1][0][1]
    assert load_dataset("agentic", 3, 0).conversations[0].num_turns >= 2


def test_conversation_needs_turns() -> None:
    with pytest.raises(ValueError, match="at least one turn"):
        Conversation("x", ())

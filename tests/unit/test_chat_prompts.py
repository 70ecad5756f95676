"""Chat coding tasks: every kind built, the train and held-out splits disjoint, the bundled suite loadable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specserve.bench.suites import CHAT_KINDS, default_new_tokens, load_suite
from specserve.train.chat_prompts import _flip, build_tasks, functions_of, source_files

CODE = '''
def clamp(value, low, high):
    """Return value limited to the range low..high. Both ends are included."""
    if value < low:
        return low
    if value > high:
        return high
    return value
'''


def test_functions_and_flips() -> None:
    [fn] = functions_of(CODE, "m.py")
    assert fn.signature == "clamp(value, low, high)" and fn.doc == "Return value limited to the range low..high"
    broken = _flip(fn.code)
    assert broken is not None and broken != fn.code and "value <= low" in broken
    assert '"""Return value limited' in broken  # the docstring is left as it is


def test_splits_are_disjoint_and_every_kind_is_built() -> None:
    train = build_tasks("train", 40)
    held = load_suite("chat-coding")
    assert {t["kind"] for t in train} == set(CHAT_KINDS) == {t.kind for t in held}
    files = {t["name"].rsplit(":", 2)[0] for t in train}
    assert not files & {t.name.rsplit(":", 2)[0] for t in held}
    held_text = {json.dumps(t.messages) for t in held}
    assert not any(json.dumps(t["messages"]) in held_text for t in train)
    tool = next(t for t in train if t["kind"] == "tool")
    assert [m["role"] for m in tool["messages"]] == ["user", "assistant", "tool"]
    assert tool["messages"][1]["content"].startswith('<tool_call>[{"name": "read_file"')
    # the validation split (choosing a checkpoint) shares no file with training or the held-out suite; built again,
    # it is the committed file (the prompts are reproducible across processes)
    val = build_tasks("val", 30)
    committed = Path(__file__).resolve().parents[2] / "data" / "smollm2" / "chat_prompts.val.jsonl"
    assert [json.loads(line) for line in committed.read_text().splitlines()] == val
    val_files = {t["name"].rsplit(":", 2)[0] for t in val}
    assert {t["kind"] for t in val} == set(CHAT_KINDS)
    assert not val_files & {rel for _, rel in source_files("train")}
    assert not val_files & {t.name.rsplit(":", 2)[0] for t in held}
    assert default_new_tokens("chat-coding") == 64


def test_coding10_chat_asks_for_the_ten_seed_tasks_and_is_never_trained_on() -> None:
    from specserve.bench.suites import CODING10, default_new_tokens, load_suite
    from specserve.train.prompts import evaluation_texts

    tasks = load_suite("coding10-chat")
    assert [t.name for t in tasks] == [n for n, _ in CODING10] and len(tasks) == 10
    assert all(t.prompt is None and t.messages and t.messages[0]["role"] == "user" for t in tasks)
    assert all(t.name.split("_")[0] in t.messages[0]["content"].lower() for t in tasks if t.messages)
    assert default_new_tokens("coding10-chat") == 64
    held = set(evaluation_texts())
    assert all(t.messages[0]["content"] in held for t in tasks if t.messages)


def test_the_code_editing_suite_rewrites_code_from_the_prompt_and_is_reproducible() -> None:
    """`code-edit`: fix and edit tasks in turn from the held-out packages, each showing the code its answer rewrites;
    built again, it is the committed file; a kind that does not exist is an error naming --kinds."""
    import pytest

    edit = load_suite("code-edit")
    assert [t.kind for t in edit] == ["fix", "edit"] * 8 and default_new_tokens("code-edit") == 128
    assert all("```python\n" in t.messages[0]["content"] for t in edit if t.messages)
    rebuilt = build_tasks("heldout", 16, seed=1, kinds=("fix", "edit"))
    assert [(t.name, t.messages) for t in edit] == [(t["name"], t["messages"]) for t in rebuilt]
    with pytest.raises(ValueError, match="--kinds"):
        build_tasks("heldout", 2, kinds=("rewrite",))


def test_answered_chat_tasks_carry_the_sources_function() -> None:
    tasks = build_tasks("train", 6, seed=3, answers=True)
    assert [t["kind"] for t in tasks] == ["write", "fix", "complete"] * 2
    for t in tasks:
        reply = t["messages"][-1]
        assert reply["role"] == "assistant" and reply["content"].startswith("```python\ndef ")
    fixed = tasks[1]["messages"][-1]["content"].removeprefix("```python\n").removesuffix("```")
    assert fixed not in tasks[1]["messages"][0]["content"]  # the prompt shows the code with one flip
    with pytest.raises(ValueError, match="--answers needs --kinds"):
        build_tasks("train", 2, answers=True, kinds=("write", "explain"))


def test_packages_split_leaves_out_the_held_out_packages_vendored_trees_and_tests() -> None:
    from specserve.train.chat_prompts import HELDOUT_PACKAGES, _package_file

    for rel in ("rich/console.py", "pip/_internal/req.py", "foo/_vendor/rich/console.py", "foo/vendored/x.py",
                "numpy/tests/test_core.py", "bar/click/core.py"):
        assert not _package_file(rel), rel
    files = source_files("packages")
    assert len(files) > 100  # the test extras alone install hundreds of files
    for _, rel in files:
        dirs = rel.split("/")[:-1]
        assert not set(dirs) & {*HELDOUT_PACKAGES, "_vendor", "tests"}, rel
    kept = sum(_package_file(f"pkg/m{i}.py") for i in range(1000))
    assert 950 < kept < 1000  # about 2% of the files held back, by a stable hash of the path

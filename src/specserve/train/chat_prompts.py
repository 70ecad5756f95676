"""Chat coding tasks for a chat target: what users send a coding assistant, built from real functions.

    python -m specserve.train.chat_prompts --split train --count 1200 --out runs/smollm2/chat_prompts.jsonl
    python -m specserve.train.chat_prompts --split heldout --count 30 \\
        --out src/specserve/assets/suites/chat_coding.jsonl
    python -m specserve.train.chat_prompts --split heldout --count 16 --kinds fix,edit --seed 1 \\
        --out src/specserve/assets/suites/code_edit.jsonl
    python -m specserve.train.chat_prompts --split train --count 20000 --answers --out runs/smollm2/answered.jsonl

Kinds, one function each:
- `write`: the signature and the docstring's first sentence, "write it";
- `explain`: the function's code, "explain it";
- `fix`: the code with one operator or constant flipped, "find the bug and fix it";
- `complete`: the header, the docstring and the first half of the body, "complete it";
- `tool`: an agent turn: the user asks to open a file and change the function, the assistant's `read_file` call
  (SmolLM2's `<tool_call>[...]</tool_call>` format, as `serve --tool-call-parser smollm2` writes it) and the file as
  the tool's result;
- `edit` (not among the default kinds): the function's code, "rewrite it with type hints / clearer names / ...,
  the whole function": answers that copy most of the prompt, the code-editing suite (`--kinds fix,edit`).

`--answers` gives each task of the kinds whose answer the source itself is (`write`, `fix`, `complete`: the
function as written, fenced) that answer as an assistant turn: real text `train prepare` writes without generating
it, for the target to label in one prefill (`train/data.py`).

`train` takes functions from the standard library's training split (`corpus.is_validation` false, tests left
out); `val` from its validation split (other files: for choosing a checkpoint); `heldout` from the files of the
eight third-party packages the held-out code suite is cut from; `packages` from every other package installed
beside specserve (torch, numpy, transformers, ...: many more functions than the standard library, for answered
data at scale), leaving out the held-out packages wherever they sit (vendored copies too), vendored trees and
tests, and 2% of the files by a stable hash of their path, as `val` does. No two splits share a file, and no
training prompt shares a function's text with the held-out suite.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import random
import re
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specserve.bench.suites import CHAT_KINDS as KINDS
from specserve.train import corpus

SPLITS = ("train", "val", "heldout", "packages")
HELDOUT_PACKAGES = ("httpx", "pydantic", "click", "rich", "jinja2", "aiohttp", "openai", "pip")
#: directories whose files are never `packages` data: the held-out packages wherever they sit (vendored copies
#: too), vendored trees, tests
NOT_PACKAGES = (*HELDOUT_PACKAGES, "_vendor", "vendor", "vendored", "test", "tests", "testing")
MIN_LINES, MAX_LINES, MAX_CHARS = 5, 30, 1400
#: one flip per `fix` task: (pattern, replacement), tried in order
FLIPS = ((r" == ", " != "), (r" < ", " <= "), (r" > ", " >= "), (r" \+ 1", " - 1"), (r" and ", " or "),
         (r"\bTrue\b", "False"), (r" is None", " is not None"), (r" not in ", " in "))
EDIT_ASKS = ("with type hints on its parameters and return value", "with clearer names for its local variables",
             "with a comment before each step", "with a short usage example in its docstring")
TOOL_ASKS = ("add type hints to `{name}`", "add a docstring example to `{name}`", "make `{name}` handle empty input",
             "rename the local variables of `{name}` to clearer names", "simplify `{name}`")


@dataclass(frozen=True)
class Function:
    name: str
    signature: str  # "name(a, b)"
    code: str  # dedented source
    doc: str  # the docstring's first sentence
    source: str  # "relative/path.py:LINE"
    file_text: str  # the whole file (the `tool` kind shows part of it)


def functions_of(text: str, rel: str) -> list[Function]:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or node.end_lineno is None:
            continue
        doc = ast.get_docstring(node)
        n = node.end_lineno - node.lineno + 1
        if not doc or not MIN_LINES <= n <= MAX_LINES:
            continue
        code = textwrap.dedent("".join(lines[node.lineno - 1 : node.end_lineno]))
        first = re.split(r"(?<=[.!?])\s", " ".join(doc.split()), maxsplit=1)[0].rstrip(".")
        if len(code) > MAX_CHARS or not code.isascii() or len(first) < 12:
            continue
        args = ", ".join(a.arg for a in node.args.args)
        found.append(Function(node.name, f"{node.name}({args})", code, first, f"{rel}:{node.lineno}", text))
    return found


def _flip(code: str) -> str | None:
    body = code.split('"""')[-1] if code.count('"""') >= 2 else code  # not inside the docstring
    for pattern, repl in FLIPS:
        if re.search(pattern, body):
            head = code[: len(code) - len(body)]
            return head + re.sub(pattern, repl, body, count=1)
    return None


def task_of(fn: Function, kind: str, rng: random.Random) -> dict[str, Any] | None:
    """A chat task ({"name", "kind", "messages"}) of `kind` about `fn`; None when `fn` does not suit it."""
    fence = "```python\n{}```"
    if kind == "write":
        text = f"Write a Python function `{fn.signature}` that does the following: {fn.doc[0].lower()}{fn.doc[1:]}."
    elif kind == "explain":
        text = "Explain what this Python function does:\n\n" + fence.format(fn.code)
    elif kind == "fix":
        broken = _flip(fn.code)
        if broken is None:
            return None
        text = "This function does not do what its docstring says. Find the bug and fix it:\n\n" + fence.format(broken)
    elif kind == "edit":
        ask = rng.choice(EDIT_ASKS)
        text = f"Rewrite this Python function {ask}. Reply with the whole function:\n\n" + fence.format(fn.code)
    elif kind == "complete":
        lines = fn.code.splitlines(keepends=True)
        keep = max(2, len(lines) // 2)
        text = "Complete this Python function:\n\n" + fence.format("".join(lines[:keep]))
    else:
        path = fn.source.rsplit(":", 1)[0]
        ask = rng.choice(TOOL_ASKS).format(name=fn.name)
        call = json.dumps([{"name": "read_file", "arguments": {"path": path}}])
        start = fn.file_text.find(fn.code.splitlines()[0].strip())
        shown = fn.file_text[max(0, start - 600) : start + len(fn.code) + 200]
        return {"name": f"{fn.source}:{kind}", "kind": kind, "messages": [
            {"role": "user", "content": f"Open {path} and {ask}."},
            {"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
            {"role": "tool", "content": shown},
        ]}
    return {"name": f"{fn.source}:{kind}", "kind": kind, "messages": [{"role": "user", "content": text}]}


ANSWERED = ("write", "fix", "complete")  # kinds whose answer is the function as the source has it


def with_answer(task: dict[str, Any], fn: Function) -> dict[str, Any]:
    """`task` about `fn` with the source's own answer appended as the assistant's turn."""
    if task["kind"] not in ANSWERED:
        raise ValueError(f"a {task['kind']!r} task has no answer in the source; --answers takes {', '.join(ANSWERED)}")
    answer = f"```python\n{fn.code.rstrip()}\n```"
    return {**task, "messages": [*task["messages"], {"role": "assistant", "content": answer}]}


def _stable(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")


def _package_file(rel: str, val_fraction: float = 0.02) -> bool:
    """A file of site-packages (path relative to it) that the `packages` split takes."""
    dirs = rel.split("/")[:-1]
    return not any(d in NOT_PACKAGES for d in dirs) and _stable("val:" + rel) / 2**64 >= val_fraction


def source_files(split: str) -> list[tuple[Path, str]]:
    if split in ("train", "val"):
        root = Path(sysconfig.get_paths()["stdlib"])
        return [(p, str(p.relative_to(root))) for p in corpus.stdlib_files()
                if corpus.is_validation(p) == (split == "val")
                and not any(x in ("test", "tests", "idle_test") for x in p.parts)]
    root = Path(sysconfig.get_paths()["purelib"])
    if split == "packages":
        rels = ((p, str(p.relative_to(root))) for p in sorted(root.rglob("*.py")))
        return [(p, rel) for p, rel in rels if _package_file(rel)]
    files = []
    for pkg in HELDOUT_PACKAGES:
        base = root / pkg
        files += [(p, str(p.relative_to(root))) for p in sorted(base.rglob("*.py"))
                  if "tests" not in p.parts and "_vendor" not in p.parts]
    return files


def build_tasks(split: str, count: int, seed: int = 0, kinds: tuple[str, ...] | None = None,
                answers: bool = False) -> list[dict[str, Any]]:
    """`count` tasks, the kinds in turn (default: the chat kinds, or those with answers), at most one function per
    file per kind, reproducibly chosen; with `answers`, each carries the source's own answer (`with_answer`)."""
    if kinds is None:
        kinds = ANSWERED if answers else KINDS
    if not kinds or any(k not in (*KINDS, "edit") for k in kinds):
        raise ValueError(f"--kinds must name some of {', '.join((*KINDS, 'edit'))}, got {','.join(kinds)!r}")
    if answers and any(k not in ANSWERED for k in kinds):
        raise ValueError(f"--answers needs --kinds among {','.join(ANSWERED)} (the source holds no answer to the "
                         f"others), got {','.join(kinds)}")
    if split not in SPLITS:
        raise ValueError(f"--split must be one of {', '.join(SPLITS)}, got {split!r}")
    if count < 1:
        raise ValueError(f"--count must be at least 1, got {count}")
    rng = random.Random(seed)
    per_file = []
    for path, rel in source_files(split):
        fns = functions_of(corpus.read_text(path) or "", rel)
        if fns:
            per_file.append(sorted(fns, key=lambda f: _stable(f.source + str(seed))))
    per_file.sort(key=lambda fns: _stable(fns[0].source + str(seed)))
    tasks: list[dict[str, Any]] = []
    round_ = 0
    while len(tasks) < count and round_ < MAX_LINES:
        for fns in per_file:
            if len(tasks) == count:
                break
            kind = kinds[len(tasks) % len(kinds)]
            if round_ < len(fns) and (task := task_of(fns[round_], kind, rng)) is not None:
                tasks.append(with_answer(task, fns[round_]) if answers else task)
        round_ += 1
    if len(tasks) < count:
        raise ValueError(f"--count {count}: the {split} sources here yield only {len(tasks)} tasks")
    return tasks


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--split", choices=SPLITS, required=True)
    ap.add_argument("--count", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--kinds", default=None, help="task kinds in turn (default: the chat kinds, or with --answers "
                    f"{','.join(ANSWERED)}; the code-editing suite takes fix,edit)")
    ap.add_argument("--answers", action="store_true",
                    help="append the source's own answer as the assistant's turn (real text, not generated)")
    a = ap.parse_args(argv)
    kinds = tuple(k for k in a.kinds.split(",") if k) if a.kinds else None
    tasks = build_tasks(a.split, a.count, a.seed, kinds, a.answers)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    counts = {k: sum(t["kind"] == k for t in tasks) for k in dict.fromkeys(t["kind"] for t in tasks)}
    print(f"wrote {len(tasks)} {a.split} tasks to {a.out}: {counts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The bundled drafter-training prompts: code openings cut from the standard library's training split.

    python -m specserve.train.prompts --out src/specserve/assets/train_prompts.jsonl --count 320
    python -m specserve.train.prompts --kind continuations --out runs/drafters/cont_prompts.jsonl --count 2000

An opening is what the evaluation's coding prompts look like: a `def`/`class` header and its docstring
(methods keep their class's first line), taken from the files the demo target trained on
(`corpus.is_validation` false, test packages left out). At most one opening per file, chosen by a stable
hash, so the set is reproducible for a given interpreter. Nothing comes from the evaluation suites:
openings that share text with `coding10` or `heldout-code` are dropped.

`--kind continuations` cuts mid-file contexts instead: the last ~1200 characters up to a line in a file's middle
third, starting at a line boundary (several cuts per file, from the same training split), so a drafter can also
learn the target's continuations of code in mid-file. They end after the line's newline, or, with
`--cut-kinds after_newline,line_end,mid_line`, at each kind of point served prompts end at (`bench/cuts.py`).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import random
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

from specserve.bench.cuts import CUT_KINDS, code_lines, cut_at, cuttable
from specserve.bench.suites import Task, load_suite
from specserve.train import corpus

MIN_CHARS, MAX_CHARS = 40, 600


@dataclass(frozen=True)
class Opening:
    prompt: str
    source: str  # "relative/path.py:LINE"
    kind: str | None = None  # continuations: where the context was cut (`bench/cuts.py`)


def _openings_of(text: str, rel: str) -> list[Opening]:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    found: list[Opening] = []

    def cut(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef, header: str) -> None:
        doc = node.body[0] if node.body else None
        if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str)):
            return
        assert doc.end_lineno is not None
        body = textwrap.dedent("".join(lines[node.lineno - 1 : doc.end_lineno]))
        prompt = header + (textwrap.indent(body, "    ") if header else body)
        if MIN_CHARS <= len(prompt) <= MAX_CHARS and prompt.isascii():
            found.append(Opening(prompt if prompt.endswith("\n") else prompt + "\n", f"{rel}:{node.lineno}"))

    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            cut(node, "")
        elif isinstance(node, ast.ClassDef):
            cut(node, "")
            head = lines[node.lineno - 1].rstrip() + "\n"
            for sub in node.body:
                if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef) and not sub.name.startswith("__"):
                    cut(sub, head + "\n")
    return found


def _stable(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _clashes(prompt: str, evaluation: list[str]) -> bool:
    return any(prompt in e or e in prompt for e in evaluation)


def evaluation_texts() -> list[str]:
    tasks: list[Task] = [t for s in ("coding10", "coding10-chat", "heldout-code", "heldout-pip") for t in load_suite(s)]
    texts = [t.prompt for t in tasks if t.prompt]
    texts += [str(m.get("content", "")) for t in tasks for m in (t.messages or [])]
    return [t for t in texts if t.strip()]


def build_openings(count: int) -> list[Opening]:
    """`count` openings, one per file at most, from the training split of the standard library."""
    if count < 1:
        raise ValueError(f"--count must be at least 1, got {count}")
    evaluation = evaluation_texts()
    per_file: list[tuple[str, Opening]] = []
    for path, rel in _training_files():
        text = corpus.read_text(path)
        candidates = [o for o in _openings_of(text or "", rel) if not _clashes(o.prompt, evaluation)]
        if candidates:
            per_file.append((_stable(rel), min(candidates, key=lambda o: _stable(o.source))))
    per_file.sort(key=lambda kv: kv[0])
    chosen = [o for _, o in per_file[:count]]
    if len(chosen) < count:
        raise ValueError(f"--count {count}: the standard library here yields only {len(chosen)} openings")
    return sorted(chosen, key=lambda o: o.source)


def _training_files() -> list[tuple[Path, str]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return [(path, str(path.relative_to(root))) for path in corpus.stdlib_files()
            if not corpus.is_validation(path) and not any(p in ("test", "tests", "idle_test") for p in path.parts)]


def build_continuations(count: int, context_chars: int = 1200, seed: int = 0,
                        exclude: frozenset[str] = frozenset(),
                        cut_kinds: tuple[str, ...] = ("after_newline",)) -> list[Opening]:
    """`count` mid-file contexts from the training split, spread over files round-robin; reproducible for a given
    interpreter and seed. Each cut ends at one of `cut_kinds` (`bench/cuts.py`), rotating: after a newline only, or
    also at a line's end and inside a line, as served prompts end. Cuts whose source ("file:line") is in
    `exclude` are left out (to make a set disjoint from an earlier one)."""
    if count < 1:
        raise ValueError(f"--count must be at least 1, got {count}")
    if not cut_kinds or set(cut_kinds) - set(CUT_KINDS):
        raise ValueError(f"--cut-kinds {','.join(cut_kinds)}: give some of {', '.join(CUT_KINDS)}")
    evaluation = evaluation_texts()
    rng = random.Random(seed)
    pools: list[list[Opening]] = []
    for path, rel in _training_files():
        text = corpus.read_text(path)
        if text is None or len(text) < 4 * context_chars:
            continue
        lines = text.splitlines(keepends=True)
        candidates = code_lines(lines)
        rng.shuffle(candidates)
        cuts = []
        for n, i in enumerate(candidates[:8]):
            kind = cut_kinds[(n + len(pools)) % len(cut_kinds)]  # in turn within a file and across files
            if not cuttable(lines[i], kind, context_chars):
                continue
            ctx = cut_at(lines, i, kind, rng, None, context_chars).prompt
            source = f"{rel}:{i + 1}"
            if len(ctx) >= MIN_CHARS and source not in exclude and not _clashes(ctx, evaluation):
                cuts.append(Opening(ctx, source, kind))
        if cuts:
            pools.append(cuts)
    rng.shuffle(pools)
    chosen: list[Opening] = []
    for depth in range(8):
        chosen += [pool[depth] for pool in pools if depth < len(pool)]
    if len(chosen) < count:
        raise ValueError(f"--count {count}: the standard library here yields only {len(chosen)} contexts")
    return sorted(chosen[:count], key=lambda o: o.source)


def write_jsonl(openings: list[Opening], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with tmp.open("w") as fh:
        for o in openings:
            fh.write(json.dumps({"prompt": o.prompt, "source": o.source, **({"kind": o.kind} if o.kind else {})})
                     + "\n")
    tmp.replace(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specserve.train.prompts", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--count", type=int, default=320)
    p.add_argument("--kind", choices=("openings", "continuations"), default="openings")
    p.add_argument("--seed", type=int, default=0, help="continuations: which cuts")
    p.add_argument("--cut-kinds", default="after_newline",
                   help=f"continuations: where contexts end, rotating (comma-separated: {', '.join(CUT_KINDS)})")
    p.add_argument("--exclude", type=Path, nargs="+", default=[],
                   help="continuations: leave out the cuts (same file:line) of these earlier prompts files")
    a = p.parse_args(argv)
    if a.kind == "openings":
        openings = build_openings(a.count)
    else:
        exclude = frozenset(json.loads(line)["source"] for f in a.exclude for line in f.read_text().splitlines())
        openings = build_continuations(a.count, seed=a.seed, exclude=exclude,
                                       cut_kinds=tuple(k for k in a.cut_kinds.split(",") if k))
    write_jsonl(openings, a.out)
    print(json.dumps({"out": str(a.out), "prompts": len(openings), "chars": sum(len(o.prompt) for o in openings)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

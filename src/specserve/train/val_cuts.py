"""`stdlib-val`: the validation contexts training evaluates drafters on, cut at every kind of point.

The files are the standard library's validation split (`corpus.is_validation`): the demo target never trained on
them, nor do drafters' training prompts come from them, and unlike the `heldout-code` suite they may be used to
choose a checkpoint without spending the held-out evaluation on it. Kinds alternate (`bench/cuts.py`), files in
turn, in an order fixed by the seed; each round over the files starts one kind further than the one before, so
that over rounds a file is cut at every kind, whatever the number of files.
"""

from __future__ import annotations

import random

from specserve.bench.cuts import CUT_KINDS, cut_file
from specserve.bench.suites import Task
from specserve.train import corpus

SUITE = "stdlib-val"
MAX_ROUNDS = 8  # passes over the validation files


def validation_cuts(count: int, seed: int = 0) -> list[Task]:
    """`count` contexts from the validation files, kinds in turn (line_end, after_newline, mid_line, ...): one per
    file, then a second round over the files, and so on (the split holds a few dozen files). Round r's first
    context takes kind r % 3, so a file's kind moves on from round to round."""
    files = [f for f in corpus.stdlib_files() if corpus.is_validation(f)]
    rng = random.Random(seed)
    rng.shuffle(files)
    texts = {f: corpus.read_text(f) for f in files}
    tasks: list[Task] = []
    seen: set[str] = set()
    for r in range(MAX_ROUNDS):
        first = len(tasks)
        for f in files:
            if len(tasks) == count:
                return tasks
            kind = CUT_KINDS[(len(tasks) - first + r) % len(CUT_KINDS)]
            text = texts[f]
            cut = cut_file(text, kind, rng) if text else None
            name = f"{f.parent.name}/{f.name}:{cut.line}:{kind}" if cut else ""
            if cut is not None and name not in seen:
                seen.add(name)
                tasks.append(Task(name, cut.prompt, kind=kind))
    if len(tasks) < count:
        raise ValueError(f"--eval-prompts {count}: the validation split yields only {len(tasks)} contexts")
    return tasks


def main(argv: list[str] | None = None) -> int:
    """Write the contexts as a suite file for `specserve bench acceptance --suite FILE`."""
    import argparse
    import json
    from pathlib import Path

    p = argparse.ArgumentParser(prog="python -m specserve.train.val_cuts", description=__doc__)
    p.add_argument("--count", type=int, default=60)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    tasks = validation_cuts(a.count, a.seed)
    a.out.write_text("".join(json.dumps({"name": t.name, "prompt": t.prompt, "kind": t.kind}) + "\n" for t in tasks))
    print(json.dumps({"out": str(a.out), "tasks": len(tasks)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

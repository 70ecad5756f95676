"""Cut the `heldout-code` suite: contexts from third-party packages' source (never in the demo's training data,
which is the standard library only), an equal number at each cut kind of `bench/cuts.py` per package. Run once;
the JSONL is bundled.

    python scripts/make_heldout_suite.py --out src/specserve/assets/suites/heldout_code.jsonl

Each task records its package and version, file and line, cut kind and whether the cut falls inside an identifier.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import random
from pathlib import Path

from specserve.bench.cuts import CUT_KINDS, cut_file

PACKAGES = ("httpx", "openai", "rich", "click", "jinja2", "aiohttp", "pydantic", "pip")


def package_files(name: str) -> tuple[Path, list[Path]]:
    """The package's root and its Python files over 4000 bytes (vendored copies of other packages left out)."""
    mod = importlib.import_module(name)
    root = Path(mod.__file__).parent  # type: ignore[arg-type]
    files = sorted(p for p in root.rglob("*.py") if "_vendor" not in p.parts and p.stat().st_size > 4000)
    return root, files


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--package", action="append", default=[], help=f"repeatable (default: {', '.join(PACKAGES)})")
    ap.add_argument("--per-kind", type=int, default=4, help="tasks of each cut kind per package")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    tasks = []
    for name in a.package or PACKAGES:
        root, files = package_files(name)
        version = importlib.metadata.version(name)
        rng.shuffle(files)
        wanted = [k for _ in range(a.per_kind) for k in CUT_KINDS]  # one file per task, kinds in turn
        for f in files:
            if not wanted:
                break
            cut = cut_file(f.read_text(encoding="utf-8"), wanted[0], rng)
            if cut is None:
                continue
            wanted.pop(0)
            rel = f.relative_to(root.parent)
            tasks.append({"name": f"{rel}:{cut.line}:{cut.kind}", "prompt": cut.prompt, "kind": cut.kind,
                          "in_identifier": cut.in_identifier, "source": f"{name} {version}"})
        if wanted:
            raise SystemExit(f"{name}: too few files for {a.per_kind} tasks of each kind")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    counts = {k: sum(t["kind"] == k for t in tasks) for k in CUT_KINDS}
    print(f"wrote {len(tasks)} tasks to {a.out}: {counts}, {sum(t['in_identifier'] for t in tasks)} inside identifiers")


if __name__ == "__main__":
    main()

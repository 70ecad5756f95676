"""Cut the `heldout-code` suite: contexts from a third-party package's source (never in the demo's
training data, which is the standard library only). Run once; the JSONL is bundled.

    python scripts/make_heldout_suite.py --package pip --num 64 --out src/specserve/assets/suites/heldout_code.jsonl
"""

from __future__ import annotations

import argparse
import importlib
import json
import random
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--package", default="pip")
    ap.add_argument("--num", type=int, default=64)
    ap.add_argument("--context-chars", type=int, default=1200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    mod = importlib.import_module(a.package)
    root = Path(mod.__file__).parent  # type: ignore[arg-type]
    version = getattr(mod, "__version__", "?")
    files = sorted(p for p in root.rglob("*.py") if "_vendor" not in p.parts and p.stat().st_size > 4000)
    rng = random.Random(a.seed)
    rng.shuffle(files)
    tasks = []
    for f in files:
        if len(tasks) >= a.num:
            break
        lines = f.read_text(encoding="utf-8").splitlines(keepends=True)
        # cut after a line that opens a block or a statement in the file's middle third
        candidates = [i for i in range(len(lines) // 3, 2 * len(lines) // 3)
                      if lines[i].strip() and not lines[i].lstrip().startswith("#")]
        if not candidates:
            continue
        cut = rng.choice(candidates) + 1
        text = "".join(lines[:cut])[-a.context_chars:]
        text = text[text.find("\n") + 1:]  # start at a line boundary
        rel = f.relative_to(root.parent)
        tasks.append({"name": f"{rel}:{cut}", "prompt": text, "source": f"{a.package} {version}"})
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    print(f"wrote {len(tasks)} tasks to {a.out}")


if __name__ == "__main__":
    main()

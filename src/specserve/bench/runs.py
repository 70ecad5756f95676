"""Benchmark run JSONs as `bench compare`, its plots, `bench tune` and `deploy` read them.

Two kinds, recognised by their `kind` field or, failing that, their keys:
  serving     `bench serving` output: `levels`, one entry per concurrency.
  acceptance  `bench acceptance` output: {"kind": "acceptance", "tasks": [{"name", "accept_length",
              "spec_tokens_per_s", "plain_tokens_per_s", "speedup"}, ...], "config": {...}}.
A leaf module: the tables (compare.py) and the plots (plots.py) both take `Run`s, neither imports the other for it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KINDS = ("serving", "acceptance")


@dataclass(frozen=True)
class Run:
    label: str
    path: Path
    kind: str
    data: dict[str, Any]

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.path}: run kind must be one of {', '.join(KINDS)}, got {self.kind!r}")


def detect_kind(data: Any, path: Path) -> str:
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    kind = data.get("kind")
    if kind not in KINDS:
        kind = "serving" if "levels" in data else "acceptance" if "tasks" in data else None
    if kind is None:
        raise ValueError(f"{path}: not a serving or acceptance run (needs a 'levels' or 'tasks' list)")
    key = "levels" if kind == "serving" else "tasks"
    entries = data.get(key)
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError(f"{path}: '{key}' must be a list of objects")
    field = "concurrency" if kind == "serving" else "name"
    if any(field not in e for e in entries):
        raise ValueError(f"{path}: every entry of '{key}' needs '{field}'")
    return kind


def load_runs(paths: Sequence[Path], labels: Sequence[str] | None = None) -> list[Run]:
    if labels is not None and len(labels) != len(paths):
        raise ValueError(f"--labels names {len(labels)} runs but {len(paths)} files were given")
    if labels is None:
        stems = [p.stem for p in paths]
        labels = stems if len(set(stems)) == len(stems) else [str(p) for p in paths]
    runs = []
    for path, label in zip(paths, labels, strict=True):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except OSError as e:
            raise ValueError(f"{path}: cannot read ({e.strerror})") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON (line {e.lineno}: {e.msg})") from None
        runs.append(Run(label=label, path=path, kind=detect_kind(data, path), data=data))
    return runs

"""Launch commands of tune candidates on SGLang or vLLM: the deploy engine maps plus the version rules.

`bench tune --engine sglang|vllm` sits below deploy, so it asks this module in a child process, the way it starts
`specserve serve` (one JSON object on stdin, one JSON line per candidate on stdout):

    python -m specserve.deploy.engine_plan < {"engine": "sglang", "version": "0.5.23", "model": "Qwen/Qwen3-8B",
        "host": "127.0.0.1", "page_size": 1, "adaptive": false,
        "candidates": [{"name": "EAGLE3:steps=3", "speculative": {SpeculativeConfig fields}}]}
    -> {"name": ..., "argv": [...], "env": {...}, "notes": [...], "skip": null | "reason"}

The port in argv is 0: the caller puts a free one in its place at launch.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from typing import Any

from specserve.config import SpeculativeConfig
from specserve.deploy.engine_map import build_command
from specserve.deploy.engine_rules import judge
from specserve.deploy.known_flags import load_engine_flags
from specserve.engine.engine_config import EngineConfig
from specserve.server.serve_config import ServeConfig


@dataclass(frozen=True)
class Planned:
    name: str
    argv: list[str] | None
    env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    skip: str | None = None


def plan_one(engine: str, version: str | None, model: str, spec: SpeculativeConfig, host: str = "127.0.0.1",
             page_size: int = 1, adaptive: bool = False, name: str = "") -> Planned:
    """The engine command of one configuration, or why this release cannot run it."""
    verdict = judge(engine, version, spec, page_size, adaptive)
    if verdict.skip:
        return Planned(name, None, notes=list(verdict.notes), skip=verdict.skip)
    cfg = ServeConfig(model=model, host=host, port=0, speculative=spec, speculative_adaptive=adaptive,
                      engine=EngineConfig(kv_block_size=page_size))
    try:
        cmd = build_command(load_engine_flags(engine), cfg, model, spec.draft_model_path)
    except (ValueError, KeyError) as e:
        return Planned(name, None, notes=list(verdict.notes), skip=f"no {engine} command for it: {e}")
    notes = list(verdict.notes) + [f"{u.flag} {u.value}: {u.reason}" for u in cmd.unmapped
                                   if u.flag.startswith("--speculative") and u.flag != "--speculative-draft-dtype"]
    return Planned(name, list(cmd.argv), {**dict(cmd.env), **dict(verdict.env)}, notes)


def plan(request: dict[str, Any]) -> list[Planned]:
    return [plan_one(request["engine"], request.get("version"), request["model"],
                     SpeculativeConfig(**c["speculative"]), request.get("host", "127.0.0.1"),
                     int(request.get("page_size", 1)), bool(request.get("adaptive", False)), c["name"])
            for c in request["candidates"]]


def main() -> int:
    try:
        planned = plan(json.load(sys.stdin))
    except (ValueError, KeyError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for p in planned:
        print(json.dumps({"name": p.name, "argv": p.argv, "env": p.env, "notes": p.notes, "skip": p.skip}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

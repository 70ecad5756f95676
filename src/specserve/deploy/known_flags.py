"""The SGLang and vLLM launch flags `deploy export` may emit, read from `assets/engine_flags.json`.

The data names the engine sources it was checked against; `check_command` is the gate every exported
command passes: an unknown flag, or a value outside a flag's known choices, is an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parent.parent / "assets" / "engine_flags.json"
ENGINES = ("sglang", "vllm")


@dataclass(frozen=True)
class EngineFlags:
    engine: str
    launcher: tuple[str, ...]
    checked_against: dict[str, Any]
    flags: frozenset[str]
    values: dict[str, tuple[str, ...]]
    speculative_config_keys: frozenset[str]
    speculative_methods: tuple[str, ...]
    health_path: str
    drafter_fields: dict[str, tuple[str, ...]]  # EAGLE3 | DFLASH | DFLASH2 (a DFlash 2 drafter) -> config.json fields

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"--engine {self.engine!r}: use one of {', '.join(ENGINES)}")
        unknown = sorted(set(self.values) - self.flags)
        if unknown:
            raise ValueError(f"{DATA}: values given for flags that are not listed: {unknown}")


def load_engine_flags(engine: str, path: Path = DATA) -> EngineFlags:
    if engine not in ENGINES:
        raise ValueError(f"--engine {engine!r}: use one of {', '.join(ENGINES)}")
    raw = json.loads(path.read_text())
    data = raw[engine]
    fields = {algo: tuple(per_engine[engine]) for algo, per_engine in raw["drafter_config_fields"].items()
              if not algo.startswith("_")}
    return EngineFlags(
        engine=engine, launcher=tuple(data["launcher"]), checked_against=dict(data["checked_against"]),
        flags=frozenset(data["flags"]), values={k: tuple(v) for k, v in data.get("values", {}).items()},
        speculative_config_keys=frozenset(data.get("speculative_config_keys", ())),
        speculative_methods=tuple(data.get("speculative_methods", ())), health_path=str(data["health_path"]),
        drafter_fields=fields,
    )


def check_command(known: EngineFlags, argv: list[str]) -> None:
    """Every `--flag` after the launcher must be known, with a known value where the data lists choices."""
    if tuple(argv[: len(known.launcher)]) != known.launcher:
        raise ValueError(f"{known.engine} command must start with {' '.join(known.launcher)}: {argv[:3]}")
    args = argv[len(known.launcher):]
    for i, token in enumerate(args):
        if not token.startswith("--"):
            continue
        if token not in known.flags:
            raise ValueError(f"{token} is not a known {known.engine} flag (see {DATA.name}); not exported")
        choices = known.values.get(token)
        if choices is not None and (i + 1 >= len(args) or args[i + 1] not in choices):
            value = args[i + 1] if i + 1 < len(args) else None
            raise ValueError(f"{known.engine} {token} {value!r} is not one of the known values {list(choices)}")
        if token == "--speculative-config":
            spec = json.loads(args[i + 1])
            extra = sorted(set(spec) - known.speculative_config_keys)
            if extra:
                raise ValueError(f"--speculative-config keys {extra} are not known vLLM SpeculativeConfig fields")
            if spec.get("method") not in known.speculative_methods:
                raise ValueError(f"--speculative-config method {spec.get('method')!r} is not a known vLLM method")


def missing_fields(config: dict[str, Any], fields: tuple[str, ...]) -> list[str]:
    """The dotted `fields` absent from a drafter's config.json."""
    missing = []
    for name in fields:
        node: Any = config
        for part in name.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is None:
            missing.append(name)
    return missing

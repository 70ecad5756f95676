"""`deploy freeze --from-tune tune.json --concurrency N [--engine sglang|vllm]`: the configuration a `bench tune`
picked, frozen for the engine it was tuned on.

The winner's flags at concurrency N (specserve serve flags, as tune.json keeps them) replace the speculative
keys of `--config` (which keeps the rest: model, API key, tool-call parser, hierarchical cache, port); the
result is DIR/tuned.yaml. For specserve it is frozen as `deploy freeze` always does (with tune.json as the
evidence). For SGLang/vLLM it is exported (`deploy export`: launch.sh, the unit, EXPORT.md, export.json) and
DIR/production.md says what was picked and why; before anything is written, the version rules
(`engine_rules.py`) are asked whether that release's parser accepts the command: it refuses when not, or with
`--force` writes it and warns loudly, in the output and in production.md.
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from specserve.deploy.engine_rules import NAMES, NEWEST, judge
from specserve.deploy.freeze import load_serve_config, write_file
from specserve.server.serve_config import read_config_file


@dataclass(frozen=True)
class TunedPick:
    engine: str
    engine_version: str | None
    config: str
    flags: dict[str, Any]
    winner: dict[str, Any]


def pick_from_tune(path: Path, concurrency: int) -> TunedPick:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--from-tune {path}: cannot read a tune report ({e})") from None
    if not isinstance(data, dict) or data.get("kind") != "tune":
        raise ValueError(f"--from-tune {path}: not a `bench tune` tune.json")
    winners = {int(w["concurrency"]): w for w in data.get("winners") or []}
    w = winners.get(concurrency)
    if w is None or not w.get("config"):
        have = ", ".join(str(c) for c, x in sorted(winners.items()) if x.get("config")) or "none"
        raise ValueError(f"--concurrency {concurrency}: the tune has no winner there (levels with one: {have})")
    return TunedPick(str(data.get("engine") or "specserve"), data.get("engine_version"), str(w["config"]),
                     dict(w["flags"]), w)


def tuned_yaml(config: Path, pick: TunedPick) -> str:
    """--config with its speculative keys replaced by the winner's flags."""
    base = {k: v for k, v in read_config_file(config).items()
            if not k.replace("_", "-").startswith("speculative-") or k.replace("_", "-").startswith(
                "speculative-adaptive")}
    merged = {**base, **{str(k).lstrip("-"): v for k, v in pick.flags.items()}}
    return (f"# {config.resolve()} with the `bench tune` winner {pick.config} at concurrency "
            f"{pick.winner['concurrency']}\n" + yaml.safe_dump(merged, sort_keys=False))


def freeze_tuned(config: Path, tune: Path, concurrency: int, out: Path, engine: str | None = None,
                 engine_version: str | None = None, force: bool = False, hierarchical_cache: bool = False,
                 warn: Any = None) -> dict[str, Any]:
    """Write DIR for the tuned configuration; ValueError (nothing written) when it cannot be frozen."""
    warn = warn or (lambda msg: print(msg, file=sys.stderr))
    if not config.is_file():
        raise ValueError(f"--config {config}: no such file")
    pick = pick_from_tune(tune, concurrency)
    engine = engine or pick.engine
    if engine != pick.engine:
        raise ValueError(f"--engine {engine}: {tune} was tuned on {pick.engine}; freeze for that engine or tune "
                         f"again with --engine {engine}")
    text = tuned_yaml(config, pick)
    with tempfile.TemporaryDirectory() as tmp:  # checked before DIR is touched
        probe = Path(tmp) / "tuned.yaml"
        probe.write_text(text, encoding="utf-8")
        cfg = load_serve_config(probe)
    version = engine_version or pick.engine_version
    warning = None
    if engine != "specserve":
        verdict = judge(engine, version, cfg.speculative, cfg.engine.kv_block_size, cfg.speculative_adaptive)
        release = f"{NAMES[engine]} {version or NEWEST[engine]}"
        if verdict.rejected and not force:
            raise ValueError(f"{release} would not run this export: {verdict.skip}; give --engine-version of the "
                             "release you deploy, change the configuration, or --force to write it anyway")
        if verdict.skip:
            warning = (f"WARNING: {release}'s parser will reject this command: {verdict.skip}" if verdict.rejected
                       else f"WARNING: {release} will not run this as measured: {verdict.skip}")
            warn(warning)
    out.mkdir(parents=True, exist_ok=True)
    write_file(out / "tuned.yaml", text)
    if engine == "specserve":
        from specserve.deploy.freeze import FreezeConfig, freeze

        return freeze(FreezeConfig(config=out / "tuned.yaml", out=out, bench=(tune,)))
    from specserve.deploy.export import EngineExportConfig, export_engine

    facts = export_engine(EngineExportConfig(engine=engine, config=out / "tuned.yaml", out=out,
                                             hierarchical_cache=hierarchical_cache))
    write_file(out / "production.md", _production(engine, version, pick, facts, warning, tune))
    return {**facts, "tuned_from": str(tune), "picked": pick.config, "engine_version": version, "warning": warning}


def _production(engine: str, version: str | None, pick: TunedPick, facts: dict[str, Any], warning: str | None,
                tune: Path) -> str:
    w = pick.winner
    ratio = "-" if w.get("ratio_to_baseline") is None else f"{w['ratio_to_baseline']:.2f}x"
    tok = "-" if w.get("output_tok_s") is None else f"{w['output_tok_s']:.1f}"
    lines = [f"# Production: {engine} {version or '(version not given)'}", ""]
    if warning:
        lines += [f"**{warning}**", ""]
    lines += [f"Picked by `bench tune` ({tune.resolve()}): `{pick.config}` at concurrency {w['concurrency']}, "
              f"{tok} output tok/s, {ratio} the plain-decoding baseline.", "",
              f"Unit `{facts['unit']}` runs `{facts['launch']}`; health {facts['health_url']}.", "",
              "```sh", " ".join(facts["argv"]), "```", "",
              "Flag mapping, flags without an equivalent and the sources checked: EXPORT.md.", ""]
    unmapped = [f"- `{u['flag']} {u['value']}`: {u['reason']}" for u in facts["unmapped"]]
    lines += ["## Without an equivalent", "", *(unmapped or ["- none"])]
    return "\n".join(lines) + "\n"

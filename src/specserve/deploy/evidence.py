"""The benchmark runs behind a frozen configuration: which run is plain decoding, which is the frozen
speculative configuration, the per-concurrency comparison, and the limits the numbers show.

Inputs (`--bench`, any number, any order):
  serving     `specserve bench serving` runs. A run is plain decoding when the server reported
              `speculative.algorithm == "NONE"` (specserve's /server_info) or `speculative_algorithm` null
              (SGLang's), or, when it reported neither, when no level has an accept length.
  acceptance  `specserve bench acceptance` runs: accept length and speedup per task.
  tune        `specserve bench tune` output (`DIR/tune.json`): its configs' runs (paths relative to the file)
              join the serving runs under the config's name; `baseline` names the plain-decoding config.
Every figure comes from the files; nothing is estimated.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from specserve.bench.runs import detect_kind
from specserve.config import SpeculativeConfig


@dataclass(frozen=True)
class ServingRun:
    label: str
    path: Path
    algorithm: str  # "NONE" = plain decoding; "unknown" when the server did not say
    speculative: dict[str, Any] | None  # the server's speculative configuration, when it reported one
    levels: dict[int, dict[str, Any]]
    bench: dict[str, Any]  # the run's `config` (output length, temperature, prompts per level ...)
    dataset: str | None
    device: str | None


@dataclass(frozen=True)
class AcceptanceRun:
    label: str
    path: Path
    speculative: dict[str, Any] | None
    tasks: tuple[dict[str, Any], ...]
    summary: dict[str, Any]
    config: dict[str, Any]


@dataclass(frozen=True)
class TuneResult:
    path: Path
    baseline: str
    winners: tuple[dict[str, Any], ...]
    frozen_config: str | None  # the tuned config matching the frozen flags, if any


@dataclass(frozen=True)
class LevelRow:
    concurrency: int
    plain_tok_s: float | None
    spec_tok_s: float | None
    ratio: float | None
    ttft_plain_ms: float | None
    ttft_spec_ms: float | None
    tpot_plain_ms: float | None
    tpot_spec_ms: float | None
    accept_length: float | None
    failed: int


@dataclass(frozen=True)
class Evidence:
    baseline: ServingRun | None
    speculative: ServingRun | None
    rows: tuple[LevelRow, ...]
    acceptance: tuple[AcceptanceRun, ...]
    tune: TuneResult | None
    notes: tuple[str, ...]


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _p50(level: dict[str, Any] | None, key: str) -> float | None:
    stats = (level or {}).get(key)
    return _num(stats.get("p50")) if isinstance(stats, dict) else None


def _serving_run(data: dict[str, Any], path: Path, label: str) -> ServingRun:
    info = (data.get("server") or {}).get("info")
    info = info if isinstance(info, dict) else {}
    levels = {int(lv["concurrency"]): lv for lv in data["levels"]}
    spec = info.get("speculative") if isinstance(info.get("speculative"), dict) else None
    if spec is not None:
        algorithm = str(spec.get("algorithm", "unknown")).upper()
    elif "speculative_algorithm" in info:
        algorithm = str(info["speculative_algorithm"] or "NONE").upper()
    else:
        algorithm = "NONE" if all(lv.get("accept_length") is None for lv in levels.values()) else "unknown"
    device = info.get("device") if isinstance(info.get("device"), str) else None
    dataset = (data.get("dataset") or {}).get("name") if isinstance(data.get("dataset"), dict) else None
    return ServingRun(label, path, algorithm, spec, levels, dict(data.get("config") or {}), dataset, device)


def _read(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"--bench {path}: cannot read ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--bench {path}: invalid JSON (line {e.lineno}: {e.msg})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--bench {path}: expected a JSON object")
    return data


def _flag_matches(frozen: dict[str, Any], flags: dict[str, Any]) -> bool:
    for key, value in flags.items():
        have = frozen.get(str(key).lstrip("-").replace("-", "_"))
        if str(have).upper() != str(value).upper():
            return False
    return True


def _same_spec(reported: dict[str, Any] | None, spec: SpeculativeConfig) -> bool:
    if reported is None:
        return False
    want = {k: v for k, v in asdict(spec).items() if k != "draft_model_path"}
    return all(reported.get(k) == v for k, v in want.items())


def load_evidence(paths: Sequence[Path], frozen: dict[str, Any], spec: SpeculativeConfig) -> Evidence:
    """`frozen`: the frozen serve configuration by flag dest (speculative_algorithm, ...)."""
    serving: list[ServingRun] = []
    acceptance: list[AcceptanceRun] = []
    tune: TuneResult | None = None
    notes: list[str] = []
    baseline_names: set[str] = set()
    for path in paths:
        data = _read(path)
        if data.get("kind") == "tune":
            configs = [c for c in data.get("configs") or [] if isinstance(c, dict) and "name" in c]
            base = str(data.get("baseline", "NONE"))
            match = next((c["name"] for c in configs if c["name"] != base
                          and _flag_matches(frozen, dict(c.get("flags") or {}))), None)
            tune = TuneResult(path, base, tuple(w for w in data.get("winners") or [] if isinstance(w, dict)), match)
            for c in configs:
                run_path = path.parent / str(c.get("run", ""))
                if not run_path.is_file():
                    notes.append(f"{path.name}: run {c.get('run')!r} of config {c['name']!r} is missing; ignored")
                    continue
                run = _read(run_path)
                if detect_kind(run, run_path) != "serving":
                    raise ValueError(f"--bench {path}: {run_path.name} (config {c['name']!r}) is not a serving run")
                serving.append(_serving_run(run, run_path, str(c["name"])))
                if c["name"] == base:
                    baseline_names.add(str(c["name"]))
            continue
        kind = detect_kind(data, path)
        if kind == "serving":
            serving.append(_serving_run(data, path, path.stem))
        else:
            cfg = dict(data.get("config") or {})
            acceptance.append(AcceptanceRun(path.stem, path, cfg.get("speculative"), tuple(data["tasks"]),
                                            dict(data.get("summary") or {}), cfg))
    plain = [r for r in serving if r.algorithm == "NONE" or r.label in baseline_names]
    specs = [r for r in serving if r not in plain]
    baseline = plain[0] if plain else None
    matching = [r for r in specs if _same_spec(r.speculative, spec)]
    if tune is not None and tune.frozen_config is not None:
        matching = [r for r in specs if r.label == tune.frozen_config] + matching
    chosen = matching[0] if matching else (specs[0] if specs else None)
    if chosen is not None and not matching and spec.enabled:
        notes.append(f"{chosen.path.name}: the server's speculative configuration does not match the frozen one "
                     f"exactly ({chosen.speculative}); its figures are shown as the closest measurement given")
    if not spec.enabled:
        chosen = None  # a plain deployment: the baseline run is the measurement
    for r in acceptance:
        if spec.enabled and r.speculative is not None and not _same_spec(r.speculative, spec):
            notes.append(f"{r.path.name}: measured with a different speculative configuration ({r.speculative})")
    return Evidence(baseline, chosen, _rows(baseline, chosen), tuple(acceptance), tune, tuple(notes))


def _rows(baseline: ServingRun | None, spec: ServingRun | None) -> tuple[LevelRow, ...]:
    levels = sorted(set(baseline.levels if baseline else {}) | set(spec.levels if spec else {}))
    rows = []
    for c in levels:
        p = baseline.levels.get(c) if baseline else None
        s = spec.levels.get(c) if spec else None
        plain, fast = _num((p or {}).get("output_throughput")), _num((s or {}).get("output_throughput"))
        rows.append(LevelRow(
            concurrency=c, plain_tok_s=plain, spec_tok_s=fast,
            ratio=fast / plain if plain and fast is not None else None,
            ttft_plain_ms=_p50(p, "ttft_ms"), ttft_spec_ms=_p50(s, "ttft_ms"),
            tpot_plain_ms=_p50(p, "tpot_ms"), tpot_spec_ms=_p50(s, "tpot_ms"),
            accept_length=_num((s or {}).get("accept_length")),
            failed=int((p or {}).get("errors") or 0) + int((s or {}).get("errors") or 0),
        ))
    return tuple(rows)


def known_limits(ev: Evidence, speculative: bool) -> list[str]:
    """Plain statements of what the measurements show against this deployment."""
    out: list[str] = []
    if speculative and ev.speculative is None:
        out.append("No serving run of a speculative configuration was given: throughput of this deployment is "
                   "unmeasured.")
    if ev.baseline is None:
        out.append("No plain-decoding run (speculative-algorithm NONE) was given: the cost or gain of speculation "
                   "against plain decoding is unmeasured.")
    for r in ev.rows:
        if r.ratio is not None and r.ratio < 1:
            out.append(f"Speculation costs {100 * (1 - r.ratio):.1f}% of output throughput at concurrency "
                       f"{r.concurrency} ({r.spec_tok_s:.1f} vs {r.plain_tok_s:.1f} tok/s with plain decoding).")
        if r.ttft_spec_ms is not None and r.ttft_plain_ms and r.ttft_spec_ms > 1.05 * r.ttft_plain_ms:
            out.append(f"Time to first token (p50) is {100 * (r.ttft_spec_ms / r.ttft_plain_ms - 1):.1f}% higher "
                       f"than plain decoding at concurrency {r.concurrency} ({r.ttft_spec_ms:.1f} vs "
                       f"{r.ttft_plain_ms:.1f} ms).")
        if r.failed:
            out.append(f"{r.failed} request(s) failed at concurrency {r.concurrency} in the measured runs.")
    if ev.rows:
        out.append(f"Measured at concurrency {', '.join(str(r.concurrency) for r in ev.rows)} only; behaviour at "
                   f"other loads (above {ev.rows[-1].concurrency} in particular) is unmeasured.")
    for run in ev.acceptance:
        tasks = [t for t in run.tasks if _num(t.get("accept_length")) is not None]
        for t in run.tasks:
            speedup = _num(t.get("speedup"))
            if speedup is not None and speedup < 1:
                out.append(f"Task {t.get('name')}: speculation is slower than plain decoding (speedup "
                           f"{speedup:.2f}x, accept length {_num(t.get('accept_length')) or 0:.2f}).")
        if len(tasks) > 1:
            worst = min(tasks, key=lambda t: float(t["accept_length"]))
            out.append(f"Lowest acceptance in {run.path.name}: task {worst.get('name')} (accept length "
                       f"{float(worst['accept_length']):.2f}); prompts like it gain least.")
    devices = sorted({r.device for r in (ev.baseline, ev.speculative) if r is not None and r.device})
    if devices:
        out.append(f"Measured on {', '.join(devices)}; other hardware or batch mixes change these figures.")
    return out

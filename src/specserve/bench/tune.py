"""`specserve bench tune`: serve each configuration of a grid, sweep it, name the winner per concurrency.

    specserve bench tune --model demo --concurrency 1,8,32 --out-dir tune/ \\
        --grid "EAGLE3:steps=3,5;topk=1,4;draft=4,8 DFLASH:tree=ddtree;draft=8,16 NGRAM:draft=8,12 NONE"

Grid: algorithms separated by spaces; after `ALGO:` come `key=v1,v2` lists joined by `;`, expanded
to their cartesian product. Keys (SGLang/specserve flags): steps, topk, draft, block (DFLASH only),
tree, path (the draft model; no spaces, commas or semicolons in it). NONE takes no keys and is
always run, first, as the baseline. A combination `SpeculativeConfig` rejects is skipped with a
note; a chain (topk 1) whose draft is not steps+1 gets draft = steps+1, with a note.

Each configuration: `specserve serve` on 127.0.0.1 with a free port (log in DIR/NN-NAME.server.log),
/health awaited, `bench serving --continuous-usage` run against it (DIR/NN-NAME.json), SIGTERM
(kill after 30 s).
A server that does not come up is reported with its log tail and the tune goes on.
DIR/tune.json (for the deploy step: each config's `flags` are `specserve serve --config` YAML keys)
and DIR/tune.md: the winner per concurrency by output tok/s and its ratio to NONE, then the tables.
Exit codes: 0 all configurations ran; 1 some failed (files still written); 2 unusable input.

`--engine sglang|vllm` serves each configuration with that engine instead (`engine_launch.py`: `--launcher`,
`--engine-version`, the commands from the deploy engine maps and the engine's version rules, printed as notes
before anything starts); a configuration the release cannot run is skipped with the reason, and a grid key the
engine has no flag for is an error. There the baseline must come up: when it does not (a launcher that exits at
once, a wrong model), the tune stops with exit 2 and removes what it wrote. `--dry-run` prints one JSON object a
line, `{"name", "argv", "env", "notes"}` (plus `"skipped"` with the reason), and launches nothing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from specserve.bench import engine_launch
from specserve.bench.compare import serving_section
from specserve.bench.runs import Run
from specserve.bench.serving_cli import add_serving_parser, cmd_serving
from specserve.cli_args import add_model_args, add_speculative_args, speculative_from_args
from specserve.config import ALGORITHMS, TREES, SpeculativeConfig

BASELINE = "NONE"
FLAGS: dict[str, str] = {"steps": "speculative-num-steps", "topk": "speculative-eagle-topk",
                         "draft": "speculative-num-draft-tokens", "block": "speculative-dflash-block-size",
                         "tree": "speculative-tree", "path": "speculative-draft-model-path"}
CHAIN_ALGORITHMS = ("EAGLE3", "STANDALONE")  # where topk 1 forces draft = steps + 1


@dataclass(frozen=True)
class GridEntry:
    algorithm: str
    values: tuple[tuple[str, tuple[str, ...]], ...]  # (key, candidate values) in the order given


@dataclass(frozen=True)
class Candidate:
    name: str  # `ALGO:key=v;...` with the values actually served
    flags: tuple[tuple[str, str | int], ...]  # (flag name without dashes, value), algorithm first
    speculative: SpeculativeConfig

    def tokens(self) -> list[str]:
        return [t for flag, value in self.flags for t in (f"--{flag}", str(value))]


def parse_grid(text: str) -> list[GridEntry]:
    """The grid string's entries; ValueError naming the bad part."""
    entries: list[GridEntry] = []
    for part in text.split():
        algo, _, rest = part.partition(":")
        algo = algo.upper()
        if algo not in ALGORITHMS:
            raise ValueError(f"--grid {part!r}: unknown algorithm {algo!r}; use one of {', '.join(ALGORITHMS)}")
        values: list[tuple[str, tuple[str, ...]]] = []
        for item in filter(None, rest.split(";")):
            key, eq, raw = item.partition("=")
            options = tuple(v for v in raw.split(",") if v)
            if not eq or not options:
                raise ValueError(f"--grid {part!r}: expected key=v1,v2 after {algo}:, got {item!r}")
            if key not in FLAGS:
                raise ValueError(f"--grid {part!r}: unknown key {key!r}; use {', '.join(FLAGS)}")
            if algo == BASELINE or (key == "block" and algo != "DFLASH"):
                raise ValueError(f"--grid {part!r}: {algo} takes no {key!r} (block is DFLASH-only, NONE takes no keys)")
            if key in dict(values):
                raise ValueError(f"--grid {part!r}: key {key!r} given twice")
            bad = [v for v in options if (v not in TREES if key == "tree" else key != "path" and not v.isdigit())]
            if bad:
                expected = f"one of {', '.join(TREES)}" if key == "tree" else "a positive integer"
                raise ValueError(f"--grid {part!r}: {key}={bad[0]} must be {expected}")
            values.append((key, options))
        entries.append(GridEntry(algo, tuple(values)))
    if not entries:
        raise ValueError("--grid is empty; e.g. --grid \"NGRAM:draft=8,12 NONE\"")
    return entries


def _label(algorithm: str, combo: dict[str, str]) -> str:
    return algorithm + (":" + ";".join(f"{k}={v}" for k, v in combo.items()) if combo else "")


def _resolve(model: str, algorithm: str, combo: dict[str, str]) -> Candidate:
    """The candidate, its flags read by the server's own parser (so the server's defaults apply)."""
    flags: list[tuple[str, str | int]] = [("speculative-algorithm", algorithm)]
    flags += [(FLAGS[k], v if k in ("path", "tree") else int(v)) for k, v in combo.items()]
    parser = argparse.ArgumentParser(add_help=False)
    add_model_args(parser)
    add_speculative_args(parser)
    tokens = [t for flag, value in flags for t in (f"--{flag}", str(value))]
    spec = speculative_from_args(parser.parse_args(["--model", model, *tokens]))
    return Candidate(_label(algorithm, combo), tuple(flags), spec)


def plan_grid(entries: Sequence[GridEntry], model: str) -> tuple[list[Candidate], list[str]]:
    """The configurations to serve (NONE first, duplicates dropped) and notes on what was skipped or changed."""
    candidates: list[Candidate] = []
    notes: list[str] = []
    seen: set[str] = set()
    all_entries = [GridEntry(BASELINE, ()), *(e for e in entries if e.algorithm != BASELINE)]
    for entry in all_entries:
        keys = [k for k, _ in entry.values]
        for choice in itertools.product(*(options for _, options in entry.values)):
            combo = dict(zip(keys, choice, strict=True))
            if (entry.algorithm in CHAIN_ALGORITHMS and combo.get("topk", "1") == "1" and "steps" in combo
                    and "draft" in combo and int(combo["draft"]) != int(combo["steps"]) + 1):
                fixed = str(int(combo["steps"]) + 1)
                note = (f"{entry.algorithm} steps={combo['steps']} topk=1 is a chain that verifies steps+1 tokens: "
                        f"draft={combo['draft']} became draft={fixed}")
                notes.extend([note] if note not in notes else [])
                combo["draft"] = fixed
            label = _label(entry.algorithm, combo)
            if label in seen:
                continue
            seen.add(label)
            try:
                candidates.append(_resolve(model, entry.algorithm, combo))
            except ValueError as e:
                notes.append(f"skipped {label}: {e}")
    return candidates, notes


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def log_tail(path: Path, lines: int = 20) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def start_server(model: str, extra: Sequence[str], log: Path, timeout_s: float,
                 env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """`specserve serve` on a free port, once /health answers 200; RuntimeError with the log tail otherwise.
    `env`: the server's environment (default: this process's)."""
    port = free_port()
    cmd = [sys.executable, "-m", "specserve.server.cli", "--model", model, *extra, "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "warning", "--no-background-compile"]  # timed: compiled first
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    return engine_launch.wait_healthy(proc, url, timeout_s, stop_server), url


def stop_server(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
        try:
            proc.wait(timeout=max(grace_s, 1.0))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def pick_winners(outcomes: Sequence[dict[str, Any]], concurrencies: Sequence[int]) -> list[dict[str, Any]]:
    """Per concurrency the config with the highest output tok/s (first wins a tie) and its ratio to NONE.

    `outcomes`: {"name", "flags", "levels": {concurrency: output tok/s or None}}, baseline named NONE."""
    base = next((o for o in outcomes if o["name"] == BASELINE), None)
    winners = []
    for c in concurrencies:
        scored = [(o["levels"].get(c), o) for o in outcomes]
        valid = [(v, o) for v, o in scored if v is not None]
        base_tps = base["levels"].get(c) if base else None
        if not valid:
            winners.append({"concurrency": c, "config": None, "flags": None, "output_tok_s": None,
                            "baseline_output_tok_s": base_tps, "ratio_to_baseline": None})
            continue
        best, top = max(valid, key=lambda pair: pair[0])  # max keeps the first of equal values
        winners.append({"concurrency": c, "config": top["name"], "flags": top["flags"], "output_tok_s": best,
                        "baseline_output_tok_s": base_tps,
                        "ratio_to_baseline": best / base_tps if base_tps else None})
    return winners


def _level_throughputs(run: dict[str, Any]) -> dict[int, float | None]:
    return {lv["concurrency"]: lv["output_throughput"] if lv.get("completed") else None for lv in run["levels"]}


def render_markdown(report: dict[str, Any], runs: list[Run]) -> str:
    def num(v: float | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    lines = ["# specserve bench tune", "", f"Model `{report['model']}`, dataset {report['dataset']}, "
             f"output length {report['output_len']}, temperature {report['temperature']}. Baseline: {BASELINE}.",
             "", "## Winner per concurrency (output tok/s)", "",
             "| concurrency | winner | output tok/s | NONE tok/s | ratio to NONE |", "|---|---|---|---|---|"]
    for w in report["winners"]:
        lines.append(f"| {w['concurrency']} | {w['config'] or '-'} | {num(w['output_tok_s'], '.1f')} | "
                     f"{num(w['baseline_output_tok_s'], '.1f')} | {num(w['ratio_to_baseline'], '.2f')}× |")
    lines.append("")
    if report["notes"]:
        lines += ["## Notes", "", *(f"- {n}" for n in report["notes"]), ""]
    for cfg in report["configs"]:
        if cfg["error"]:
            lines += [f"**{cfg['name']} failed:** {cfg['error']}", "", "```", cfg["log_tail"] or "(empty log)",
                      "```", ""]
    if runs:
        lines += serving_section(runs)
    lines += ["", f"Command line: `{shlex.join(report['command_line'])}`"]
    return "\n".join(lines).rstrip() + "\n"


def _serving_namespace(tokens: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="specserve bench")
    add_serving_parser(parser.add_subparsers(dest="bench_command", required=True))
    return parser.parse_args(["serving", *tokens])


def add_engine_args(t: argparse.ArgumentParser) -> None:
    """The engine options of `bench tune` (which engine serves the grid, how it starts, --dry-run)."""
    t.add_argument("--engine", choices=engine_launch.ENGINES, default="specserve",
                   help="the server each configuration runs on (its flags mapped by the deploy engine maps)")
    t.add_argument("--launcher", default=None,
                   help='how the engine starts: a prefix such as "/opt/sglang/bin/python", "docker run ... IMAGE" or '
                        '"ssh gpu-host" (sglang/vllm only)')
    t.add_argument("--engine-version", default=None, help="the engine release (default: asked of the launcher)")
    t.add_argument("--engine-host", default="127.0.0.1", help="address the engine binds and the sweep reaches")
    t.add_argument("--page-size", type=int, default=None,
                   help="tokens per KV page of sglang/vllm (default: the engine's, 1 for SGLang, 16 for vLLM)")
    t.add_argument("--version-timeout", type=float, default=60.0, help="seconds the version question may take")
    t.add_argument("--dry-run", action="store_true", help="print each configuration's command as JSON; launch none")


def _engine_defaults(entries: list[GridEntry], engine: str) -> list[GridEntry]:
    """specserve's default shapes the engine has not: DFLASH verifies its block as a chain on both engines (not a
    DDTree), vLLM's ngram drafts a chain (not a tree of matches). Only where the grid gave no tree."""
    chain = ("DFLASH",) if engine == "sglang" else ("DFLASH", "NGRAM") if engine == "vllm" else ()
    return [GridEntry(e.algorithm, (*e.values, ("tree", ("chain",))))
            if e.algorithm in chain and "tree" not in dict(e.values) else e for e in entries]


def _specserve_argv(args: argparse.Namespace, cand: Candidate) -> list[str]:
    return [sys.executable, "-m", "specserve.server.cli", "--model", args.model, "--device", args.device, "--dtype",
            args.dtype, "--quantization", args.quantization, *cand.tokens(),
            "--host", "127.0.0.1", "--port", "0", "--log-level", "warning",
            "--no-background-compile"]  # the timed runs meet the compiled steps


def plan_launches(args: argparse.Namespace, candidates: list[Candidate],
                  notes: list[str]) -> tuple[list[dict[str, Any]], str | None]:
    """Per configuration {"name", "argv" (port 0), "env", "notes", "candidate"} or {..., "skipped": reason}, and the
    engine version; the engine's notes and skips are added to `notes`."""
    if args.engine == "specserve":
        if args.launcher or args.engine_version or args.page_size:
            raise ValueError("--launcher, --engine-version and --page-size are for --engine sglang|vllm")
        return [{"name": c.name, "argv": _specserve_argv(args, c), "env": {}, "notes": [], "candidate": c}
                for c in candidates], None
    version = args.engine_version
    if version is None:
        version, said = engine_launch.detect_version(args.engine, args.launcher, args.version_timeout)
        if version is None and not args.dry_run:
            raise ValueError(f"cannot tell the {args.engine} version: {said}; fix --launcher (how {args.engine} "
                             f"starts) or give --engine-version")
        notes.append(f"{args.engine} version: {said}" if version else
                     f"{args.engine} version unknown ({said}): judged as the newest release the rules were checked "
                     "against; give --engine-version")
    page = args.page_size or (1 if args.engine == "sglang" else 16)
    named = [(c.name, c.speculative) for c in candidates]
    planned = engine_launch.plan_commands(args.engine, version, args.model, named, args.engine_host, page,
                                          adaptive=False)
    words = engine_launch.launcher_words(args.engine, args.launcher)
    out: list[dict[str, Any]] = []
    for cand, p in zip(candidates, planned, strict=True):
        notes.extend(f"{cand.name}: {n}" for n in p["notes"] if f"{cand.name}: {n}" not in notes)
        if p["skip"]:
            notes.append(f"skipped {cand.name}: {p['skip']}")
            out.append({"name": cand.name, "argv": None, "env": p["env"], "notes": p["notes"], "skipped": p["skip"]})
            continue
        argv = engine_launch.with_launcher(p["argv"], args.engine, words)
        out.append({"name": cand.name, "argv": argv, "env": p["env"], "notes": p["notes"], "candidate": cand})
    if not out or out[0].get("skipped"):
        raise ValueError(f"{args.engine} cannot serve the baseline: {out[0].get('skipped') if out else 'no config'}")
    return out, version


def _launch(args: argparse.Namespace, launch: dict[str, Any], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    if args.engine == "specserve":
        cand: Candidate = launch["candidate"]
        return start_server(args.model, ["--device", args.device, "--dtype", args.dtype,
                                         "--quantization", args.quantization, *cand.tokens()], log,
                            args.server_timeout)
    port = free_port()
    host = args.engine_host
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    argv = engine_launch.with_port(launch["argv"], port)
    return engine_launch.start_engine(argv, launch["env"], url, log, args.server_timeout), url


def _stop(args: argparse.Namespace, proc: subprocess.Popen[bytes]) -> None:
    (stop_server if args.engine == "specserve" else engine_launch.stop_engine)(proc)


def cmd_tune(args: argparse.Namespace) -> int:
    from specserve.bench.datasets import load_dataset

    fresh_dir = not args.out_dir.exists()
    try:
        entries = parse_grid(args.grid)
        engine_launch.check_grid_keys(args.engine, [(e.algorithm, [k for k, _ in e.values]) for e in entries])
        candidates, notes = plan_grid(_engine_defaults(entries, args.engine), args.model)
        launches, version = plan_launches(args, candidates, notes)
        if args.dry_run:
            for launch in launches:
                line = {k: launch[k] for k in ("name", "argv", "env", "notes")}
                print(json.dumps({**line, **({"skipped": launch["skipped"]} if "skipped" in launch else {})}))
            for note in notes:
                print(f"note: {note}", file=sys.stderr)
            return 0
        load_dataset(args.dataset, args.num_prompts, args.seed or 0, args.random_input_len)  # fail before serving
        args.out_dir.mkdir(parents=True, exist_ok=True)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    sweep = ["--model", args.model, "--concurrency", ",".join(map(str, args.concurrency)),
             "--num-prompts", str(args.num_prompts), "--dataset", args.dataset, "--random-input-len",
             str(args.random_input_len), "--output-len", str(args.output_len), "--temperature", str(args.temperature),
             "--continuous-usage", "--no-progress", *(["--seed", str(args.seed)] if args.seed is not None else []),
             *(["--ignore-eos"] if args.ignore_eos else [])]
    configs: list[dict[str, Any]] = []
    outcomes: list[dict[str, Any]] = []
    runs: list[Run] = []
    written: list[Path] = []
    to_run = [launch for launch in launches if "skipped" not in launch]
    bar = tqdm(to_run, desc="tune", unit="config", disable=args.no_progress, file=sys.stderr)
    for i, launch in enumerate(bar):
        cand = launch["candidate"]
        bar.set_postfix_str(cand.name)
        stem = f"{i:02d}-" + re.sub(r"[^A-Za-z0-9]+", "-", cand.name).strip("-")[:60]
        log, out = args.out_dir / f"{stem}.server.log", args.out_dir / f"{stem}.json"
        written += [log, out]
        entry: dict[str, Any] = {"name": cand.name, "flags": dict(cand.flags), "resolved": asdict(cand.speculative),
                                 "run": None, "server_log": log.name, "error": None, "log_tail": None}
        if args.engine != "specserve":
            entry.update(engine_argv=launch["argv"], engine_env=launch["env"], engine_notes=launch["notes"])
        configs.append(entry)
        try:
            proc, url = _launch(args, launch, log)
        except RuntimeError as e:
            entry.update(error=str(e), log_tail=log_tail(log))
            if args.engine != "specserve" and i == 0:  # the baseline: nothing else will start either
                bar.close()
                last = (entry["log_tail"] or "(empty log)").splitlines()[-1]
                print(f"error: the {args.engine} baseline did not start ({e}; last log line: {last}); fix --launcher "
                      f"or --model (command: {shlex.join(launch['argv'])})", file=sys.stderr)
                _remove(written, args.out_dir if fresh_dir else None)
                return 2
            tqdm.write(f"{cand.name}: {e}\n{entry['log_tail']}", file=sys.stderr)
            continue
        try:
            tqdm.write(f"{cand.name}: serving at {url}", file=sys.stderr)
            tokens = ["--base-url", url, *sweep, "--out", str(out)]
            code = cmd_serving(_serving_namespace(tokens), argv=["specserve", "bench", "serving", *tokens])
        finally:
            _stop(args, proc)
        if not out.exists() or out.stat().st_size == 0:
            entry["error"] = f"bench serving exited with {code} without a run JSON"
            continue
        data = json.loads(out.read_text(encoding="utf-8"))
        entry["run"] = out.name
        if code != 0:
            entry["error"] = "some concurrency level had no successful request (see the run JSON)"
        outcomes.append({"name": cand.name, "flags": entry["flags"], "levels": _level_throughputs(data)})
        runs.append(Run(label=cand.name, path=out, kind="serving", data=data))
    bar.close()
    report = {
        "kind": "tune", "schema_version": 1, "baseline": BASELINE, "model": args.model, "device": args.device,
        "dtype": args.dtype, "concurrency": args.concurrency, "dataset": args.dataset,
        "num_prompts": args.num_prompts, "output_len": args.output_len, "temperature": args.temperature,
        "engine": args.engine, "engine_version": version, "launcher": args.launcher,
        "configs": configs, "notes": notes, "winners": pick_winners(outcomes, args.concurrency),
        "command_line": list(sys.argv),
    }
    (args.out_dir / "tune.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (args.out_dir / "tune.md").write_text(render_markdown(report, runs), encoding="utf-8")
    plotted = _plot(runs, args.out_dir / "tune.png")
    for w in report["winners"]:
        ratio = "-" if w["ratio_to_baseline"] is None else f"{w['ratio_to_baseline']:.2f}x NONE"
        print(f"concurrency {w['concurrency']}: {w['config'] or 'no successful run'} ({ratio})")
    print(f"wrote {args.out_dir / 'tune.json'} and {args.out_dir / 'tune.md'}" + (" and tune.png" if plotted else ""))
    return 1 if any(c["error"] for c in configs) else 0


def _plot(runs: list[Run], path: Path) -> bool:
    if not runs:
        return False
    from specserve.bench.plots import plot_runs

    plot_runs(runs, path)
    return True


def _remove(paths: list[Path], directory: Path | None) -> None:
    """Undo a tune that could not start: its files, and its directory when this tune created it."""
    for p in paths:
        p.unlink(missing_ok=True)
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)

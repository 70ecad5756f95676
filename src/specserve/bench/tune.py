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
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

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
           "--port", str(port), "--log-level", "warning"]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with code {proc.returncode} before /health answered")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                    return proc, url
            time.sleep(0.25)
    except BaseException:  # Ctrl-C while waiting: no server is left behind
        stop_server(proc, grace_s=0.0)
        raise
    stop_server(proc, grace_s=0.0)
    raise RuntimeError(f"server did not answer /health within {timeout_s:g} s (--server-timeout)")


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


def cmd_tune(args: argparse.Namespace) -> int:
    from specserve.bench.datasets import load_dataset

    try:
        candidates, notes = plan_grid(parse_grid(args.grid), args.model)
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
    server_extra = ["--device", args.device, "--dtype", args.dtype]
    configs: list[dict[str, Any]] = []
    outcomes: list[dict[str, Any]] = []
    runs: list[Run] = []
    bar = tqdm(candidates, desc="tune", unit="config", disable=args.no_progress, file=sys.stderr)
    for i, cand in enumerate(bar):
        bar.set_postfix_str(cand.name)
        stem = f"{i:02d}-" + re.sub(r"[^A-Za-z0-9]+", "-", cand.name).strip("-")[:60]
        log, out = args.out_dir / f"{stem}.server.log", args.out_dir / f"{stem}.json"
        entry: dict[str, Any] = {"name": cand.name, "flags": dict(cand.flags), "resolved": asdict(cand.speculative),
                                 "run": None, "server_log": log.name, "error": None, "log_tail": None}
        configs.append(entry)
        try:
            proc, url = start_server(args.model, [*server_extra, *cand.tokens()], log, args.server_timeout)
        except RuntimeError as e:
            entry.update(error=str(e), log_tail=log_tail(log))
            tqdm.write(f"{cand.name}: {e}\n{entry['log_tail']}", file=sys.stderr)
            continue
        try:
            tqdm.write(f"{cand.name}: serving at {url}", file=sys.stderr)
            tokens = ["--base-url", url, *sweep, "--out", str(out)]
            code = cmd_serving(_serving_namespace(tokens), argv=["specserve", "bench", "serving", *tokens])
        finally:
            stop_server(proc)
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
        "configs": configs, "notes": notes, "winners": pick_winners(outcomes, args.concurrency),
        "command_line": list(sys.argv),
    }
    (args.out_dir / "tune.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (args.out_dir / "tune.md").write_text(render_markdown(report, runs), encoding="utf-8")
    for w in report["winners"]:
        ratio = "-" if w["ratio_to_baseline"] is None else f"{w['ratio_to_baseline']:.2f}x NONE"
        print(f"concurrency {w['concurrency']}: {w['config'] or 'no successful run'} ({ratio})")
    print(f"wrote {args.out_dir / 'tune.json'} and {args.out_dir / 'tune.md'}")
    return 1 if any(c["error"] for c in configs) else 0

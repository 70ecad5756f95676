"""Served throughput by concurrency: plain decoding, fixed speculation and adaptive speculation, one run.

    python benchmarks/serving_concurrency.py --model demo --config NGRAM --config "DFLASH draft=16" \\
        --concurrency 1,4,16,32 --out runs/serving_concurrency.json

Starts a `specserve serve` on 127.0.0.1 for plain decoding (NONE, the baseline) and for each --config in each of
--modes (`fixed`: `--no-speculative-adaptive`, every step verifies the full width; `adaptive`: the server's
default), all kept up; a --config is `ALGO key=value ...` with keys path, steps, topk, draft, block, tree
(benchmarks/speculative.py's syntax; SUFFIX adds depth, cached, factor, minprob). After an untimed warm-up of each
server, --rounds rounds: in each, every level runs on every server in turn (the order rotates), so the machine's
drift hits every configuration alike. A level keeps c streamed requests in flight and sends max(--num-prompts,
--requests-per-slot x c) of the coding prompts, --output-len tokens each (ignore_eos), at --temperature. A level's
tok/s is the median over rounds, its ratio to NONE the median of the per-round ratios. --plain-twin adds a second
plain server, whose ratio to NONE is the run's A/A noise; --against-src DIR runs every speculative configuration a
second time from another source tree (`ratio_to_against`).
--dataset agentic sends multi-turn coding-agent conversations instead (`bench serving --dataset agentic`): a level
keeps c conversations in flight, one turn at a time each, and sends as many conversations as a coding level sends
requests; every level of every round gets its own seeded conversations (the same on every server), so no drafter
that learns across requests (SUFFIX) sees an answer it already served. (On `coding` the 20 prompts repeat at every
level: SUFFIX's cache of earlier outputs then holds each answer; run `SUFFIX cached=0` beside it.)

Prints ONE JSON object (per configuration and level: tok/s, accept length, ratio to NONE; NONE's batching ratio,
c=16 over c=1). With --out also a markdown table beside it and the server logs (NAME.logs/), each with its
per-pass log for `specserve bench trace`. Exit code 0, 1 when some configuration failed, 2 for bad flags.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import torch
from speculative import parse_config  # benchmarks/speculative.py (this script's folder is on sys.path)

from specserve.bench.conversations import agentic_conversations
from specserve.bench.datasets import load_dataset, sample_prompts
from specserve.bench.prompts import Prompt
from specserve.bench.server_probe import server_config
from specserve.bench.serving import run_conversation_level, run_level, warm_up
from specserve.bench.serving_client import ServingConfig, client_session
from specserve.bench.tune import log_tail, start_server, stop_server
from specserve.config import SpeculativeConfig

BASELINE = "NONE"
TWIN = "NONE twin"  # --plain-twin: a second plain server, the run's own A/A measure of its noise
AGAINST = "@against"  # name suffix of the variants run from --against-src
SERVED_NAME = "bench"
SEED = 0


@dataclass(frozen=True)
class Variant:
    name: str  # NONE, or "<config> fixed" / "<config> adaptive"
    config: str | None  # the --config text; None for NONE
    adaptive: bool | None  # None for NONE
    serve_args: tuple[str, ...]
    src: str | None = None  # a source tree the server runs from (PYTHONPATH) instead of the installed package


def speculative_flags(spec: SpeculativeConfig) -> list[str]:
    """The resolved configuration as `specserve serve` flags, so the server runs exactly it."""
    flags = ["--speculative-algorithm", spec.algorithm]
    if not spec.enabled:
        return flags
    values: dict[str, Any] = {
        "draft-model-path": spec.draft_model_path, "num-steps": spec.num_steps, "eagle-topk": spec.eagle_topk,
        "num-draft-tokens": spec.num_draft_tokens, "dflash-block-size": spec.dflash_block_size, "tree": spec.tree,
        "ngram-min-match": spec.ngram_min_match, "ngram-max-match": spec.ngram_max_match,
        "ngram-max-breadth": spec.ngram_max_breadth,
    }
    if spec.algorithm == "SUFFIX":
        values.update({"suffix-max-tree-depth": spec.suffix_max_tree_depth,
                       "suffix-max-cached-requests": spec.suffix_max_cached_requests,
                       "suffix-max-spec-factor": spec.suffix_max_spec_factor,
                       "suffix-min-token-prob": spec.suffix_min_token_prob})
    for key, value in values.items():
        if value is not None:
            flags += [f"--speculative-{key}", str(value)]
    return flags


def plan_variants(model: str, configs: list[str], extra: list[str],
                  modes: tuple[str, ...] = ("fixed", "adaptive"), against: str | None = None,
                  plain_twin: bool = False) -> list[Variant]:
    """NONE (and its twin with `plain_twin`), then each config fixed, then each config adaptive (those of
    `modes`), each followed by its run from `against` if given; ValueError naming a bad --config."""
    common = [*extra, "--served-model-name", SERVED_NAME]  # the client asks for this name
    plain = (*common, "--speculative-algorithm", "NONE")
    variants = [Variant(BASELINE, None, None, plain)] + ([Variant(TWIN, None, None, plain)] if plain_twin else [])
    resolved = []
    for text in configs:
        spec = parse_config(text, model)
        if not spec.enabled:
            raise ValueError(f"--config {text!r}: NONE is always run as the baseline; give speculative configs")
        resolved.append((text, speculative_flags(spec)))
    for adaptive in [m == "adaptive" for m in ("fixed", "adaptive") if m in modes]:
        for text, flags in resolved:
            switch = "--speculative-adaptive" if adaptive else "--no-speculative-adaptive"
            name = f"{text} {'adaptive' if adaptive else 'fixed'}"
            variants.append(Variant(name, text, adaptive, (*common, *flags, switch)))
            if against is not None:
                variants.append(Variant(f"{name} {AGAINST}", text, adaptive, (*common, *flags, switch), against))
    return variants


def level_count(num_prompts: int, concurrency: int, per_slot: int) -> int:
    return max(num_prompts, per_slot * concurrency)


@dataclass
class Live:
    """A started server and what was measured on it: per concurrency, one level dict per round."""

    variant: Variant
    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    entry: dict[str, Any]
    rounds: dict[int, list[dict[str, Any]]] = field(default_factory=dict)


def start_all(variants: list[Variant], args: argparse.Namespace, logs: Path, live: list[Live]) -> list[dict[str, Any]]:
    """Every variant's server, one after the other (an adaptive one may profile at start-up, alone on the
    machine), appended to `live` as it answers (so an interrupt still stops those already up); the entries of
    all, those that did not start carrying their error."""
    entries: list[dict[str, Any]] = []
    for i, v in enumerate(variants):
        stem = f"{i:02d}-" + "".join(ch if ch.isalnum() else "-" for ch in v.name).strip("-")
        log = logs / f"{stem}.server.log"
        serve_args = list(v.serve_args)
        passes = logs / f"{stem}.passes.jsonl"  # every engine pass: batch, width, tokens, time (prefills too)
        if args.out:
            serve_args += ["--speculative-adaptive-trace", str(passes)]
        entry: dict[str, Any] = {"name": v.name, "config": v.config, "adaptive": v.adaptive, "src": v.src,
                                 "serve_args": list(v.serve_args), "server_log": str(log) if args.out else None,
                                 "pass_log": str(passes) if args.out else None,
                                 "error": None, "levels": {}}
        entries.append(entry)
        print(f"{v.name}: starting the server (log {log})", file=sys.stderr, flush=True)
        try:
            env = {**os.environ, "PYTHONPATH": v.src} if v.src else None
            proc, url = start_server(args.model, serve_args, log, args.server_timeout, env)
        except RuntimeError as e:
            entry["error"] = f"{e}\n{log_tail(log)}"
            print(f"{v.name}: {entry['error']}", file=sys.stderr, flush=True)
            continue
        live.append(Live(v, proc, url, log, entry))
    return entries


def _fail(s: Live, e: BaseException) -> None:
    s.entry["error"] = f"{type(e).__name__}: {e}\n{log_tail(s.log)}"
    print(f"{s.variant.name}: {s.entry['error']}", file=sys.stderr, flush=True)


def conversations_for(args: argparse.Namespace, round_no: int, concurrency: int) -> Any:
    """A level's own agentic conversations (round 0 level 0: the warm-up's), the same for every server."""
    count = level_count(args.num_prompts, concurrency, args.requests_per_slot) if concurrency else max(args.concurrency)
    return agentic_conversations(count, SEED + 1 + 1000 * round_no + concurrency, args.agentic_file_chars)


async def _warm(client: aiohttp.ClientSession, cfg: ServingConfig, dataset: Any, widest: int, s: Live,
                args: argparse.Namespace) -> None:
    info = (await server_config(client, s.url)).get("info") or {}
    s.entry["server_speculative"] = info.get("speculative") if isinstance(info, dict) else None
    convs = conversations_for(args, 0, 0) if args.dataset == "agentic" else ()
    first = Prompt(messages=tuple((m["role"], m["content"]) for m in convs[0].messages(0, []))) if convs else None
    warm = await warm_up(client, cfg, first or dataset.prompts[0])
    if not warm["ok"] or not warm["ignore_eos_applied"]:
        raise RuntimeError(f"the warm-up request failed: {warm['error'] or warm['note']}")
    # untimed: every prompt once (so every level finds them in the prefix cache alike), batches formed
    if convs:  # conversations of their own: no measured answer is served here
        primed = await run_conversation_level(client, cfg, convs, widest, ignore_eos=True, progress=False)
    else:
        primed = await run_level(client, cfg, dataset.prompts, min(widest, len(dataset.prompts)), ignore_eos=True,
                                 progress=False)
    if primed["errors"]:
        raise RuntimeError(f"the warm-up pass failed: {primed['error_messages']}")


async def measure(live: list[Live], args: argparse.Namespace) -> None:
    """Warm every server, then round after round each level on every server in turn (the order rotates each
    round), so slow drifts of the machine's speed hit every configuration alike. A failing server drops out."""
    cfgs = [ServingConfig(base_url=s.url, model=SERVED_NAME, output_len=args.output_len,
                          temperature=args.temperature, seed=SEED if args.temperature > 0 else None, ignore_eos=True,
                          endpoint="chat" if args.dataset == "agentic" else "completions")
            for s in live]
    dataset = load_dataset("coding", args.num_prompts, SEED)
    widest = max(args.concurrency)
    clients = [client_session(cfg.request_timeout_s, widest + 4) for cfg in cfgs]
    try:
        for s, client, cfg in zip(live, clients, cfgs, strict=True):
            try:
                await _warm(client, cfg, dataset, widest, s, args)
            except Exception as e:  # one broken configuration must not lose the others' figures
                _fail(s, e)
        order = list(range(len(live)))
        for r in range(args.rounds):
            for c in args.concurrency:
                prompts = sample_prompts(dataset, level_count(args.num_prompts, c, args.requests_per_slot), SEED)
                convs = conversations_for(args, r, c) if args.dataset == "agentic" else ()
                for i in order[r % len(order):] + order[: r % len(order)]:
                    s = live[i]
                    if s.entry["error"]:
                        continue
                    try:
                        if convs:
                            level = await run_conversation_level(clients[i], cfgs[i], convs, c, ignore_eos=True,
                                                                 progress=False)
                        else:
                            level = await run_level(clients[i], cfgs[i], prompts, c, ignore_eos=True,
                                                    progress=False)
                    except Exception as e:
                        _fail(s, e)
                        continue
                    s.rounds.setdefault(c, []).append(level)
                    print(f"  round {r + 1}, {s.variant.name}, concurrency {c}: {level['completed']}/"
                          f"{level['num_requests']} ok, {_num(level['output_throughput'], '.1f')} out tok/s, "
                          f"accept length {_num(level['accept_length'], '.2f')}", file=sys.stderr, flush=True)
    finally:
        for client in clients:
            await client.close()


def summarize_level(level: dict[str, Any]) -> dict[str, Any]:
    tpot, ttft = level["tpot_ms"], level["ttft_ms"]
    return {
        # a level with failed requests measured something else: no figure (its errors say why)
        "output_tok_s": level["output_throughput"] if level["completed"] and not level["errors"] else None,
        "accept_length": level["accept_length"],
        "spec_step_fraction": level.get("spec_step_fraction"),  # steps that verified drafts (adaptive: < 1)
        "completed": level["completed"], "num_requests": level["num_requests"], "errors": level["errors"],
        "error_messages": level["error_messages"], "duration_s": level["duration_s"],
        "ttft_p50_ms": ttft["p50"] if ttft else None, "tpot_p50_ms": tpot["p50"] if tpot else None,
        **(_conversation_figures(level) if "ttft_first_turn_ms" in level else {}),
    }


def _conversation_figures(level: dict[str, Any]) -> dict[str, Any]:
    first, later, cache = level["ttft_first_turn_ms"], level["ttft_later_turns_ms"], level["prefix_cache"] or {}
    return {"ttft_first_turn_p50_ms": first["p50"] if first else None,
            "ttft_later_turns_p50_ms": later["p50"] if later else None,
            "prefix_cache_hit_rate": cache.get("hit_rate"), "host_to_device_blocks": cache.get("host_to_device_blocks"),
            "device_to_host_blocks": cache.get("device_to_host_blocks")}


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known and len(known) == len(values) else None


def summarize(live: list[Live]) -> None:
    """Each entry's levels: per round the figures, as the level's figure their median; the ratio to NONE is
    the median of the per-round ratios (each round's NONE level ran beside the configuration's), and so is a
    tree variant's ratio to its @against twin (--against-src)."""
    base = next((s for s in live if s.variant.name == BASELINE), None)
    twins = {s.variant.name: s for s in live if s.variant.src is not None}
    for s in live:
        against = twins.get(f"{s.variant.name} {AGAINST}")
        for c, rounds in s.rounds.items():
            per = [summarize_level(level) for level in rounds]
            tps = [p["output_tok_s"] for p in per]
            fractions = [p["spec_step_fraction"] for p in per if p["spec_step_fraction"] is not None]
            accepts = [p["accept_length"] for p in per if p["accept_length"] is not None]
            level = s.entry["levels"][str(c)] = {
                **per[-1], "output_tok_s": _median(tps), "rounds_output_tok_s": tps,
                "accept_length": statistics.mean(accepts) if accepts else None,
                "spec_step_fraction": statistics.mean(fractions) if fractions else None,
                "completed": sum(p["completed"] for p in per), "num_requests": sum(p["num_requests"] for p in per),
                "errors": sum(p["errors"] for p in per),
                "error_messages": [m for p in per for m in p["error_messages"]],
            }
            for key, other in (("plain", base), ("against", against)):
                if other is None:
                    continue
                theirs = [summarize_level(lv)["output_tok_s"] for lv in other.rounds.get(c, [])]
                ratios: list[float | None] = [t / b if t is not None and b else None
                                              for t, b in zip(tps, theirs, strict=False)]
                level[f"ratio_to_{key}"] = _median(ratios) if len(ratios) == len(tps) else None
                level[f"rounds_ratio_to_{key}"] = ratios


def _tps(entry: dict[str, Any], c: int) -> float | None:
    level = entry["levels"].get(str(c))
    return level["output_tok_s"] if level else None


def goals(entries: list[dict[str, Any]], concurrency: list[int]) -> tuple[float | None, dict[str, Any]]:
    base = next(e for e in entries if e["name"] == BASELINE)
    c1, c16 = _tps(base, 1), _tps(base, 16)
    batching = c16 / c1 if c1 and c16 is not None else None
    out: dict[str, Any] = {"plain_c16_ge_6x_plain_c1": None if batching is None else batching >= 6.0,
                           "adaptive": {}}
    for e in entries:
        if not e["adaptive"] or e["src"] is not None:
            continue
        ratios = [e["levels"].get(str(c), {}).get("ratio_to_plain") for c in concurrency]
        every = None if any(r is None for r in ratios) else all(r >= 1.0 for r in ratios if r is not None)
        r1 = e["levels"].get("1", {}).get("ratio_to_plain")
        out["adaptive"][e["config"]] = {"ge_plain_at_every_concurrency": every,
                                        "ge_2x_plain_at_c1": None if r1 is None else r1 >= 2.0,
                                        "min_ratio_to_plain": min((r for r in ratios if r is not None), default=None)}
    return batching, out


def _num(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _aa_cell(twin: dict[str, Any], c: int) -> str:
    lv = twin["levels"].get(str(c)) or {}
    rounds = [r for r in lv.get("rounds_ratio_to_plain") or [] if r is not None]
    spread = f" ({min(rounds):.2f}–{max(rounds):.2f})" if rounds else ""
    return f"c={c} {_num(lv.get('ratio_to_plain'), '.2f')}×{spread}"


def markdown(report: dict[str, Any]) -> str:
    cs = report["concurrency"]
    lines = [f"# Served throughput by concurrency: `{report['model']}`", "",
             f"Output {report['output_len']} tokens (ignore_eos), temperature {report['temperature']}, dataset "
             f"{report['dataset']}, requests (agentic: conversations) per level {report['requests_per_level']}, "
             f"{report['rounds']} interleaved round(s). "
             "Cells: output tok/s, median over the rounds (median of the per-round ratios to NONE at the same "
             "concurrency) · mean accept length · share of steps that speculated.", "",
             "| config | " + " | ".join(f"c={c}" for c in cs) + " |", "|---|" + "---|" * len(cs)]
    for e in report["configs"]:
        cells = []
        for c in cs:
            lv = e["levels"].get(str(c))
            if not lv:
                cells.append("failed" if e["error"] else "-")
                continue
            ratio = "" if lv.get("ratio_to_plain") is None else f" ({lv['ratio_to_plain']:.2f}×)"
            accept = "" if lv["accept_length"] is None else f" · {lv['accept_length']:.2f}"
            share = lv.get("spec_step_fraction")
            spec = "" if share is None or e["config"] == "NONE" else f" · {share:.0%}"
            cells.append(f"{_num(lv['output_tok_s'], '.1f')}{ratio}{accept}{spec}")
        lines.append(f"| {e['name']} | " + " | ".join(cells) + " |")
    pairs = [e for e in report["configs"] if any("ratio_to_against" in lv for lv in e["levels"].values())]
    if pairs:
        lines += ["", f"Against `{report['against_src']}` (median of the per-round ratios to the @against twin):", ""]
        lines += [f"- `{e['name']}`: " + ", ".join(
            f"c={c} {_num(e['levels'].get(str(c), {}).get('ratio_to_against'), '.2f')}×" for c in cs) for e in pairs]
    twin = next((e for e in report["configs"] if e["name"] == TWIN), None)
    if twin is not None:
        lines += ["", "A/A (`--plain-twin`: a second plain server, the same build and flags): its ratio to NONE per "
                  "level, median (rounds' range) — ratios of other rows this close to 1 are not resolved by this run:",
                  ""]
        lines += ["- " + ", ".join(_aa_cell(twin, c) for c in cs)]
    g = report["goals"]
    lines += ["", f"Batching (NONE c=16 / c=1): {_num(report['batching_ratio_plain_c16_over_c1'], '.2f')}× "
              f"(goal ≥ 6×: {g['plain_c16_ge_6x_plain_c1']})", ""]
    for config, res in g["adaptive"].items():
        lines.append(f"- `{config}` adaptive: ≥ NONE at every concurrency: {res['ge_plain_at_every_concurrency']} "
                     f"(min ratio {_num(res['min_ratio_to_plain'], '.2f')}); ≥ 2× NONE at c=1: "
                     f"{res['ge_2x_plain_at_c1']}")
    for e in report["configs"]:
        if e["error"]:
            lines += ["", f"**{e['name']} failed:**", "", "```", e["error"].rstrip(), "```"]
    lines += ["", f"Command line: `{shlex.join(report['command_line'])}`"]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo", help="`demo` or a checkpoint directory (served by every server)")
    ap.add_argument("--config", action="append", default=[], help="e.g. 'NGRAM draft=12' (repeatable; default NGRAM)")
    ap.add_argument("--concurrency", default="1,4,16,32", help="comma-separated levels")
    ap.add_argument("--num-prompts", type=int, default=32,
                    help="requests per level (at least --requests-per-slot x concurrency)")
    ap.add_argument("--requests-per-slot", type=int, default=8,
                    help="a level sends at least this many requests per concurrent client (see the docstring)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="each level this many times per configuration, interleaved; figures are medians")
    ap.add_argument("--output-len", type=int, default=64, help="max_tokens of every request (ignore_eos)")
    ap.add_argument("--dataset", choices=("coding", "agentic"), default="coding",
                    help="single coding prompts, or multi-turn agentic conversations (see the docstring)")
    ap.add_argument("--agentic-file-chars", type=int, default=2000,
                    help="--dataset agentic: characters of each source file shown as a tool result")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--modes", default="fixed,adaptive", help="which speculative variants to run besides NONE")
    ap.add_argument("--extra-serve-args", default="", help="appended to every `specserve serve`, e.g. '--device cpu'")
    ap.add_argument("--against-src", default=None,
                    help="also run every speculative configuration from this source tree (PYTHONPATH), e.g. the "
                         "src/ of a `git worktree` of an earlier commit, and compare round by round")
    ap.add_argument("--plain-twin", action="store_true",
                    help="also run a second plain server (NONE twin): the run's own A/A spread (see the docstring)")
    ap.add_argument("--server-timeout", type=float, default=900.0,
                    help="seconds a server gets to answer /health (an adaptive server may profile first)")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON here and a markdown table beside it")
    a = ap.parse_args()
    try:
        a.concurrency = [int(c) for c in a.concurrency.split(",") if c.strip()]
        if not a.concurrency or min(a.concurrency) < 1:
            raise ValueError(f"--concurrency needs levels >= 1 like 1,4,16,32, got {a.concurrency}")
        if a.num_prompts < 1 or a.output_len < 1 or a.rounds < 1 or a.requests_per_slot < 1:
            raise ValueError("--num-prompts, --requests-per-slot, --output-len and --rounds must be >= 1")
        modes = tuple(m.strip() for m in a.modes.split(","))
        if not modes or any(m not in ("fixed", "adaptive") for m in modes):
            raise ValueError(f"--modes {a.modes!r}: a comma-separated subset of fixed,adaptive")
        if a.against_src is not None and not (Path(a.against_src) / "specserve").is_dir():
            raise ValueError(f"--against-src {a.against_src}: no specserve package there (give a tree's src/)")
        variants = plan_variants(a.model, a.config or ["NGRAM"], shlex.split(a.extra_serve_args), modes,
                                 a.against_src, a.plain_twin)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="serving-concurrency-") as tmp:  # server logs without --out
        logs = a.out.parent / f"{a.out.stem}.logs" if a.out is not None else Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        live: list[Live] = []
        try:
            entries = start_all(variants, a, logs, live)
            asyncio.run(measure(live, a))
        finally:
            for s in live:
                stop_server(s.proc)  # SIGTERM, then SIGKILL after 30 s (also on errors and Ctrl-C)
    summarize(live)
    batching, goal = goals(entries, a.concurrency)
    report = {
        "benchmark": "serving_concurrency", "model": a.model, "command_line": sys.argv,
        "concurrency": a.concurrency, "rounds": a.rounds,
        "requests_per_level": {str(c): level_count(a.num_prompts, c, a.requests_per_slot) for c in a.concurrency},
        "output_len": a.output_len, "temperature": a.temperature, "dataset": a.dataset, "ignore_eos": True,
        "agentic_file_chars": a.agentic_file_chars if a.dataset == "agentic" else None,
        "extra_serve_args": a.extra_serve_args, "against_src": a.against_src, "machine": platform.machine(),
        "cpus": os.cpu_count(), "torch": torch.__version__,
        "configs": entries, "batching_ratio_plain_c16_over_c1": batching, "goals": goal,
    }
    text = json.dumps(report, indent=2)
    if a.out is not None:
        a.out.write_text(text + "\n", encoding="utf-8")
        a.out.with_suffix(".md").write_text(markdown(report), encoding="utf-8")
        print(f"wrote {a.out} and {a.out.with_suffix('.md')}", file=sys.stderr)
    print(text)
    return 1 if any(e["error"] for e in entries) else 0


if __name__ == "__main__":
    sys.exit(main())

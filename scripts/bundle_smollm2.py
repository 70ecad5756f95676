"""Bundle a drafter trained for smollm2: export it (bf16) into the package, measure it, write its card.

    python scripts/bundle_smollm2.py --run train_runs/smollm2-eagle3 --data data/smollm2/chat-greedy \
        --command "specserve train eagle3 --target smollm2 ..."

The run's kind (EAGLE-3 or DFlash, from its summary) names the bundle: smollm2-eagle3 in SGLang's layout, verified
as a chain; smollm2-dflash in DFlash's layout, verified as DDTree-16. The run's chosen drafter (`best/` where an
evaluation picked one, else `drafter/`) is exported to src/specserve/assets/models/, then measured on the bundled
files with `bench acceptance`'s code, eager decode steps (accept length does not depend on them), against plain
decoding in the same process:
  chat-coding, greedy, 64 tokens  (the headline: the worst task kind over tasks that do not loop)
  chat-coding, temperature 0.7, 64 tokens, seeds 0, 1, 2
  NGRAM on chat-coding, greedy, 64 tokens (the lookup drafter beside it)
Writes MODEL_CARD.md (data, command, tokens trained, throughput, the figures and their commands) and
acceptance.json beside the weights.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specserve.bench.acceptance import run_acceptance
from specserve.bench.machine import cpu_info
from specserve.bench.suites import load_suite
from specserve.config import SpeculativeConfig
from specserve.engine.llm import LLM
from specserve.models.loader import ASSETS
from specserve.train.export import ExportConfig, export
from specserve.types import SamplingParams

SUITE, NEW = "chat-coding", 64
SEEDS = (0, 1, 2)


@dataclass(frozen=True)
class Kind:
    algorithm: str  # --speculative-algorithm
    title: str  # the drafter and how it is verified
    export_format: str
    flags: str  # the bench command's verification flags beyond the algorithm
    spec: dict[str, Any]  # SpeculativeConfig.resolve's keywords for those flags


KINDS = {
    "eagle3": Kind("EAGLE3", "EAGLE-3 chain", "sglang", "", {}),
    "dflash": Kind("DFLASH", "DFlash DDTree-16", "dflash", "", {}),  # DFLASH's defaults: a DDTree of 16 nodes
}


def view(llm: LLM, temperature: float, seed: int | None) -> dict[str, Any]:
    params = SamplingParams(max_new_tokens=NEW, temperature=temperature, seed=seed, ignore_eos=True)
    res = run_acceptance(llm, load_suite(SUITE), params)
    summary: dict[str, Any] = res["summary"]
    return summary


def command(algorithm: str, flags: str, temperature: float, seed: int | None) -> str:
    return (f"specserve bench acceptance --model smollm2 --speculative-algorithm {algorithm}{flags} --suite {SUITE} "
            f"--max-new-tokens {NEW} --temperature {temperature}" + (f" --seed {seed}" if seed is not None else ""))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", type=Path, required=True)
    ap.add_argument("--data", type=Path, nargs="+", required=True)
    ap.add_argument("--command", required=True, help="the training command (for the card)")
    ap.add_argument("--val-command", default=None, help="the command that wrote the --eval-suite prompts")
    ap.add_argument("--drafter", type=Path, default=None,
                    help="the drafter to bundle (default: the run's best/, else drafter/), e.g. an export/ from "
                         "benchmarks/gpu.sh train")
    ap.add_argument("--no-ngram", action="store_true", help="leave out the NGRAM row")
    ap.add_argument("--seeds", type=int, nargs="*", default=list(SEEDS), help="seeds of the sampled view")
    a = ap.parse_args()
    summary = json.loads((a.run / "train_summary.json").read_text())
    chosen = a.drafter or (a.run / "best" if (a.run / "best" / "config.json").exists() else a.run / "drafter")
    name = str(summary["kind"])
    kind = KINDS[name]
    dest = ASSETS / f"smollm2-{name}"
    export(ExportConfig(drafter=chosen, target="smollm2", out=dest, format=kind.export_format, dtype="bfloat16"))
    spec = SpeculativeConfig.resolve(kind.algorithm, str(dest), **kind.spec)
    llm = LLM("smollm2", speculative=spec, enforce_eager=True)
    rows: list[dict[str, Any]] = [{"view": f"{kind.title}, greedy", "command": command(kind.algorithm, kind.flags,
                                                                                         0.0, None),
                                   **view(llm, 0.0, None)}]
    sampled = [view(llm, 0.7, s) for s in a.seeds]
    if sampled:
        rows.append({"view": f"{kind.title}, temperature 0.7",
                     "command": command(kind.algorithm, kind.flags, 0.7, a.seeds[0]),
                     **sampled[0], "accept_length_by_seed": {str(s): r["accept_length"]
                                                             for s, r in zip(a.seeds, sampled, strict=True)}})
    if not a.no_ngram:
        ngram = LLM("smollm2", speculative=SpeculativeConfig.resolve("NGRAM", None), enforce_eager=True)
        rows.append({"view": "NGRAM, greedy", "command": command("NGRAM", "", 0.0, None), **view(ngram, 0.0, None)})
    data = [json.loads((d / "meta.json").read_text()) | {"dir": str(d)} for d in a.data]
    (dest / "acceptance.json").write_text(json.dumps({"cpu": cpu_info(), "views": rows}, indent=1) + "\n")
    (dest / "MODEL_CARD.md").write_text(card(name, summary, chosen, data, rows, spec, a.command, a.val_command))
    readme = dest / "README.md"  # export's card names the directory it wrote; the bundled name resolves anywhere
    readme.write_text(readme.read_text().replace(str(dest.resolve()), dest.name).replace(str(dest), dest.name))
    print(json.dumps({"drafter": str(dest), "views": rows}))


def card(name: str, summary: dict[str, Any], chosen: Path, data: list[dict[str, Any]], rows: list[dict[str, Any]],
         spec: SpeculativeConfig, cmd: str, val_cmd: str | None) -> str:
    t = summary["time_share"]
    best = summary.get("best_eval") or {}
    kind = KINDS[name]
    defaults = (f"num_steps {spec.num_steps}, eagle_topk {spec.eagle_topk}, num_draft_tokens {spec.num_draft_tokens}"
                if name == "eagle3" else f"block_size {spec.dflash_block_size}, measured as DDTree-16")
    lines = [
        f"# smollm2-{name}: {kind.title.split()[0]} drafter for SmolLM2-135M-Instruct (`--model smollm2`)",
        "",
        f"Serve it: `specserve serve --model smollm2 --speculative-algorithm {kind.algorithm}{kind.flags}` "
        "(picked by default for smollm2).",
        f"Defaults it runs with: {defaults}.",
        "",
        "## Training",
    ]
    for d in data:
        s = d["settings"]
        lines.append(
            f"- Data `{d['dir']}`: `specserve train prepare --target smollm2 --prompts {s['prompts']} --temperature "
            f"{s['temperature']} --max-new-tokens {s['max_new_tokens']} --batch-size {s['batch_size']} --shard-size "
            f"{s['shard_size']} --enforce-eager`: the target's own answers to {d['sequences']} chat coding tasks "
            f"({d['response_tokens']} answer tokens, {d['tokens']} with prompts; {len(d['shards'])} of "
            f"{d['planned_shards']} shards so far), one task per function of the standard library's training split "
            "(`python -m specserve.train.chat_prompts --split train`); none from the evaluation suites.")
    lines += [
        f"- `{cmd}`: {summary['steps']} steps, {summary['tokens_seen']} sequence tokens at {summary['tokens_per_s']} "
        f"tokens/s on {cpu_info()['model']} ({', '.join(cpu_info()['features']) or 'no AVX512'}), 2 threads, "
        f"{summary['precision']}; time: target features {t['target']:.0%} (from the cache), drafter forward "
        f"{t['drafter_fwd']:.0%}, backward {t['drafter_bwd']:.0%}; final loss {summary['final_loss']}.",
        f"- Chosen: `{chosen.name}/`"
        + (f", the step-{best['step']} drafter, best worst-kind accept length {best['score']:.2f} on the validation "
           "prompts" + (f" (`{val_cmd}`)" if val_cmd else "") if best else ""),
        "",
        f"## Acceptance on smollm2 ({SUITE}: 30 held-out chat tasks, {NEW} tokens; bonus token included)",
        "",
        "| view | accept length (worst kind, non-looping) | all tasks | speedup vs plain (eager) | loop measure | "
        "greedy identical | command |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        seeds = r.get("accept_length_by_seed")
        spread = "" if not seeds else (f" (seeds {'/'.join(seeds)}: {'/'.join(f'{v:.2f}' for v in seeds.values())}, "
                                       f"mean {statistics.mean(seeds.values()):.2f})")
        lines.append(f"| {r['view']} | {r.get('headline_accept_length', r['accept_length']):.2f} | "
                     f"{r['accept_length']:.2f}{spread} | {r['speedup']:.2f}× | {r['loop_4gram']:.2f} | "
                     f"{r.get('identical_to_plain', '(sampled)')} | `{r['command']}` |")
    lines += ["", "Measured by `python scripts/bundle_smollm2.py` on the bundled bf16 files; `acceptance.json` holds "
              "the full results.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main()

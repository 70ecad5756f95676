"""Bundle the demo drafters: export each training run (bf16) next to the demo target, measure it, write its card.

    python scripts/finalize_drafters.py --eagle3 runs/drafters/eagle3 runs/drafters/eagle3-b \
        --eagle3-command "specserve train eagle3 ..." --eagle3-command "specserve train eagle3 ... --init-from ..." \
        --dflash runs/drafters/dflash runs/drafters/dflash-b --dflash-command ... --dflash-command ...

For each drafter: `specserve train export` (sglang layout for EAGLE-3, dflash layout for DFlash, bf16, checked
to load back with identical outputs) into src/specserve/assets/models/demo-eagle3 | demo-dflash, then the
acceptance figures the drafter-training issue asks for, measured on the bundled files with `bench acceptance`'s
code (one process, plain and speculative side by side):
  heldout-code, greedy, 32 new tokens, all 96 contexts   (headline: real code of eight packages cut at three kinds of
                                                          point; the minimum over kinds on tasks that do not loop)
  heldout-pip, greedy, 32 new tokens                      (one package, every cut after a newline: flatters drafters)
  coding10, temperature 0.7, 128 new tokens, seed 0
  coding10, greedy, 128 new tokens, with the loop measure (inflated by the demo target's loops)
With --dflash-calibrate-suite (training-split prompts, e.g. `python -m specserve.train.prompts --kind
continuations --count 64 --seed 11 --exclude <the training prompt files>`), the exported DFlash drafter's DDTree
temperature is picked on them first (`specserve train calibrate ... --write`), and with
--dflash-calibrate-temperature T its draft sampling temperature on the same prompts sampled at T, before
anything is measured. The sampled view is measured at seeds 0, 1 and 2 (the card gives all three and their mean).
Writes MODEL_CARD.md (data, steps, tokens/s, time split, final loss, calibration, the figures and their
commands) and acceptance.json beside the weights.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from specserve.bench.acceptance import run_acceptance
from specserve.bench.suites import load_suite
from specserve.config import SpeculativeConfig
from specserve.engine.llm import LLM
from specserve.models.loader import ASSETS
from specserve.speculative.factory import drafter_block_size
from specserve.train.calibrate import GREEDY_GRID, SAMPLED_GRID, CalibrateConfig, calibrate_tree_temperature
from specserve.train.export import ExportConfig, export, run_tokens_per_s
from specserve.types import SamplingParams

VIEWS = (
    ("heldout-code, greedy, 32 tokens (headline: worst cut kind, non-looping tasks)", "heldout-code", 0.0, 32),
    ("heldout-code, temperature 0.7, 32 tokens", "heldout-code", 0.7, 32),
    ("heldout-pip, greedy, 32 tokens (cuts after a newline only)", "heldout-pip", 0.0, 32),
    ("coding10, temperature 0.7, 128 tokens", "coding10", 0.7, 128),
    ("coding10, greedy, 128 tokens (loops inflate it)", "coding10", 0.0, 128),
)
SEEDS = (0, 1, 2)
GOALS = {"EAGLE3": {"heldout-code": 3.0, "coding10@0.7": 2.2}, "DFLASH": {"heldout-code": 3.5, "coding10@0.7": 2.8}}


def resolve(algorithm: str, draft_dir: Path) -> SpeculativeConfig:
    """The defaults `specserve serve --model demo --speculative-algorithm ALGO` uses with this drafter."""
    block = drafter_block_size(str(draft_dir)) if algorithm == "DFLASH" else None
    return SpeculativeConfig.resolve(algorithm, str(draft_dir), dflash_block_size=block)


def measure(algorithm: str, draft_dir: Path) -> list[dict[str, Any]]:
    llm = LLM("demo", speculative=resolve(algorithm, draft_dir))
    rows = []
    for label, suite, temperature, new in VIEWS:
        # as `bench acceptance` decodes (the card's commands): EOS ignored, exactly `new` tokens
        params = SamplingParams(max_new_tokens=new, temperature=temperature, seed=0 if temperature else None,
                                ignore_eos=True)
        res = run_acceptance(llm, load_suite(suite), params)
        goal = GOALS[algorithm].get(suite if temperature == 0 and suite == "heldout-code" else f"{suite}@{temperature}")
        cmd = (f"specserve bench acceptance --model demo --speculative-algorithm {algorithm} --suite {suite} "
               f"--max-new-tokens {new} --temperature {temperature}" + (" --seed 0" if temperature else ""))
        row = {"view": label, "command": cmd, "goal": goal, **res["summary"]}
        if temperature:  # a sampled view moves with the seed: seeds 1 and 2 beside seed 0 (the command's)
            by_seed = [row["accept_length"]] + [
                run_acceptance(llm, load_suite(suite), replace(params, seed=s))["summary"]["accept_length"]
                for s in SEEDS[1:]]
            row |= {"accept_length_by_seed": dict(zip(map(str, SEEDS), by_seed, strict=True)),
                    "accept_length_mean_of_seeds": round(sum(by_seed) / len(by_seed), 4)}
        rows.append(row)
    return rows


PROMPT_SETS = {  # how each bundled-corpus prompts file was cut (python -m specserve.train.prompts ...)
    "prompts.jsonl": "code openings (`python -m specserve.train.prompts --count 408`)",
    "cont_prompts.jsonl": "mid-file code contexts (`python -m specserve.train.prompts --kind continuations "
                          "--count 2000`)",
    "cont_prompts2.jsonl": "further mid-file code contexts (`python -m specserve.train.prompts --kind continuations "
                           "--count 2500 --seed 1 --exclude runs/drafters/cont_prompts.jsonl`)",
    "cont_prompts3.jsonl": "further mid-file code contexts (`python -m specserve.train.prompts --kind continuations "
                           "--count 2500 --seed 2 --exclude runs/drafters/cont_prompts.jsonl "
                           "runs/drafters/cont_prompts2.jsonl`)",
    "every_kind_prompts.jsonl": "mid-file code contexts cut at every kind of point (`python -m specserve.train.prompts "
                                "--kind continuations --count 1280 --seed 23 --cut-kinds "
                                "after_newline,line_end,mid_line`)",
    "cont_prompts4.jsonl": "further mid-file code contexts (`python -m specserve.train.prompts --kind continuations "
                           "--count 2500 --seed 4 --exclude runs/drafters/cont_prompts.jsonl "
                           "runs/drafters/cont_prompts2.jsonl runs/drafters/cont_prompts3.jsonl "
                           "runs/drafters/val_prompts.jsonl`)",
}


def data_line(data_dir: Path, meta: dict[str, Any]) -> str:
    settings = meta["settings"]
    prompts = Path(settings["prompts"]).name
    return (f"- Data `{data_dir}`: `specserve train prepare --prompts {settings['prompts']} --samples-per-prompt "
            f"{settings['samples_per_prompt']} --temperature {settings['temperature']} --max-new-tokens "
            f"{settings['max_new_tokens']}" + (f" --seed {settings['seed']}" if settings.get("seed") else "")
            + f"`: the demo target regenerated {meta['sequences']} responses "
            f"({meta['response_tokens']} response tokens, {meta['tokens']} with prompts) to "
            f"{meta['sequences'] // settings['samples_per_prompt']} {PROMPT_SETS.get(prompts, prompts)} of the "
            "standard library's training split; none come from the evaluation suites.")


def card(kind: str, algorithm: str, stages: list[tuple[Path, str]], data: list[tuple[Path, dict[str, Any]]],
         rows: list[dict[str, Any]], spec: SpeculativeConfig, calibration: list[dict[str, Any]] | None = None,
         calibration_prompts: str | None = None, init_from: str | None = None) -> str:
    """stages: (run directory, its training command) in order; a later stage starts from the one before
    (`--init-from`). data: (prepared directory, its meta.json) of every data set the stages used. init_from: what
    the first stage started from, where that is an earlier drafter rather than random weights."""
    lines = [
        f"# demo-{kind}: {'EAGLE-3' if kind == 'eagle3' else 'DFlash'} drafter for the bundled demo target",
        "",
        f"Serve it: `specserve serve --model demo --speculative-algorithm {algorithm}` (picked by default for the "
        "demo target).",
        f"Defaults it runs with: {json.dumps({k: v for k, v in vars(spec).items() if v is not None})}.",
        "",
        "## Training",
        *[data_line(d, meta) for d, meta in data],
        *([f"- Initialised from {init_from}."] if init_from else []),
    ]
    steps = tokens = 0
    for i, (run, cmd) in enumerate(stages, 1):
        summary = json.loads((run / "train_summary.json").read_text())
        t = summary["time_share"]
        steps, tokens = steps + summary["steps"], tokens + summary["tokens_seen"]
        lines += [
            f"- Stage {i}: `{cmd}` on 2 CPU cores ({summary['precision']}; other jobs shared the cores, so "
            "tokens/s is a floor): "
            f"{summary['steps']} steps × 8 sequences, {summary['tokens_seen']} tokens at {run_tokens_per_s(summary)} "
            f"tokens/s, final loss {summary['final_loss']}; time: target forward {t['target']:.0%}, drafter "
            f"forward {t['drafter_fwd']:.0%}, drafter backward {t['drafter_bwd']:.0%}.",
        ]
    lines += [
        f"- In all: {steps} steps, {tokens} tokens seen; then `python scripts/finalize_drafters.py` (bf16 export, "
        "checked to load back with identical outputs).",
    ]
    for c in calibration or []:
        grid = ", ".join(f"{t} → {a:.2f}" for t, a in c["accept_length"].items())
        if c.get("field", "tree_temperature") == "tree_temperature":
            what, flags, how = "DDTree temperature", "", "greedy accept length"
        else:
            what = "Draft sampling temperature (× the request's)"
            flags = f" --temperature {c['temperature']} --seeds {c['seeds']}"
            how = f"accept length sampled at temperature {c['temperature']} (mean of seeds 0–{c['seeds'] - 1})"
        lines.append(
            f"- {what} {c['best']} (`dflash_config.{c.get('field', 'tree_temperature')}`): `specserve train "
            f"calibrate --drafter src/specserve/assets/models/demo-{kind} --suite {c['suite']}{flags} --write` "
            f"measured {how}, {c['max_new_tokens']} tokens, budget {c['ddtree_budget']}, on {c['prompts']} "
            f"validation contexts of the training split ({grid})"
            + (f"; the contexts: `{calibration_prompts}`" if calibration_prompts else "") + ".")
    lines += [
        "",
        "## Acceptance on the demo target (mean accept length, bonus token included; CPU fp32)",
        "",
        "| view | accept length | goal | speedup vs plain | loop measure (4-grams) | greedy identical | command |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "by_kind" in r:  # the headline: the worst kind's accept length over its tasks that do not loop
            kinds = ", ".join(f"{k} {g['accept_length_nonlooping']:.2f} ({g['nonlooping_tasks']}/{g['tasks']})"
                              for k, g in r["by_kind"].items())
            r = {**r, "view": f"{r['view']}: {kinds}; all tasks {r['accept_length']:.2f}",
                 "accept_length": r["headline_accept_length"]}
        goal = "" if r["goal"] is None else f"≥ {r['goal']}"
        seeds = r.get("accept_length_by_seed")
        spread = "" if not seeds else (f" (seeds {'/'.join(seeds)}: {'/'.join(f'{a:.2f}' for a in seeds.values())}, "
                                       f"mean {r['accept_length_mean_of_seeds']:.2f})")
        lines.append(f"| {r['view']} | {r['accept_length']:.2f}{spread} | {goal} | {r['speedup']:.2f}× | "
                     f"{r['loop_4gram']:.2f} | {r.get('identical_to_plain', '(sampled)')} | `{r['command']}` |")
    lines += ["", "Measured by `python scripts/finalize_drafters.py` on the bundled bf16 files; `acceptance.json` "
              "holds the full results.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--eagle3", type=Path, nargs="+", default=[Path("runs/drafters/eagle3")],
                    help="training runs in order (each later one --init-from the one before); the last is bundled")
    ap.add_argument("--dflash", type=Path, nargs="+", default=[Path("runs/drafters/dflash")])
    ap.add_argument("--data", type=Path, nargs="+", default=[Path("runs/drafters/data")],
                    help="every prepared data directory the runs trained on (described on the card)")
    ap.add_argument("--only", choices=("eagle3", "dflash"), default=None)
    ap.add_argument("--eagle3-command", action="append", default=None,
                    help="the training command of each --eagle3 run, in order (for the card)")
    ap.add_argument("--dflash-command", action="append", default=None)
    ap.add_argument("--eagle3-init-from", default=None,
                    help="for the card: what the first --eagle3 run's --init-from drafter is (how it was trained)")
    ap.add_argument("--dflash-init-from", default=None)
    ap.add_argument("--dflash-calibrate-suite", default=None,
                    help="training-split prompts (JSONL) to pick the DFlash drafter's DDTree temperature on")
    ap.add_argument("--dflash-calibrate-temperature", type=float, default=None,
                    help="also calibrate the DFlash drafter's draft sampling temperature on --dflash-calibrate-suite "
                         "sampled at this temperature")
    ap.add_argument("--dflash-calibrate-prompts-command", default=None,
                    help="the command that wrote --dflash-calibrate-suite (for the card)")
    a = ap.parse_args()
    data = [(d, json.loads((d / "meta.json").read_text())) for d in a.data]
    jobs = [("eagle3", "EAGLE3", a.eagle3, "sglang", a.eagle3_command, a.eagle3_init_from),
            ("dflash", "DFLASH", a.dflash, "dflash", a.dflash_command, a.dflash_init_from)]
    for kind, algorithm, runs, fmt, cmds, init_from in jobs:
        if a.only and a.only != kind:
            continue
        if cmds is None or len(cmds) != len(runs):
            ap.error(f"give one --{kind}-command per --{kind} run ({len(runs)})")
        run = runs[-1]
        dest = ASSETS / f"demo-{kind}"
        export(ExportConfig(drafter=run, target="demo", out=dest, format=fmt, dtype="bfloat16"))
        calibration = []
        if kind == "dflash" and a.dflash_calibrate_suite:
            temperatures = [0.0] + ([a.dflash_calibrate_temperature] if a.dflash_calibrate_temperature else [])
            for t in temperatures:
                calibration.append(calibrate_tree_temperature(CalibrateConfig(
                    drafter=dest, suite=a.dflash_calibrate_suite, write=True, temperature=t, seeds=2,
                    grid=GREEDY_GRID if t == 0 else SAMPLED_GRID)))
                print(json.dumps({"calibration": calibration[-1]}), flush=True)
        rows = measure(algorithm, dest)
        spec = replace(resolve(algorithm, dest), draft_model_path=dest.name)  # the bundled name, not this path
        (dest / "MODEL_CARD.md").write_text(card(kind, algorithm, list(zip(runs, cmds, strict=True)), data, rows,
                                                 spec, calibration, a.dflash_calibrate_prompts_command, init_from))
        readme = dest / "README.md"  # export's card names the directory it wrote; the bundled name resolves anywhere
        readme.write_text(readme.read_text().replace(str(dest.resolve()), dest.name).replace(str(dest), dest.name))
        (dest / "acceptance.json").write_text(json.dumps({"views": rows, "calibration": calibration} if calibration
                                                         else rows, indent=1) + "\n")
        print(json.dumps({"drafter": str(dest), "views": rows}))


if __name__ == "__main__":
    main()

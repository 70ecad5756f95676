"""`specserve train prepare | eagle3 | dflash | dflash2 | export | calibrate`: drafter training from the command line.

    specserve train prepare --target demo --out runs/data
    specserve train eagle3 --target demo --data runs/data --out runs/eagle3 --steps 2000
    torchrun --nproc-per-node 2 -m specserve.train.cli dflash --target demo --data runs/data --out runs/dflash
    specserve train export --drafter runs/eagle3 --target demo --format sglang --out exported/eagle3
    specserve train calibrate --drafter exported/dflash --suite val.jsonl --write
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specserve.cli_args import run_parsed

if TYPE_CHECKING:
    from specserve.train.trainer import Trainer


def _prepare(a: argparse.Namespace) -> int:
    from specserve.train.data import PrepareConfig, prepare

    extra = {"prompts": a.prompts} if a.prompts is not None else {}
    cfg = PrepareConfig(target=a.target, out=a.out, temperature=a.temperature, top_p=a.top_p,
                        max_new_tokens=a.max_new_tokens, samples_per_prompt=a.samples_per_prompt,
                        batch_size=a.batch_size, shard_size=a.shard_size, limit=a.limit, seed=a.seed,
                        device=a.device, dtype=a.dtype, enforce_eager=a.enforce_eager, max_minutes=a.max_minutes,
                        **extra)
    print(json.dumps(prepare(cfg)))
    return 0


def run_training(kind: str, a: argparse.Namespace) -> tuple[Trainer, dict[str, Any]]:
    """Build everything for `kind` from parsed flags, train; returns the Trainer (its objective holds the
    trained drafter) and the summary. Flags and the target/drafter/data fit are checked before the first step."""
    from specserve.models.llama import CausalLM
    from specserve.models.loader import load_model
    from specserve.train.data import load_data
    from specserve.train.distributed import init_distributed
    from specserve.train.evaluate import AcceptanceEvaluator, EvalConfig
    from specserve.train.trainer import Objective, TrainConfig, Trainer

    cfg = TrainConfig(out=a.out, steps=a.steps, batch_size=a.batch_size, lr=a.lr, warmup_steps=a.warmup_steps,
                      min_lr_ratio=a.min_lr_ratio, weight_decay=a.weight_decay, grad_clip=a.grad_clip,
                      save_every=a.save_every, log_every=a.log_every, eval_every=a.eval_every, seed=a.seed,
                      precision=a.precision, resume=a.resume, progress=not a.no_progress,
                      max_minutes=a.max_minutes, checkpoint_dtype=a.checkpoint_dtype)
    eval_cfg = EvalConfig(suite=a.eval_suite, num_prompts=a.eval_prompts, max_new_tokens=a.eval_max_new_tokens)
    ctx, device = init_distributed(a.device)
    bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda"
                                        and torch.cuda.is_bf16_supported())
    target, tcfg, target_dir = load_model(a.target, device, torch.bfloat16 if bf16 else torch.float32)
    assert isinstance(target, CausalLM)
    data, info = load_data(a.data, tcfg.vocab_size, a.max_len)
    objective: Objective
    if kind == "eagle3":
        from specserve.train.eagle3 import Eagle3TrainConfig, build_eagle3

        aux = tuple(a.aux_layer_ids) if a.aux_layer_ids else None
        objective = build_eagle3(target, data, Eagle3TrainConfig(
            ttt_steps=a.ttt_steps, step_decay=a.step_decay, draft_vocab_size=a.draft_vocab_size, aux_layer_ids=aux,
            init_from=a.init_from, head_from_target=not a.random_head, seed=a.seed))
    else:
        from specserve.train.dflash import DFlashTrainConfig, build_dflash

        ids = tuple(a.target_layer_ids) if a.target_layer_ids else None
        objective = build_dflash(target, target_dir, DFlashTrainConfig(
            block_size=a.block_size, anchors_per_seq=a.anchors_per_seq, gamma=a.gamma, num_layers=a.num_layers,
            target_layer_ids=ids, mask_token_id=a.mask_token_id, init_from=a.init_from, seed=a.seed,
            soft_label_weight=a.soft_label_weight,
            dflash2=(a.conv_kernel_size, a.conv_group_size, a.selector_rank, a.selector_top_k)
            if kind == "dflash2" else None,
            selector_weight=getattr(a, "selector_weight", 1.0)))
    if a.feature_cache is not None:
        from specserve.train.features import build_feature_cache

        objective.use_features(build_feature_cache(a.feature_cache, target, target_dir, objective.capture, data,
                                                   a.max_len, progress=cfg.progress and ctx.main))
    evaluate = None
    if cfg.eval_every:
        ref = Path(a.reference_draft) if a.reference_draft else None
        evaluate = AcceptanceEvaluator(kind, target, target_dir, eval_cfg, ref)
    info = {**info, "target": str(target_dir)}
    if info.get("dropped_short") and ctx.main:
        print(f"note: {info['dropped_short']} sequences with < 2 response tokens within --max-len were left out",
              file=sys.stderr)
    trainer = Trainer(cfg, objective, data, ctx, device, evaluate, info)
    return trainer, trainer.run()


def _train(kind: str) -> Any:
    def handler(a: argparse.Namespace) -> int:
        trainer, summary = run_training(kind, a)
        if trainer.ctx.main:
            print(json.dumps(summary))
        return 0

    return handler


def _export(a: argparse.Namespace) -> int:
    from specserve.train.export import ExportConfig, export

    print(json.dumps(export(ExportConfig(drafter=a.drafter, target=a.target, out=a.out, format=a.format,
                                         dtype=a.dtype))))
    return 0


def _calibrate(a: argparse.Namespace) -> int:
    from specserve.train.calibrate import (
        GREEDY_GRID,
        REVEAL_GRID,
        REVEALS,
        SAMPLED_GRID,
        CalibrateConfig,
        calibrate_tree_temperature,
    )

    grid = (a.grid if a.grid is not None else REVEAL_GRID if a.field in REVEALS
            else GREEDY_GRID if a.temperature == 0 else SAMPLED_GRID)
    print(json.dumps(calibrate_tree_temperature(CalibrateConfig(
        drafter=a.drafter, suite=a.suite, grid=tuple(grid), target=a.target, num_prompts=a.prompts,
        max_new_tokens=a.max_new_tokens, ddtree_budget=a.ddtree_budget, write=a.write,
        temperature=a.temperature, seeds=a.seeds, field=a.field))))
    return 0


def _common_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="demo", help="target model: a HF directory or `demo`")
    p.add_argument("--data", type=Path, nargs="+", required=True,
                   help="one or more directories written by `specserve train prepare` (their sequences are pooled)")
    p.add_argument("--out", type=Path, required=True, help="run directory (checkpoint, drafter/, logs)")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per process per step")
    p.add_argument("--max-len", type=int, default=1024, help="cut sequences to this many tokens")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup-steps", type=int, default=None, help="default: 4%% of --steps")
    p.add_argument("--min-lr-ratio", type=float, default=0.05)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--save-every", type=int, default=500)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--precision", default="auto", help="auto (bf16 on CUDA that has it, else fp32) | bf16 | fp32")
    p.add_argument("--device", default=None, help="auto | cpu | cuda[:N] (under torchrun: cuda:LOCAL_RANK)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out exactly where it stopped")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop after this many minutes with a checkpoint; `--resume` continues (a run in chunks)")
    p.add_argument("--checkpoint-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="bfloat16: checkpoint.pt at half the size (weights and optimizer state rounded at every save, "
                        "and the run goes on from the rounded state, so a resume loses nothing)")
    p.add_argument("--feature-cache", type=Path, default=None,
                   help="directory of the target's features, computed once per sequence on first use and read "
                        "every epoch after (the target is not run again); a killed build resumes")
    p.add_argument("--init-from", default=None, help="start from this drafter directory instead of random weights")
    p.add_argument("--eval-every", type=int, default=0,
                   help="acceptance evaluation every N steps (0 = off); the best one's drafter is kept in --out/best/")
    p.add_argument("--eval-suite", default="stdlib-val",
                   help="stdlib-val (the standard library's validation split cut at every kind of point) | coding10 "
                        "| heldout-code | FILE.jsonl; choosing a checkpoint on heldout-code spends the held-out suite")
    p.add_argument("--eval-prompts", type=int, default=12)
    p.add_argument("--eval-max-new-tokens", type=int, default=32)
    p.add_argument("--reference-draft", default=None, help="a drafter to compare with at each evaluation")


def add_train_parsers(subparsers: Any) -> None:
    p = subparsers.add_parser("prepare", help="regenerate responses with the target; write token shards")
    p.add_argument("--target", default="demo")
    p.add_argument("--prompts", type=Path, default=None,
                   help="JSONL with `prompt` or chat `messages` per line (default: the bundled stdlib openings)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--samples-per-prompt", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--shard-size", type=int, default=256, help="sequences per shard")
    p.add_argument("--limit", type=int, default=None, help="use the first N prompts")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--enforce-eager", action="store_true",
                   help="eager decode steps (no compile per batch size; on CPU a wide batch is matmul-bound)")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="start no shard after this many minutes; rerun the same command to go on (chunks)")
    p.set_defaults(func=_prepare)

    e = subparsers.add_parser("eagle3", help="train an EAGLE-3 drafter (training-time test)")
    _common_train_args(e)
    e.add_argument("--ttt-steps", type=int, default=7, help="unrolled steps of the training-time test")
    e.add_argument("--step-decay", type=float, default=0.8, help="loss weight of step i is decay^i")
    e.add_argument("--draft-vocab-size", type=int, default=None, help="default min(32000, vocab_size)")
    e.add_argument("--aux-layer-ids", type=int, nargs=3, default=None, help="HF hidden_states indices to tap")
    e.add_argument("--random-head", action="store_true", help="do not start lm_head from the target's")
    e.set_defaults(func=_train("eagle3"))

    for kind in ("dflash", "dflash2"):
        d = subparsers.add_parser(kind, help="train a DFlash block drafter" if kind == "dflash" else
                                  "train a DFlash 2 block drafter (convolutions and a candidate selector; --init-from "
                                  "a DFlash drafter starts from what it drafts)")
        _common_train_args(d)
        d.add_argument("--block-size", type=int, default=None, help="default 16 (or the --init-from drafter's)")
        d.add_argument("--anchors-per-seq", type=int, default=64)
        d.add_argument("--gamma", type=float, default=7.0, help="position k weight exp(-(k-1)/gamma)")
        d.add_argument("--num-layers", type=int, default=2)
        d.add_argument("--target-layer-ids", type=int, nargs="+", default=None,
                       help="target layers whose output to tap")
        d.add_argument("--mask-token-id", type=int, default=None, help="default: the tokenizer's <|mask|>")
        d.add_argument("--soft-label-weight", type=float, default=0.0,
                       help="weight a of distillation: loss = (1-a) CE(data token) + a CE(target distribution)")
        if kind == "dflash2":
            d.add_argument("--conv-kernel-size", type=int, default=4, help="taps of each causal convolution")
            d.add_argument("--conv-group-size", type=int, default=64,
                           help="hidden channels per group sharing a dynamic tap (must divide hidden_size)")
            d.add_argument("--selector-rank", type=int, default=32, help="rank of the selector's pairwise term")
            d.add_argument("--selector-top-k", type=int, default=8, help="candidates per draft slot")
            d.add_argument("--selector-weight", type=float, default=1.0,
                           help="weight of the selector's cross-entropy beside the block loss")
        d.set_defaults(func=_train(kind))

    x = subparsers.add_parser("export", help="write a drafter as a HF directory SGLang / vLLM / DFlash load")
    x.add_argument("--drafter", type=Path, required=True, help="a drafter directory or a training run directory")
    x.add_argument("--target", default="demo")
    x.add_argument("--format", required=True, choices=("sglang", "vllm", "dflash"))
    x.add_argument("--out", type=Path, required=True)
    x.add_argument("--dtype", default="bfloat16", help="float32 | float16 | bfloat16")
    x.set_defaults(func=_export)

    c = subparsers.add_parser("calibrate", help="pick a DFlash drafter's DDTree temperature (greedy) or its draft "
                              "sampling temperature (--temperature > 0) on validation prompts")
    c.add_argument("--drafter", type=Path, required=True, help="a DFlash drafter directory (config.json + weights)")
    c.add_argument("--suite", required=True, help="JSONL of training-split prompts (not heldout-code / coding10)")
    c.add_argument("--target", default="demo")
    c.add_argument("--grid", type=float, nargs="+", default=None,
                   help="temperatures to try (default: 0.5 ... 1.0 greedy; 1.0 ... 1.6 with --temperature)")
    c.add_argument("--temperature", type=float, default=0.0,
                   help="0: calibrate dflash_config.tree_temperature on greedy decoding; > 0: calibrate "
                        "dflash_config.sample_temperature on decoding sampled at this temperature")
    c.add_argument("--field", choices=("tree_temperature", "sample_temperature", "greedy_reveal", "sample_reveal"),
                   default=None,
                   help="the dflash_config field to calibrate (default: tree_temperature, or sample_temperature with "
                        "--temperature > 0); greedy_reveal (--temperature 0) / sample_reveal (--temperature > 0): how "
                        "many tokens of a greedy / sampled tree's first path the drafter is shown, grid default "
                        "0 1 2 3")
    c.add_argument("--seeds", type=int, default=2, help="sampled runs averaged per temperature (with --temperature)")
    c.add_argument("--prompts", type=int, default=64, help="prompts of the suite to use")
    c.add_argument("--max-new-tokens", type=int, default=32)
    c.add_argument("--ddtree-budget", type=int, default=16)
    c.add_argument("--write", action="store_true", help="write the best temperature into the drafter's config.json")
    c.set_defaults(func=_calibrate)


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (`python -m specserve.train.cli ...`, e.g. under torchrun)."""
    parser = argparse.ArgumentParser(prog="specserve train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_parsers(parser.add_subparsers(dest="command", required=True))
    a = parser.parse_args(argv)
    return run_parsed(a, f"specserve train {a.command}")


if __name__ == "__main__":
    raise SystemExit(main())

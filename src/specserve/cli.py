"""`specserve` command line: generate, serve, bench, train, deploy, train-target."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from specserve.bench.acceptance_cli import add_acceptance_parser
from specserve.bench.cli import add_bench_parsers
from specserve.cli_args import (
    add_model_args,
    add_sampling_args,
    add_speculative_args,
    run_parsed,
    sampling_from_args,
    speculative_from_args,
)
from specserve.deploy.cli import add_deploy_parsers
from specserve.server.cli import add_serve_parser
from specserve.train.cli import add_train_parsers


class AdaptiveFlag(argparse.BooleanOptionalAction):
    """--[no-]speculative-adaptive, remembering whether it was given (`adaptive_given`): asked for explicitly with
    no drafter it is an error; by default it just does not apply."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: str | Sequence[Any] | None, option_string: str | None = None) -> None:
        super().__call__(parser, namespace, values, option_string)
        namespace.adaptive_given = True


def _generate(a: argparse.Namespace) -> int:
    from specserve.engine.llm import LLM

    params = sampling_from_args(a)  # validate flags before loading anything
    spec = speculative_from_args(a)
    if a.speculative_adaptive and not spec.enabled and a.adaptive_given:
        raise ValueError("--speculative-adaptive needs a drafter: add --speculative-algorithm (NGRAM, SUFFIX, "
                         "EAGLE3, DFLASH, STANDALONE) or drop the flag")
    llm = LLM(a.model, device=a.device, dtype=a.dtype, quantization=a.quantization, speculative=spec,
              draft_dtype=a.speculative_draft_dtype, adaptive=a.speculative_adaptive and spec.enabled,
              adaptive_profile=a.speculative_adaptive_profile, enforce_eager=not a.compile)
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) if a.chat else p
               for p in a.prompt]
    results = llm.generate(prompts, params)  # one continuous batch
    for text, res in zip(a.prompt, results, strict=True):
        if a.json:
            out = {
                "text": res.text, "token_ids": res.token_ids, "num_tokens": res.num_tokens,
                "prompt_tokens": res.prompt_tokens, "finish_reason": res.finish_reason,
                "elapsed_s": round(res.elapsed_s, 4), "tokens_per_s": round(res.tokens_per_s, 2),
                "speculative_algorithm": spec.algorithm, "quantization": llm.quantization,
            }
            if spec.enabled:
                out.update({
                    "adaptive": llm.adaptive,
                    "accept_length": round(res.accept_length, 4), "num_verify_steps": res.num_verify_steps,
                    "accept_per_position": [round(x, 4) for x in res.accept_per_position],
                    "draft_s": round(res.draft_s, 4), "verify_s": round(res.verify_s, 4),
                })
            print(json.dumps(out))
        else:
            print(text + res.text if not a.chat else res.text)
            print(f"[{res.num_tokens} tokens, {res.tokens_per_s:.1f} tok/s"
                  + (f", accept length {res.accept_length:.2f}" if spec.enabled else "") + "]", file=sys.stderr)
    return 0


def _train_target(a: argparse.Namespace) -> int:
    from specserve.train.target import TargetTrainConfig, train

    cfg = TargetTrainConfig(
        out=Path(a.out), work=Path(a.work), vocab_size=a.vocab_size, hidden_size=a.hidden_size,
        num_layers=a.num_layers, num_heads=a.num_heads, num_kv_heads=a.num_kv_heads,
        intermediate_size=a.intermediate_size, seq_len=a.seq_len, batch_size=a.batch_size, lr=a.lr,
        warmup_steps=a.warmup_steps, max_steps=a.max_steps, max_minutes=a.max_minutes, seed=a.seed,
        threads=a.threads, compile=a.compile, init_from=Path(a.init_from) if a.init_from else None,
        loop_eval=not a.no_loop_eval, eval_every=a.eval_every, save_every=a.eval_every,
    )
    print(json.dumps(train(cfg, resume=a.resume)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text offline (plain or speculative)")
    add_model_args(g)
    g.add_argument("--prompt", required=True, action="append",
                   help="repeatable: several prompts decode as one continuous batch (one output each, in order)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    add_sampling_args(g)
    add_speculative_args(g)
    g.add_argument("--speculative-adaptive", action=AdaptiveFlag, default=True,
                   help="pick each step's draft width (or none) from a cost profile measured once per machine, as "
                        "`serve` does (the default): a drafter that does not pay on a prompt is not verified; "
                        "--no-speculative-adaptive drafts and verifies the configured width every step")
    g.add_argument("--speculative-adaptive-profile", default=None, metavar="PATH",
                   help="the cost profile to reuse (default: the per-machine one, measured when missing)")
    g.add_argument("--compile", action="store_true",
                   help="compile the decode steps first (tens of seconds once, cached on disk; pays off over long "
                        "outputs; `serve` compiles them by default: see its --enforce-eager)")
    g.set_defaults(func=_generate, adaptive_given=False)

    t = sub.add_parser("train-target", help="train the bundled demo target (tokenizer + Qwen3 model)")
    t.add_argument("--out", default="runs/demo-target")
    t.add_argument("--work", default="runs/target-work")
    t.add_argument("--vocab-size", type=int, default=8192)
    t.add_argument("--hidden-size", type=int, default=384)
    t.add_argument("--num-layers", type=int, default=6)
    t.add_argument("--num-heads", type=int, default=6)
    t.add_argument("--num-kv-heads", type=int, default=2)
    t.add_argument("--intermediate-size", type=int, default=1024)
    t.add_argument("--seq-len", type=int, default=512)
    t.add_argument("--batch-size", type=int, default=16)
    t.add_argument("--lr", type=float, default=1.5e-3)
    t.add_argument("--warmup-steps", type=int, default=100)
    t.add_argument("--max-steps", type=int, default=1700)
    t.add_argument("--max-minutes", type=float, default=None)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--threads", type=int, default=None)
    t.add_argument("--compile", action="store_true", help="torch.compile the training step")
    t.add_argument("--resume", action="store_true")
    t.add_argument("--init-from", default=None, metavar="DIR",
                   help="start from a finished checkpoint's weights (its architecture and tokenizer are kept; the "
                        "size flags are ignored) under a new warm-up and cosine schedule")
    t.add_argument("--eval-every", type=int, default=250, help="steps between evaluations and checkpoints")
    t.add_argument("--no-loop-eval", action="store_true",
                   help="skip the loop measure (greedy repeated 4-grams on the coding prompts) at each evaluation")
    t.set_defaults(func=_train_target)

    add_serve_parser(sub)

    tr = sub.add_parser("train", help="drafter training: prepare data, EAGLE-3, DFlash, export")
    add_train_parsers(tr.add_subparsers(dest="train_command", required=True))

    d = sub.add_parser("deploy", help="freeze a measured configuration into a service; export to SGLang/vLLM")
    add_deploy_parsers(d.add_subparsers(dest="deploy_command", required=True))

    b = sub.add_parser("bench", help="benchmarks: serving sweeps, acceptance per task, comparisons")
    bench_sub = b.add_subparsers(dest="bench_command", required=True)
    add_bench_parsers(bench_sub)
    add_acceptance_parser(bench_sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    return run_parsed(a, f"specserve {a.command}")


if __name__ == "__main__":
    sys.exit(main())

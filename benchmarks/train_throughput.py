"""Drafter-training throughput: the online trainer against the feature cache and a reduced draft vocabulary.

    python benchmarks/train_throughput.py --target smollm2 --data data/smollm2/chat-greedy --steps 8 --rounds 2

Each arm is `specserve train eagle3` for --steps steps, run as a fresh process, the arms interleaved and their
order reversed every other round: `online` (the target runs in every step, the default 32000-token draft
vocabulary), `cached` (the target's features read from a cache built before the first round, the same vocabulary)
and `cached-vd` (the cache and --draft-vocab-size). Tokens/s is the trainer's own (sequence tokens per second
inside the training steps); the cache's one-off build is reported apart, with what it costs per token.
FLOPs per token count the drafter's matmuls (forward and backward, 6 per weight): fc once, then the layer and
the draft LM head once per training-time-test step (the head at the trained response slots only).
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from specserve.bench.machine import cpu_info


def run_arm(base: list[str], extra: list[str], out: Path) -> dict[str, Any]:
    subprocess.run([*base, "--out", str(out), *extra], check=True, capture_output=True)
    summary: dict[str, Any] = json.loads((out / "train_summary.json").read_text())
    return summary


def drafter_flops(target: str, draft_vocab: int, ttt_steps: int, trained: float) -> float:
    """Matmul FLOPs per sequence token, forward and backward, of an EAGLE-3 drafter for `target`; the draft LM
    head runs at the trained (response) slots only, `trained` of all."""
    from specserve.models.loader import load_config, resolve_model_path

    cfg = load_config(resolve_model_path(target))
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim
    q = cfg.num_attention_heads * cfg.head_dim
    layer = 2 * h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size  # attention reads [embed, feature]
    fc = 3 * h * h
    return 6.0 * (fc + ttt_steps * (layer + trained * draft_vocab * h))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--data", type=Path, nargs="+", required=True)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--ttt-steps", type=int, default=7)
    ap.add_argument("--draft-vocab-size", type=int, default=8192)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="train-throughput-"))
    base = [sys.executable, "-m", "specserve.train.cli", "eagle3", "--target", a.target, "--data",
            *map(str, a.data), "--steps", str(a.steps), "--batch-size", str(a.batch_size), "--max-len",
            str(a.max_len), "--ttt-steps", str(a.ttt_steps), "--device", "cpu", "--no-progress",
            "--warmup-steps", "1"]
    cache = ["--feature-cache", str(tmp / "cache")]
    t0 = time.perf_counter()
    built = run_arm([*base[:-2], "--steps", "1", "--warmup-steps", "0"], cache, tmp / "build")
    build_s = time.perf_counter() - t0
    arms = {"online": [], "cached": cache, "cached-vd": [*cache, "--draft-vocab-size", str(a.draft_vocab_size)]}
    rates: dict[str, list[float]] = {k: [] for k in arms}
    for r in range(a.rounds):
        order = list(arms) if r % 2 == 0 else list(reversed(arms))
        for name in order:
            s = run_arm(base, arms[name], tmp / f"{name}-{r}")
            rates[name].append(s["tokens_per_s"])
            print(f"round {r} {name}: {s['tokens_per_s']} tok/s", file=sys.stderr)
    data_tokens = built["data"].get("tokens")
    trained = built["data"]["response_tokens"] / data_tokens
    vocab = {"online": 32000, "cached": 32000, "cached-vd": a.draft_vocab_size}
    result = {
        "cpu": cpu_info(), "target": a.target, "steps": a.steps, "batch_size": a.batch_size,
        "ttt_steps": a.ttt_steps, "rounds": a.rounds,
        "tokens_per_s": {k: {"median": statistics.median(v), "runs": v} for k, v in rates.items()},
        "speedup_over_online": {k: round(statistics.median(v) / statistics.median(rates["online"]), 2)
                                for k, v in rates.items()},
        "drafter_gflop_per_token": {k: round(drafter_flops(a.target, v, a.ttt_steps, trained) / 1e9, 3)
                                    for k, v in vocab.items()},
        "cache_build": {"s_with_load": round(build_s, 1), "data_tokens": data_tokens},
    }
    result["drafter_gflop_s"] = {k: round(result["drafter_gflop_per_token"][k] * statistics.median(v), 1)
                                 for k, v in rates.items()}
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

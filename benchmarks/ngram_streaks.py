"""How n-gram lookup's acceptance runs in streaks on the demo's coding prompts: the evidence for the adaptive
policy's request classes (`engine/adaptive.py` `streak_class`).

    python benchmarks/ngram_streaks.py --model demo --num-prompts 32 --output-len 64

At temperature 0 a speculative round accepts exactly the drafts that match the target's greedy continuation,
so rounds can be replayed without verifying anything: each prompt (the served benchmark's: coding, seed 0) is
decoded plainly for --output-len tokens (ignore_eos), then walked the way a full-width NGRAM engine would
speculate through it: at each round the drafter (history = prompt + tokens so far) proposes its tree, the walk
along the greedy tokens gives the accepted drafts, and the next round starts after them and the bonus token.
Rounds whose tree is cut off by the end of the output are left out.

Prints ONE JSON object: per class of the previous round (`streak_class`: none yet, 0 drafts, 1-2, 3 or more)
the rounds and their mean accepted drafts; and the mean accepted drafts by output position (rounds starting in
each eighth of the output).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from specserve.bench.datasets import load_dataset
from specserve.config import SpeculativeConfig
from specserve.engine.adaptive import NUM_CLASSES, streak_class
from specserve.engine.llm import LLM
from specserve.engine.shadow import walk
from specserve.types import SamplingParams


def replay(llm: LLM, prompt: list[int], output: list[int]) -> list[tuple[int, int, int]]:
    """(output position, class before the round, drafts accepted) of each round of full-width speculation."""
    builder = llm.drafter_builder
    assert builder is not None
    params = SamplingParams(max_new_tokens=len(output))
    drafter = builder.for_request(params, None, len(prompt) + len(output) + builder.max_tree_nodes + 2)
    rounds = []
    last: int | None = None
    i = 1  # output[0] comes from the prefill; the first round's root is output[0]
    while i < len(output):
        drafter.prefill(prompt + output[: i - 1])
        tree = drafter.propose(output[i - 1], builder.max_tree_nodes - 1)
        path, decided = walk(tree, output[i:])
        if not decided:
            break
        rounds.append((i, streak_class(last), len(path)))
        last = len(path)
        i += len(path) + 1
    return rounds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    llm = LLM(a.model, speculative=SpeculativeConfig.resolve("NGRAM"))
    prompts = [llm.encode(p.text) for p in load_dataset("coding", a.num_prompts, 0).prompts]
    outputs = llm.generate_plain(prompts, SamplingParams(max_new_tokens=a.output_len, ignore_eos=True))
    by_class: list[list[int]] = [[] for _ in range(NUM_CLASSES)]
    by_position: list[list[int]] = [[] for _ in range(8)]
    for prompt, out in zip(prompts, outputs, strict=True):
        for pos, cls, accepted in replay(llm, prompt, list(out.token_ids)):
            by_class[cls].append(accepted)
            by_position[min(7, pos * 8 // a.output_len)].append(accepted)
    names = ["none yet", "0", "1-2", "3+"]
    print(json.dumps({
        "num_prompts": a.num_prompts, "output_len": a.output_len,
        "max_drafts": llm.spec.num_draft_tokens - 1,
        "by_previous_round": {names[c]: {"rounds": len(x), "mean_accepted": round(statistics.mean(x), 2) if x else None}
                              for c, x in enumerate(by_class)},
        "by_output_eighth": [round(statistics.mean(x), 2) if x else None for x in by_position],
    }, indent=1))


if __name__ == "__main__":
    main()

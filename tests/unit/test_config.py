"""SpeculativeConfig: SGLang's rules, defaults, and errors that name the flag."""

from __future__ import annotations

import pytest

from specserve.config import SpeculativeConfig as S
from specserve.config import parse_dtype
from specserve.types import SamplingParams


def test_defaults_when_only_the_algorithm_is_given() -> None:
    e = S.resolve("EAGLE3", "d")
    assert (e.num_steps, e.eagle_topk, e.num_draft_tokens, e.tree) == (5, 1, 6, "chain")
    t = S.resolve("EAGLE3", "d", eagle_topk=4)
    assert (t.num_steps, t.eagle_topk, t.num_draft_tokens, t.tree) == (5, 4, 8, "eagle")
    d = S.resolve("DFLASH", "d")
    assert (d.dflash_block_size, d.tree, d.num_draft_tokens, d.num_steps, d.eagle_topk) == (16, "ddtree", 16, 1, 1)
    n = S.resolve("ngram")
    assert n.algorithm == "NGRAM" and n.num_draft_tokens == 12 and n.draft_model_path is None
    assert S.resolve("NGRAM", tree="chain").num_steps == 11
    assert not S.resolve(None).enabled


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"algorithm": "MEDUSA"}, "--speculative-algorithm"),
        ({"algorithm": "EAGLE3"}, "--speculative-draft-model-path"),
        ({"algorithm": "NGRAM", "tree": "ddtree", "num_steps": 3, "num_draft_tokens": 4},
         "needs --speculative-algorithm DFLASH"),
        ({"algorithm": "EAGLE3", "draft_model_path": "d", "num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 6},
         "--speculative-num-steps + 1"),
        ({"algorithm": "EAGLE3", "draft_model_path": "d", "num_steps": 2, "eagle_topk": 2, "num_draft_tokens": 8,
          "tree": "eagle"}, "too large"),
        ({"algorithm": "DFLASH", "draft_model_path": "d", "num_steps": 1, "eagle_topk": 1, "num_draft_tokens": 20,
          "dflash_block_size": 16, "tree": "chain"}, "larger than the block allows"),
        ({"algorithm": "DFLASH", "draft_model_path": "d", "num_steps": 1, "eagle_topk": 4, "num_draft_tokens": 8,
          "dflash_block_size": 16, "tree": "ddtree"}, "--speculative-eagle-topk"),
        ({"algorithm": "EAGLE3", "draft_model_path": "d", "num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 1},
         "--speculative-num-draft-tokens"),
        ({"algorithm": "EAGLE3", "draft_model_path": "d", "tree": "forest"}, "--speculative-tree"),
    ],
)
def test_invalid_combinations_name_the_flag(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace("+", r"\+")):
        S(**kwargs)  # type: ignore[arg-type]


def test_tree_capacity_rule_is_inclusive() -> None:
    # num_draft_tokens - 1 <= topk + (steps - 1) * topk^2: 2 + 1*4 = 6 -> 7 allowed, 8 not
    S("EAGLE3", "d", num_steps=2, eagle_topk=2, num_draft_tokens=7, tree="eagle")
    with pytest.raises(ValueError):
        S("EAGLE3", "d", num_steps=2, eagle_topk=2, num_draft_tokens=8, tree="eagle")


def test_sampling_params_validation() -> None:
    for bad, flag in [({"max_new_tokens": 0}, "--max-new-tokens"), ({"temperature": -1}, "--temperature"),
                      ({"top_p": 0}, "--top-p"), ({"top_k": -2}, "--top-k"), ({"min_p": 1.0}, "--min-p"),
                      ({"stop": ("",)}, "--stop")]:
        with pytest.raises(ValueError, match=flag):
            SamplingParams(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--dtype"):
        parse_dtype("int8")

"""`deploy export`'s speculative part for SUFFIX: vLLM's `suffix` method with its suffix_decoding_* keys; SGLang has
no suffix drafter, so the export says so and decodes plainly."""

from __future__ import annotations

import json

from specserve.config import SpeculativeConfig
from specserve.deploy.engine_args import ArgsBuilder
from specserve.deploy.spec_map import sglang_spec, vllm_spec
from specserve.server.serve_config import ServeConfig


def built(engine: str, spec: SpeculativeConfig) -> ArgsBuilder:
    b = ArgsBuilder()
    (vllm_spec if engine == "vllm" else sglang_spec)(b, ServeConfig(speculative=spec), None)
    return b


def test_vllm_gets_the_suffix_method_and_settings() -> None:
    spec = SpeculativeConfig.resolve("SUFFIX", tree="chain", num_draft_tokens=9, suffix_max_tree_depth=12,
                                     suffix_max_cached_requests=50, suffix_max_spec_factor=2.0,
                                     suffix_min_token_prob=0.2)
    b = built("vllm", spec)
    i = b.args.index("--speculative-config")
    assert json.loads(b.args[i + 1]) == {
        "method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_tree_depth": 12,
        "suffix_decoding_max_cached_requests": 50, "suffix_decoding_max_spec_factor": 2.0,
        "suffix_decoding_min_token_prob": 0.2}
    assert not [u for u in b.unmapped if u.flag.startswith("--speculative-suffix")]


def test_vllm_says_the_tree_becomes_a_chain() -> None:
    b = built("vllm", SpeculativeConfig.resolve("SUFFIX"))
    assert any(u.flag == "--speculative-tree" and "chain" in u.reason for u in b.unmapped)


def test_sglang_says_unmapped_with_the_reason() -> None:
    b = built("sglang", SpeculativeConfig.resolve("SUFFIX"))
    assert "--speculative-algorithm" not in b.args
    (u,) = [u for u in b.unmapped if u.flag == "--speculative-algorithm"]
    assert "no suffix" in u.reason and "NGRAM" in u.reason

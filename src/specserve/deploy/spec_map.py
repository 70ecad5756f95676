"""The speculative part of an SGLang or vLLM export (`engine_map.py` does the rest): the algorithm, drafter and
widths as each engine's flags, and what becomes of adaptive speculation there."""

from __future__ import annotations

import json

from specserve.deploy.engine_args import ArgsBuilder
from specserve.server.serve_config import ServeConfig


def adaptive(b: ArgsBuilder, cfg: ServeConfig, sglang: bool) -> None:
    s, on, profile = cfg.speculative, cfg.speculative_adaptive, cfg.speculative_adaptive_profile
    if cfg.speculative_adaptive_trace:
        b.skip("--speculative-adaptive-trace", cfg.speculative_adaptive_trace,
               "specserve's per-step log of decode passes; the engine has no counterpart")
    if not s.enabled or not on:
        b.map("--speculative-adaptive", on, note="plain decoding: nothing to adapt" if not s.enabled else
              "the configured draft width every step: the engine default")
        if profile:
            b.map("--speculative-adaptive-profile", profile, note="not used without adaptive speculation")
        return
    lost = "so at high concurrency it may verify drafts that cost more than they return"
    engine_adapts = sglang and s.algorithm == "EAGLE3" and s.eagle_topk == 1
    if engine_adapts:
        b.map("--speculative-adaptive", on, "--speculative-adaptive", note="SGLang picks the draft steps per "
              "batch-size bucket from a running mean of accepted drafts (0 at large batches in its default table), "
              "not from a measured cost profile")
    elif sglang:
        b.skip("--speculative-adaptive", on, f"SGLang adapts EAGLE/EAGLE3 chains (topk 1) only; {s.algorithm} with "
               f"topk {s.eagle_topk} verifies the configured width every step, {lost}")
    else:
        b.skip("--speculative-adaptive", on, "vLLM verifies num_speculative_tokens every step at every batch size "
               f"(its adaptive verification is for method dspark only), {lost}")
    if profile:
        tables = "; SGLang's --speculative-adaptive-config takes step tables per batch size: its default is used"
        b.skip("--speculative-adaptive-profile", profile, "specserve's cost profile (step time per batch size and "
               "verify width) has no engine format" + (tables if engine_adapts else ""))


#: what the engines do with a DFlash2DraftModel checkpoint (read in their merged sources, see docs/architecture.md)
DFLASH2_SGLANG = ("a DFlash2DraftModel: SGLang's DFLASH switches on its convolutions and candidate selector by the "
                  "architecture (sgl-project/sglang#35371) and verifies the selector's one path; releases without "
                  "that change refuse the architecture at load")
DFLASH2_VLLM = ("a DFlash2DraftModel: vLLM's DFlash 2 speculator (vllm-project/vllm#52816) convolves over "
                "1 + num_speculative_tokens positions, so it drafts the whole trained block, and verifies the "
                "selector's one path")


def sglang_spec(b: ArgsBuilder, cfg: ServeConfig, drafter: str | None, dflash2: bool = False) -> None:
    s = cfg.speculative
    if not s.enabled:
        b.map("--speculative-algorithm", "NONE", note="plain decoding: no speculative flags")
        return
    if s.algorithm == "SUFFIX":
        b.skip("--speculative-algorithm", s.algorithm, "SGLang has no suffix-tree drafter (its algorithms: EAGLE, "
               "EAGLE3, NEXTN, STANDALONE, NGRAM, DFLASH), so the export decodes plainly; NGRAM is its nearest "
               "(a prompt-lookup trie, without SUFFIX's cache of earlier requests' outputs)")
        return
    b.map("--speculative-algorithm", s.algorithm, "--speculative-algorithm", s.algorithm)
    if s.algorithm == "NGRAM":
        b.map("--speculative-num-draft-tokens", s.num_draft_tokens, "--speculative-num-draft-tokens",
              str(s.num_draft_tokens))
        b.map("--speculative-ngram-max-breadth", s.ngram_max_breadth, "--speculative-ngram-max-bfs-breadth",
              str(s.ngram_max_breadth))
        b.map("--speculative-ngram-max-match", s.ngram_max_match, "--speculative-ngram-max-trie-depth",
              str(s.ngram_max_match), note="longest suffix stored and matched")
        b.skip("--speculative-ngram-min-match", s.ngram_min_match,
               "SGLang matches every suffix length up to the trie depth; there is no minimum")
        b.skip("--speculative-num-steps", s.num_steps, "SGLang's NGRAM takes its depth from the trie, not a flag")
        if s.tree == "chain":
            b.skip("--speculative-tree", s.tree, "SGLang's NGRAM always verifies a BFS tree of matches")
        else:
            b.map("--speculative-tree", s.tree, note="SGLang's NGRAM verifies a BFS tree of matches")
        return
    assert drafter is not None
    b.map("--speculative-draft-model-path", s.draft_model_path, "--speculative-draft-model-path", drafter,
          note=DFLASH2_SGLANG if dflash2 else "")
    if s.algorithm == "DFLASH":
        bs = s.dflash_block_size or 16
        b.map("--speculative-dflash-block-size", bs, "--speculative-dflash-block-size", str(bs))
        b.map("--speculative-num-steps", s.num_steps, note="DFLASH forces 1")
        b.map("--speculative-eagle-topk", s.eagle_topk, note="DFLASH forces 1")
        if s.tree == "ddtree":
            b.skip("--speculative-tree", s.tree, "SGLang verifies the DFlash block as a chain; DDTree's tree "
                   "verification has no SGLang flag, so acceptance will be lower than measured here")
            b.skip("--speculative-num-draft-tokens", s.num_draft_tokens, "the DDTree node budget has no SGLang "
                   "equivalent (DFLASH verifies the block)")
        elif s.num_draft_tokens != bs:
            b.skip("--speculative-num-draft-tokens", s.num_draft_tokens, f"SGLang verifies the whole block "
                   f"({bs}); a narrower verify width is not a flag")
        else:
            b.map("--speculative-num-draft-tokens", s.num_draft_tokens, note="= the block size")
        return
    b.map("--speculative-num-steps", s.num_steps, "--speculative-num-steps", str(s.num_steps))
    b.map("--speculative-eagle-topk", s.eagle_topk, "--speculative-eagle-topk", str(s.eagle_topk))
    b.map("--speculative-num-draft-tokens", s.num_draft_tokens, "--speculative-num-draft-tokens",
          str(s.num_draft_tokens))
    b.map("--speculative-tree", s.tree, note="implied by --speculative-eagle-topk (1 = chain)")


def vllm_spec(b: ArgsBuilder, cfg: ServeConfig, drafter: str | None, dflash2: bool = False) -> None:
    s = cfg.speculative
    if not s.enabled:
        b.map("--speculative-algorithm", "NONE", note="plain decoding: no --speculative-config")
        return
    chain_only = "vLLM drafts a chain only"
    spec: dict[str, object]
    if s.algorithm == "NGRAM":
        spec = {"method": "ngram", "num_speculative_tokens": s.num_steps,
                "prompt_lookup_min": s.ngram_min_match, "prompt_lookup_max": s.ngram_max_match}
        b.map("--speculative-ngram-min-match", s.ngram_min_match, note="prompt_lookup_min")
        b.map("--speculative-ngram-max-match", s.ngram_max_match, note="prompt_lookup_max")
        b.map("--speculative-num-steps", s.num_steps, note="num_speculative_tokens (chain length)")
        b.skip("--speculative-ngram-max-breadth", s.ngram_max_breadth, f"{chain_only}: one match, no tree")
    elif s.algorithm == "SUFFIX":
        spec = {"method": "suffix", "num_speculative_tokens": s.num_draft_tokens - 1,
                "suffix_decoding_max_tree_depth": s.suffix_max_tree_depth,
                "suffix_decoding_max_cached_requests": s.suffix_max_cached_requests,
                "suffix_decoding_max_spec_factor": s.suffix_max_spec_factor,
                "suffix_decoding_min_token_prob": s.suffix_min_token_prob}
        for flag, key in (("max-tree-depth", "max_tree_depth"), ("max-cached-requests", "max_cached_requests"),
                          ("max-spec-factor", "max_spec_factor"), ("min-token-prob", "min_token_prob")):
            b.map(f"--speculative-suffix-{flag}", spec[f"suffix_decoding_{key}"], note=f"suffix_decoding_{key}")
        b.map("--speculative-num-steps", s.num_steps, note="= --speculative-suffix-max-tree-depth for SUFFIX")
    else:
        assert drafter is not None
        method = {"STANDALONE": "draft_model", "EAGLE3": "eagle3", "DFLASH": "dflash"}[s.algorithm]
        if s.algorithm == "DFLASH":
            bs = s.dflash_block_size or 16
            k = (s.num_draft_tokens if s.tree == "chain" and not dflash2 else bs) - 1
            b.map("--speculative-dflash-block-size", bs, note=f"num_speculative_tokens {k} (block minus the root)")
        else:
            k = s.num_steps
            b.map("--speculative-num-steps", s.num_steps, note="num_speculative_tokens (chain length)")
        spec = {"method": method, "model": drafter, "num_speculative_tokens": k}
        b.map("--speculative-draft-model-path", s.draft_model_path,
              note="model (the exported drafter)" + (f"; {DFLASH2_VLLM}" if dflash2 else ""))
    b.map("--speculative-algorithm", s.algorithm, "--speculative-config", json.dumps(spec, separators=(",", ":")),
          note=f"method {spec['method']}")
    width = int(str(spec["num_speculative_tokens"])) + 1
    if s.tree != "chain":
        b.skip("--speculative-tree", s.tree, f"{chain_only}: the {s.tree} tree is not reproduced")
        b.skip("--speculative-num-draft-tokens", s.num_draft_tokens,
               f"{chain_only}: the verify width becomes num_speculative_tokens + 1 = {width}")
    else:
        b.map("--speculative-tree", s.tree, note="vLLM's only shape")
        b.map("--speculative-num-draft-tokens", s.num_draft_tokens, note=f"= num_speculative_tokens + 1 = {width}")
    if s.eagle_topk > 1:
        b.skip("--speculative-eagle-topk", s.eagle_topk, f"{chain_only}: no branching")

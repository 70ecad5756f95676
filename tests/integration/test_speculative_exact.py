"""Greedy speculative decoding equals plain greedy decoding, token for token, for every drafter
and tree mode, with untrained (random-weight) drafters; and sampling keeps the target's distribution.

Speculative runs go through the offline API (`LLM.generate`: the serving engine, a list of prompts as one
continuous batch); the plain reference is the independent oracle of `tests/reference_decoding.py`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from reference_decoding import first_pairs_p_value, generate_plain
from specserve.config import SpeculativeConfig
from specserve.engine.llm import LLM
from specserve.speculative.dflash.checkpoint import init_random_dflash, load_dflash, save_dflash
from specserve.speculative.eagle3.checkpoint import init_random_eagle3
from specserve.speculative.factory import DrafterBuilder, plan_drafter
from specserve.types import GenerationResult, SamplingParams

TEXTS = [
    "def add(a, b):\n    return a + b\n\n\ndef", "import os\nimport sys\n", "class Foo:\n    def __init__(self",
    "x = [1, 2, 3]\nfor i in x:\n", "    return self._", "if __name__ == '__main__':\n", "# comment\n",
    "try:\n    pass\nexcept", "with open(path) as f:\n", "def f(*args, **kwargs):\n",
]


@pytest.fixture(scope="module")
def llm(tiny_dir: Path) -> LLM:
    return LLM(tiny_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    rand = [torch.randint(3, llm.config.vocab_size, (int(n),), generator=gen).tolist() for n in (3, 9, 17, 30)]
    # repeated text makes the lookup drafter accept long runs
    loops = [llm.encode("a = 1\nb = 2\n" * 4), llm.encode("for i in range(10):\n    print(i)\n" * 3)]
    ids = [llm.encode(t) for t in TEXTS] + rand + loops
    ids += [p[: max(1, len(p) // 2)] for p in ids[:4]]
    assert len(ids) >= 20
    return ids


@pytest.fixture(scope="module")
def dflash_dir(tmp_path_factory: pytest.TempPathFactory, llm: LLM) -> Path:
    path = tmp_path_factory.mktemp("dflash")
    init_random_dflash(llm.config, path, seed=3, block_size=8)
    return path


@pytest.fixture(scope="module")
def dflash2_dir(tmp_path_factory: pytest.TempPathFactory, llm: LLM) -> Path:
    """A random DFlash 2 drafter whose selector's pairwise term is large enough to move its laws."""
    path = tmp_path_factory.mktemp("dflash2")
    cfg = init_random_dflash(llm.config, path, seed=4, block_size=8, conv_kernel_size=3, conv_group_size=16,
                             selector_rank=4, selector_top_k=4)
    model = load_dflash(path, llm.config, torch.device("cpu"), torch.float32)
    assert model.candidate_selector is not None
    with torch.no_grad():
        for p in model.candidate_selector.parameters():
            p.mul_(60.0)
    save_dflash(model, cfg, path)
    return path


@pytest.fixture(scope="module")
def eagle_dir(tmp_path_factory: pytest.TempPathFactory, llm: LLM) -> Path:
    path = tmp_path_factory.mktemp("eagle3")
    init_random_eagle3(llm.config, path, seed=4)
    return path


def spec_configs(draft_dir: Path, dflash_dir: Path, eagle_dir: Path,
                 reveal_dir: Path | None = None) -> list[SpeculativeConfig]:
    d, f, e = str(draft_dir), str(dflash_dir), str(eagle_dir)
    reveal = [] if reveal_dir is None else [
        SpeculativeConfig.resolve("DFLASH", str(reveal_dir), dflash_block_size=8, tree="ddtree", num_draft_tokens=12)]
    r = SpeculativeConfig.resolve
    return [
        r("NGRAM", num_draft_tokens=5, tree="chain"),
        r("NGRAM"),
        r("NGRAM", num_draft_tokens=16, num_steps=4, ngram_max_breadth=6),
        r("SUFFIX"),
        r("SUFFIX", tree="chain", num_draft_tokens=6),
        r("SUFFIX", suffix_max_spec_factor=4.0, suffix_min_token_prob=0.0, suffix_max_cached_requests=0),
        r("SUFFIX", suffix_max_tree_depth=3, suffix_max_cached_requests=2),
        r("STANDALONE", d, num_steps=3),
        r("STANDALONE", d, num_steps=1),
        r("STANDALONE", d, num_steps=3, eagle_topk=2, num_draft_tokens=7),
        r("EAGLE3", e, num_steps=3),
        r("EAGLE3", e, num_steps=3, eagle_topk=2, num_draft_tokens=6),
        r("EAGLE3", e, num_steps=2, eagle_topk=3, num_draft_tokens=10),
        r("DFLASH", f, dflash_block_size=8, tree="chain", num_draft_tokens=8),
        r("DFLASH", f, dflash_block_size=8, tree="ddtree", num_draft_tokens=4),
        r("DFLASH", f, dflash_block_size=8, tree="ddtree", num_draft_tokens=24),
        r("DFLASH", f, dflash_block_size=4, tree="ddtree", num_draft_tokens=10),
        *reveal,
    ]


def spec_batch(llm: LLM, spec: SpeculativeConfig) -> Callable[[list[list[int]], list[SamplingParams]],
                                                               list[GenerationResult]]:
    """Load the drafter once; the returned function decodes a batch of prompts speculatively on the engine."""
    builder = DrafterBuilder(plan_drafter(spec, llm.config), llm.model, llm.device, llm.dtype)
    return lambda ids, params: llm.generate_with(builder, ids, params)


def spec_runner(llm: LLM, spec: SpeculativeConfig) -> Callable[[list[int], SamplingParams], GenerationResult]:
    """One prompt at a time (`spec_batch` of one)."""
    batch = spec_batch(llm, spec)
    return lambda ids, params: batch([ids], [params])[0]


def run_spec(llm: LLM, spec: SpeculativeConfig, ids: list[int], params: SamplingParams) -> GenerationResult:
    return spec_runner(llm, spec)(ids, params)


def plain(llm: LLM, ids: list[int], params: SamplingParams) -> GenerationResult:
    return generate_plain(llm.model, [ids], params, llm.eos_ids, llm.tokenizer.decode)[0]


def test_greedy_exact_over_grid(llm: LLM, prompts: list[list[int]], tiny_draft_dir: Path, dflash_dir: Path,
                                eagle_dir: Path, dflash_reveal_dir: Path) -> None:
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    expected = [plain(llm, p, params).token_ids for p in prompts]
    for spec in spec_configs(tiny_draft_dir, dflash_dir, eagle_dir, dflash_reveal_dir):
        steps = 0
        for ids, want, res in zip(prompts, expected, spec_batch(llm, spec)(prompts, [params] * len(prompts)),
                                  strict=True):
            assert res.token_ids == want, (spec, ids)
            steps += res.num_verify_steps
        assert steps <= len(prompts) * 23  # at most one verify round per token after the first


def test_one_prompt_at_a_time_equals_the_batch(llm: LLM, prompts: list[list[int]], tiny_draft_dir: Path,
                                               dflash_dir: Path, eagle_dir: Path) -> None:
    """A prompt decoded alone gives the tokens it gets inside a batch (greedy; a chain, a tree, a block)."""
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    r = SpeculativeConfig.resolve
    for spec in (r("NGRAM"), r("EAGLE3", str(eagle_dir), num_steps=2, eagle_topk=2, num_draft_tokens=5),
                 r("DFLASH", str(dflash_dir), dflash_block_size=8, tree="ddtree", num_draft_tokens=8)):
        batch = spec_batch(llm, spec)
        together = batch(prompts[:8], [params] * 8)
        for ids, res in zip(prompts[:8], together, strict=True):
            assert batch([ids], [params])[0].token_ids == res.token_ids, spec


def test_stops_inside_an_accepted_run(llm: LLM, prompts: list[list[int]], tiny_draft_dir: Path,
                                      dflash_dir: Path, eagle_dir: Path) -> None:
    ids = prompts[-6]  # a looping prompt: long accepted runs
    ref = plain(llm, ids, SamplingParams(max_new_tokens=40, ignore_eos=True))
    eos_tok = ref.token_ids[13]
    stop = ref.text[len(ref.text) // 2: len(ref.text) // 2 + 2]
    cases = [
        SamplingParams(max_new_tokens=7, ignore_eos=True),
        SamplingParams(max_new_tokens=40, stop_token_ids=(eos_tok,)),
        SamplingParams(max_new_tokens=40, stop=(stop,), ignore_eos=True) if stop.strip() else None,
    ]
    runners = [spec_runner(llm, spec) for spec in spec_configs(tiny_draft_dir, dflash_dir, eagle_dir)]
    for params in [c for c in cases if c is not None]:
        want = plain(llm, ids, params)
        for run in runners:
            got = run(ids, params)
            assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)


def test_near_the_context_limit(tmp_path: Path, tiny_draft_dir: Path) -> None:
    from tiny import make_checkpoint

    d = make_checkpoint(tmp_path / "short", "Qwen3ForCausalLM", max_position_embeddings=48)
    llm = LLM(d, device="cpu", dtype="float32")
    ids = llm.encode("a = 1\nb = 2\n" * 3)[:40]
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    want = plain(llm, ids, params)
    assert want.num_tokens == 48 - len(ids)
    df = tmp_path / "df"
    init_random_dflash(llm.config, df, seed=1, block_size=8)
    for spec in (SpeculativeConfig.resolve("NGRAM"), SpeculativeConfig.resolve("STANDALONE", str(tiny_draft_dir)),
                 SpeculativeConfig.resolve("DFLASH", str(df), dflash_block_size=8)):
        assert run_spec(llm, spec, ids, params).token_ids == want.token_ids


@pytest.fixture(scope="module")
def dflash_reveal_dir(tmp_path_factory: pytest.TempPathFactory, llm: LLM) -> Path:
    """A random drafter shown its trees' first paths, sampled ones two tokens deep, greedy ones one (its greedy
    trees sharpened to be deep enough to have something below the first node)."""
    path = tmp_path_factory.mktemp("dflash-reveal")
    init_random_dflash(llm.config, path, seed=3, block_size=8, sample_reveal=2, greedy_reveal=1,
                       tree_temperature=0.05)
    return path


@pytest.mark.parametrize("which", ["standalone-chain", "dflash-ddtree", "dflash-reveal", "dflash2-chain",
                                   "dflash2-ddtree", "ngram-tree", "suffix-tree"])
def test_sampling_matches_plain_distribution(llm: LLM, tiny_draft_dir: Path, dflash_dir: Path,
                                             dflash_reveal_dir: Path, dflash2_dir: Path, which: str) -> None:
    """Chi-square on the joint law of the first two tokens, speculative vs plain, 600 seeds each."""
    spec = {
        "standalone-chain": SpeculativeConfig.resolve("STANDALONE", str(tiny_draft_dir), num_steps=2),
        "dflash-ddtree": SpeculativeConfig.resolve("DFLASH", str(dflash_dir), dflash_block_size=8,
                                                   num_draft_tokens=6),
        "dflash-reveal": SpeculativeConfig.resolve("DFLASH", str(dflash_reveal_dir), dflash_block_size=8,
                                                   num_draft_tokens=6),
        "dflash2-chain": SpeculativeConfig.resolve("DFLASH", str(dflash2_dir), dflash_block_size=8,
                                                   num_draft_tokens=4, tree="chain"),
        "dflash2-ddtree": SpeculativeConfig.resolve("DFLASH", str(dflash2_dir), dflash_block_size=8,
                                                    num_draft_tokens=6),
        "ngram-tree": SpeculativeConfig.resolve("NGRAM"),
        # the cache of earlier outputs (all of this prompt) makes trees from the samples drawn so far
        "suffix-tree": SpeculativeConfig.resolve("SUFFIX", suffix_min_token_prob=0.0),
    }[which]
    ids = llm.encode("a = 1\nb = 2\na = 1\nb")
    n = 600
    sp = spec_batch(llm, spec)([ids] * n, [SamplingParams(max_new_tokens=2, temperature=1.5, top_k=3, seed=s,
                                                          ignore_eos=True) for s in range(n)])
    pl = [plain(llm, ids, SamplingParams(max_new_tokens=2, temperature=1.5, top_k=3, seed=10_000 + s,
                                    ignore_eos=True))
          for s in range(n)]
    p_value = first_pairs_p_value(sp, pl)
    assert p_value > 0.001, (which, p_value)

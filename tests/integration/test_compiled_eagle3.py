"""EAGLE-3's compiled greedy chain rounds (`speculative/eagle3/compiled.py`): they draft what the eager chains
do, and a compiled EAGLE-3 engine gives plain greedy decoding's tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specserve.config import SpeculativeConfig
from specserve.engine.llm import LLM
from specserve.speculative.eagle3.checkpoint import init_random_eagle3
from specserve.speculative.eagle3.compiled import PAD, CompiledChains
from specserve.speculative.factory import DrafterBuilder, plan_drafter
from specserve.types import SamplingParams

PROMPTS = ["def add(a, b):", "import os\n", "class Foo:\n", "x = [1, 2, 3]\n", "for i in range(10):"]
PARAMS = SamplingParams(max_new_tokens=24, ignore_eos=True)


def eagle3_builder(tiny_dir: Path, tmp_path: Path, steps: int) -> tuple[LLM, DrafterBuilder]:
    llm = LLM(tiny_dir, device="cpu", dtype="float32", enforce_eager=True)
    init_random_eagle3(llm.config, tmp_path / "eagle", seed=4)
    spec = SpeculativeConfig.resolve("EAGLE3", str(tmp_path / "eagle"), num_steps=steps, eagle_topk=1,
                                     num_draft_tokens=steps + 1)
    return llm, DrafterBuilder(plan_drafter(spec, llm.config), llm.model, llm.device, llm.dtype)


def test_compiled_eagle3_chains_draft_what_the_eager_chains_do(tiny_dir: Path, tmp_path: Path) -> None:
    """Two drafters fed the same rounds (prompts shorter and longer than a compiled commit holds, accepts of every
    length, skipped rounds whose pairs pile up, rounds cut short): the compiled one proposes the eager one's chains,
    and the rounds whose pending pairs fit a compiled commit ran compiled."""
    llm, builder = eagle3_builder(tiny_dir, tmp_path, steps=3)
    builder.compile_drafting()
    chains = builder.compiled
    assert chains is not None
    ran: list[int] = []
    run = chains.run
    chains.run = lambda cache, tokens, *a: (ran.append(len(tokens)), run(cache, tokens, *a))[1]  # type: ignore
    params = SamplingParams(max_new_tokens=64)
    fast = builder.for_request(params, torch.Generator(), 128)
    builder.compiled = None
    slow = builder.for_request(params, torch.Generator(), 128)
    width = len(builder.capture) * llm.config.hidden_size
    gen = torch.Generator().manual_seed(0)
    for prompt_len in (5, 12):
        prompt = torch.randint(0, llm.config.vocab_size, (prompt_len,), generator=gen).tolist()
        hidden = torch.randn(prompt_len, width, generator=gen)
        for d in (fast, slow):
            d.prefill(prompt, hidden)
        root = 7
        for accepted, skip_next, cut in ((0, False, None), (2, True, None), (1, True, None), (3, False, 2),
                                         (0, False, None), (1, False, 1)):
            trees = [d.propose(root, cut) for d in (fast, slow)]
            assert trees[0].tokens.tolist() == trees[1].tokens.tolist()
            tokens = trees[0].tokens.tolist()[: accepted + 1]
            h = torch.randn(len(tokens), width, generator=gen)
            root = int(torch.randint(0, llm.config.vocab_size, (1,), generator=gen))
            for d in (fast, slow):
                d.accept(tokens, h, root)
            if skip_next:
                for d in (fast, slow):
                    d.skip(root)
                tokens = [root]
                h = torch.randn(1, width, generator=gen)
                root = int(torch.randint(0, llm.config.vocab_size, (1,), generator=gen))
                for d in (fast, slow):
                    d.accept(tokens, h, root)
    assert len(ran) == 11 and max(ran) <= PAD  # the 12-token prompt's first round (13 pending) ran eager
    assert chains.graphs == ["eagle3-chain-1", "eagle3-chain-2", "eagle3-chain-3"]


def test_compiled_eagle3_engine_gives_plain_greedy_tokens(tiny_dir: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """Through the engine, one by one and batched (batched chains draft eager): plain greedy's tokens; a chain
    that fails to compile warns and drafts eager, with the same tokens."""
    llm, _ = eagle3_builder(tiny_dir, tmp_path, steps=2)
    spec = SpeculativeConfig.resolve("EAGLE3", str(tmp_path / "eagle"), num_steps=2, eagle_topk=1,
                                     num_draft_tokens=3)
    plain_one = [llm.generate([p], PARAMS)[0].token_ids for p in PROMPTS[:3]]
    plain_batch = [r.token_ids for r in llm.generate(PROMPTS[:3], PARAMS)]
    compiled = LLM(tiny_dir, device="cpu", dtype="float32", speculative=spec, enforce_eager=False)
    assert [compiled.generate([p], PARAMS)[0].token_ids for p in PROMPTS[:3]] == plain_one
    assert [r.token_ids for r in compiled.generate(PROMPTS[:3], PARAMS)] == plain_batch
    (engine,) = compiled._engines.values()
    assert engine.drafters is not None and engine.drafters.compiled is not None
    assert engine.describe()["compiled_drafting"]

    def broken(self: CompiledChains, steps: int) -> object:
        def chain(*args: object) -> object:
            raise RuntimeError("no C++ compiler found")
        return chain

    monkeypatch.setattr(CompiledChains, "_compile", broken)
    failing = LLM(tiny_dir, device="cpu", dtype="float32", speculative=spec, enforce_eager=False)
    with caplog.at_level("WARNING", logger="specserve.engine"):
        assert [failing.generate([p], PARAMS)[0].token_ids for p in PROMPTS[:3]] == plain_one
    assert "EAGLE-3 2-step chain failed" in caplog.text and "no C++ compiler found" in caplog.text

"""CUDA checks (skipped without a GPU): model parity with CPU, speculative exactness on the device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specserve.config import SpeculativeConfig
from specserve.engine.llm import LLM
from specserve.types import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_cuda_matches_cpu_and_speculation_is_exact(tiny_dir: Path) -> None:
    cpu = LLM(tiny_dir, device="cpu", dtype="float32")
    gpu = LLM(tiny_dir, device="cuda", dtype="float32")
    ids = cpu.encode("def f(x):\n    return")
    x = torch.tensor([ids])
    pos = torch.arange(len(ids))[None]
    diff = (cpu.model(x, pos).logits - gpu.model(x.cuda(), pos.cuda()).logits.cpu()).abs().max().item()
    assert diff < 1e-3
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    want = gpu.generate([ids], params)[0].token_ids
    spec = LLM(tiny_dir, device="cuda", dtype="float32", speculative=SpeculativeConfig.resolve("NGRAM"))
    assert spec.generate([ids], params)[0].token_ids == want


def test_compiled_steps_on_cuda_equal_eager(tiny_dir: Path, tmp_path: Path) -> None:
    """The compiled decode and verify steps (and EAGLE-3's compiled chain rounds) on CUDA in float32: the eager
    engine's tokens, plain, batched and speculative, with every bucket compiled once."""
    from specserve.speculative.dflash.checkpoint import init_random_dflash
    from specserve.speculative.eagle3.checkpoint import init_random_eagle3

    config = LLM(tiny_dir, device="cpu", dtype="float32").config
    init_random_eagle3(config, tmp_path / "eagle", seed=4)
    init_random_dflash(config, tmp_path / "dflash", seed=3, block_size=8)
    prompts = ["def add(a, b):", "import os\n", "class Foo:\n", "for i in range(10):"]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    specs = [None, SpeculativeConfig.resolve("NGRAM"),
             SpeculativeConfig.resolve("EAGLE3", str(tmp_path / "eagle"), num_steps=3, eagle_topk=1),
             SpeculativeConfig.resolve("DFLASH", str(tmp_path / "dflash"), dflash_block_size=8, tree="ddtree",
                                       num_draft_tokens=10)]
    plain = LLM(tiny_dir, device="cuda", dtype="float32", enforce_eager=True)
    want_one = [plain.generate([p], params)[0].token_ids for p in prompts]
    want_batch = [r.token_ids for r in plain.generate(prompts, params)]
    for spec in specs:
        llm = LLM(tiny_dir, device="cuda", dtype="float32", speculative=spec, enforce_eager=False)
        assert [llm.generate([p], params)[0].token_ids for p in prompts] == want_one, spec
        assert [r.token_ids for r in llm.generate(prompts, params)] == want_batch, spec
        (engine,) = llm._engines.values()
        assert engine.compiled is not None and engine.compiled.hits > 0 and engine.compiled.buckets

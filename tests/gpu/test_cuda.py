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

"""`--speculative-draft-dtype`: which dtype the drafter's weights get, and bad values named with the flag."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specserve.config import SpeculativeConfig
from specserve.engine.llm import LLM, cpu_has_native_bf16, default_draft_dtype
from specserve.server.serve_config import ServeConfig
from specserve.speculative.dflash.checkpoint import init_random_dflash


def test_auto_runs_only_dflash_in_bf16_and_only_on_cpus_with_native_bf16() -> None:
    cpu, f32 = torch.device("cpu"), torch.float32
    assert default_draft_dtype("DFLASH", f32, cpu) == (torch.bfloat16 if cpu_has_native_bf16() else f32)
    assert default_draft_dtype("EAGLE3", f32, cpu) == f32  # a row at a time: slower in bf16
    assert default_draft_dtype("STANDALONE", f32, cpu) == f32
    assert default_draft_dtype("DFLASH", torch.bfloat16, torch.device("cuda")) == torch.bfloat16


def test_a_bf16_dflash_drafter_gets_the_targets_head_in_bf16(tiny_dir: Path, tmp_path: Path) -> None:
    llm = LLM(tiny_dir, device="cpu", dtype="float32")
    init_random_dflash(llm.config, tmp_path, seed=3, block_size=8)
    spec = SpeculativeConfig.resolve("DFLASH", str(tmp_path), dflash_block_size=8)
    bf16 = LLM(tiny_dir, device="cpu", dtype="float32", speculative=spec, draft_dtype="bfloat16")
    assert bf16.model.lm_head.weight.dtype == torch.float32  # the target verifies in its own dtype
    b = bf16.drafter_builder
    assert b is not None and b.head is not None
    assert b.head.weight.dtype == torch.bfloat16
    assert torch.equal(b.head.weight, bf16.model.lm_head.weight.to(torch.bfloat16))
    assert {p.dtype for p in b.weights.parameters()} == {torch.bfloat16}  # type: ignore[attr-defined]
    fp32 = LLM(tiny_dir, device="cpu", dtype="float32", speculative=spec, draft_dtype="float32")
    assert fp32.drafter_builder is not None and fp32.drafter_builder.head is None  # the target's own head


def test_bad_draft_dtypes_name_the_flag(tiny_dir: Path) -> None:
    with pytest.raises(ValueError, match="--speculative-draft-dtype 'fp8'"):
        LLM(tiny_dir, device="cpu", speculative=SpeculativeConfig.resolve("NGRAM"), draft_dtype="fp8")
    with pytest.raises(ValueError, match="--speculative-draft-dtype 'int4' is not known"):
        ServeConfig(draft_dtype="int4")

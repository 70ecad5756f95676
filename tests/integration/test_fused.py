"""Quantized CPU layers as the kernel's fused calls (`models/fused.py`): the whole stack in one call gives the bits
of the per-layer calls, captured states included, for decode rows, a packed batch and a tree verify; speculation
on it is exact."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specserve.config import SpeculativeConfig
from specserve.engine.engine_config import EngineConfig
from specserve.engine.llm import LLM
from specserve.engine.runner import Row, RowOutput
from specserve.layers import qkernel as qk
from specserve.models.llama import CausalLM
from specserve.types import SamplingParams

from tiny import make_checkpoint

pytestmark = pytest.mark.skipif(not qk.load_kernel(), reason="no C++ compiler: the PyTorch fallback only")


@pytest.fixture(scope="module")
def llama_int8(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path = make_checkpoint(tmp_path_factory.mktemp("tiny-llama"), "LlamaForCausalLM", seed=3)
    return LLM(path, device="cpu", dtype="float32", quantization="int8", enforce_eager=True)


def _rows() -> list[list[Row]]:
    ctx = list(range(20))
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    return [
        [Row([5], [20], [40], ctx)],  # one decode row, no mask
        [Row([5, 6, 7], [20, 21, 22], [40, 41, 42], ctx), Row([9, 8, 7], [3, 4, 5], [60, 61, 62], [21, 22, 23])],
        [Row([5], [20], [40], ctx), Row([9, 8, 7, 6], [3, 4, 4, 5], [60, 61, 62, 63], [21, 22, 23], tree)],  # packed
    ]


def _forward(llm: LLM, rows: list[Row], capture: tuple[int, ...]) -> list[RowOutput]:
    engine = llm.make_engine(EngineConfig(num_kv_blocks=8, enforce_eager=True), plain=True)
    engine.runner.forward([Row(list(range(7, 31)), list(range(24)), list(range(24)), [], logits="none")])
    return engine.runner.forward(rows, capture)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_stack_in_one_call_is_the_layers_calls(llama_int8: LLM, monkeypatch: pytest.MonkeyPatch,
                                                   threads: int) -> None:
    """One team of `threads` for the whole stack, each step split over it, against the per-layer operators."""
    assert llama_int8.model.runs_fused()
    capture = (0, 1, 3)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _compare_stack(llama_int8, monkeypatch, capture)
    finally:
        torch.set_num_threads(before)


def _compare_stack(llama_int8: LLM, monkeypatch: pytest.MonkeyPatch, capture: tuple[int, ...]) -> None:
    for rows in _rows():
        stacked = _forward(llama_int8, rows, capture)
        with monkeypatch.context() as m:
            m.setattr(CausalLM, "fused_stack", lambda self, x, kv: None)
            layered = _forward(llama_int8, rows, capture)
        for a, b in zip(stacked, layered, strict=True):
            assert a.logits is not None and b.logits is not None
            assert torch.equal(a.logits, b.logits)
            assert a.captured is not None and b.captured is not None
            assert torch.equal(a.captured, b.captured)


def test_speculation_on_fused_layers_is_exact(llama_int8: LLM) -> None:
    prompts = ["def add(a, b):\n    return a + b\n\ndef add(a, b):", "x = [1, 2, 3]\nx = [1, 2,"]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    plain = [o.token_ids for o in llama_int8.generate(prompts, params)]
    spec = LLM(llama_int8.model_dir, device="cpu", dtype="float32", quantization="int8", enforce_eager=True,
               speculative=SpeculativeConfig.resolve("NGRAM"))
    for batch in (prompts, prompts[:1]):
        out = spec.generate(batch, params)
        assert [o.token_ids for o in out] == plain[: len(batch)]
    assert sum(o.num_verify_steps for o in out) > 0


def test_unquantized_and_grad_forwards_stay_unfused(tmp_path: Path) -> None:
    path = make_checkpoint(tmp_path / "m", "LlamaForCausalLM", seed=4, tokenizer=False)
    from specserve.models.loader import load_model

    model, _, _ = load_model(path, torch.device("cpu"), torch.float32)
    assert isinstance(model, CausalLM) and not model.runs_fused()


def test_a_head_dimension_the_row_kernel_does_not_take_runs_the_layers_unstacked(tmp_path: Path) -> None:
    """Head dimension 8: each layer still runs fused, its attention unfused; the stack is not used, and
    speculation stays exact."""
    path = make_checkpoint(tmp_path / "m", "LlamaForCausalLM", seed=5, head_dim=8, num_attention_heads=8,
                           num_key_value_heads=4)
    llm = LLM(path, device="cpu", dtype="float32", quantization="int8", enforce_eager=True)
    assert llm.model.runs_fused()
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    plain = llm.generate(["x = [1, 2, 3]\nx = [1, 2,"], params)[0].token_ids
    spec = LLM(path, device="cpu", dtype="float32", quantization="int8", enforce_eager=True,
               speculative=SpeculativeConfig.resolve("NGRAM"))
    assert spec.generate(["x = [1, 2, 3]\nx = [1, 2,"], params)[0].token_ids == plain

"""Compiled decode steps (`engine/compiled.py`): in float32 they give exactly the eager engine's tokens, plain and
speculative, batched and one by one; each bucket compiles once however the context grows; passes outside every
bucket run eager; quantized models compile unfrozen."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specserve.config import SpeculativeConfig
from specserve.engine.compiled import BATCH, ONE, TREE, Bucket, CompiledSteps
from specserve.engine.engine_config import EngineConfig
from specserve.engine.llm import LLM
from specserve.engine.runner import Row
from specserve.speculative.dflash.checkpoint import init_random_dflash
from specserve.types import SamplingParams

PROMPTS = ["def add(a, b):", "import os\n", "class Foo:\n", "x = [1, 2, 3]\n", "for i in range(10):"]
PARAMS = SamplingParams(max_new_tokens=24, ignore_eos=True)


def engines(llm: LLM) -> list[CompiledSteps]:
    return [e.compiled for e in llm._engines.values() if e.compiled is not None]


def test_compiled_plain_and_speculative_equal_eager(tiny_dir: Path, tmp_path: Path) -> None:
    init_random_dflash(LLM(tiny_dir, device="cpu", dtype="float32").config, tmp_path / "dflash", seed=3,
                       block_size=8)
    prompts = PROMPTS
    for spec in (None, SpeculativeConfig.resolve("DFLASH", str(tmp_path / "dflash"), dflash_block_size=8,
                                                 tree="ddtree", num_draft_tokens=10)):
        eager = LLM(tiny_dir, device="cpu", dtype="float32", speculative=spec, enforce_eager=True)
        compiled = LLM(tiny_dir, device="cpu", dtype="float32", speculative=spec, enforce_eager=False)
        one_by_one = [eager.generate([p], PARAMS)[0].token_ids for p in prompts]
        assert [compiled.generate([p], PARAMS)[0].token_ids for p in prompts] == one_by_one
        batched = [r.token_ids for r in eager.generate(prompts, PARAMS)]
        assert [r.token_ids for r in compiled.generate(prompts, PARAMS)] == batched
        steps = engines(compiled)
        assert steps and all(s.hits > 0 for s in steps)
        assert not engines(eager)
        buckets = {b for s in steps for b in s.buckets}
        if spec is None:
            assert {"1x1", "Nx1"} <= buckets  # one by one; five plain decodes in one batch graph
        else:
            assert buckets == {"1xN"}  # one request's trees in one graph; batched trees run eager


def test_a_bucket_compiles_once_as_the_context_grows(tiny_dir: Path) -> None:
    llm = LLM(tiny_dir, device="cpu", dtype="float32", enforce_eager=False)
    llm.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2, ignore_eos=True))  # one decode step: compiled
    torch._dynamo.utils.counters.clear()
    out = llm.generate(PROMPTS[:1], SamplingParams(max_new_tokens=40, ignore_eos=True))
    assert out[0].num_tokens == 40
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0  # 40 context lengths, no recompile


def test_passes_outside_every_bucket_run_eager(tiny_dir: Path) -> None:
    llm = LLM(tiny_dir, device="cpu", dtype="float32", enforce_eager=False)
    engine = llm.make_engine(EngineConfig(num_kv_blocks=64, enforce_eager=False, cuda_graph_max_bs=2))
    assert engine.compiled is not None and engine.compiled.max_width == 1  # plain: no trees
    steps = CompiledSteps(llm.model, engine.kv, max_batch=2, max_width=4)
    s = engine.kv.scratch
    decode = Row([1], [3], [s], [s, s, s])
    tree = Row([1, 2], [3, 4], [s, s], [s, s, s])
    prefill = Row([1, 2, 3], [0, 1, 2], [s, s, s], [], logits="last")
    assert steps.bucket([decode]) == ONE
    assert steps.bucket([decode] * 2) == BATCH
    assert steps.bucket([decode] * 3) is None  # beyond --cuda-graph-max-bs
    assert steps.bucket([tree]) == TREE
    assert steps.bucket([tree, decode]) is None  # batched trees run packed, eager
    assert steps.bucket([Row([1] * 5, [3] * 5, [s] * 5, [s])]) is None  # wider than max_width
    assert steps.bucket([prefill]) is None
    assert steps.startup_buckets() == [ONE, BATCH, TREE]
    assert engine.compiled.startup_buckets() == [ONE, BATCH]
    with pytest.raises(ValueError, match="--cuda-graph-max-bs"):
        EngineConfig(cuda_graph_max_bs=0)


def test_a_step_that_fails_to_compile_runs_eager(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    def broken(self: CompiledSteps, bucket: Bucket, capture: tuple[int, ...]) -> object:
        def step(*args: object) -> object:
            raise RuntimeError("no C++ compiler found")
        return step

    monkeypatch.setattr(CompiledSteps, "_compile", broken)
    want = LLM(tiny_dir, device="cpu", dtype="float32", enforce_eager=True).generate(PROMPTS[:2], PARAMS)
    llm = LLM(tiny_dir, device="cpu", dtype="float32", enforce_eager=False)
    with caplog.at_level("WARNING", logger="specserve.engine"):
        got = llm.generate(PROMPTS[:2], PARAMS)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    (steps,) = engines(llm)
    assert steps.buckets == [] and steps.hits == 0 and steps.misses > 0
    assert "no C++ compiler found" in caplog.text and "runs eager" in caplog.text


def test_steps_of_other_engines_and_captures_stay_apart(tiny_dir: Path, tiny_draft_dir: Path) -> None:
    """Same buckets compiled for two models and for two sets of captured layers, in one process: each equals its
    eager forward (dynamo must not mix their compiled state up)."""
    # (model, captured layers, widths): the same one-token bucket in every case; the tree bucket once
    for model_dir, captures in ((tiny_dir, [((1,), (1, 3)), ((2,), (1,))]), (tiny_draft_dir, [((1,), (1,))])):
        llm = LLM(model_dir, device="cpu", dtype="float32", enforce_eager=True)
        engine = llm.make_engine(EngineConfig(num_kv_blocks=64))
        steps = CompiledSteps(llm.model, engine.kv, max_batch=2, max_width=4)
        for capture, widths in captures:
            for width in widths:
                rows = [Row(list(range(5, 5 + width)), list(range(4, 4 + width)), list(range(4, 4 + width)),
                            [0, 1, 2, 3])]
                got = steps.forward(rows, capture)
                want = engine.runner.forward(rows, capture)
                assert got is not None
                assert torch.allclose(got[0].logits, want[0].logits, atol=1e-4)
                assert torch.allclose(got[0].captured, want[0].captured, atol=1e-4)
        assert steps.buckets == (["1x1", "1xN"] if model_dir == tiny_dir else ["1x1"])


def test_warmed_buckets_are_not_compiled_again_by_the_passes(tiny_dir: Path) -> None:
    llm = LLM(tiny_dir, device="cpu", dtype="float32", enforce_eager=True)
    engine = llm.make_engine(EngineConfig(num_kv_blocks=64))
    steps = CompiledSteps(llm.model, engine.kv, max_batch=2, max_width=4)
    for bucket in steps.startup_buckets():
        steps.warm(bucket, ())
    torch._dynamo.utils.counters.clear()
    s = engine.kv.scratch
    for k in (5, 40):
        assert steps.forward([Row([1], [k], [s], list(range(k)))] * 2, ()) is not None
        assert steps.forward([Row([1, 2, 3], [k] * 3, [s] * 3, list(range(k)))], ()) is not None
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0


def test_a_dynamic_rope_model_runs_eager(tmp_path: Path) -> None:
    from tiny import make_checkpoint

    path = make_checkpoint(tmp_path / "ntk", "LlamaForCausalLM", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    eager = LLM(path, device="cpu", dtype="float32", enforce_eager=True).generate(PROMPTS[:1], PARAMS)
    llm = LLM(path, device="cpu", dtype="float32", enforce_eager=False)
    assert [r.token_ids for r in llm.generate(PROMPTS[:1], PARAMS)] == [r.token_ids for r in eager]
    assert not engines(llm)  # no fixed RoPE table for a graph to hold


def test_offline_warm_up_compiles_every_width_at_batch_one(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`LLM.warm_compiled(max_batch=1)` (what `bench acceptance` runs before timing): every tree width a lookup
    drafter can verify, in every engine built so far, and no batched decode."""
    warmed: list[tuple[int, Bucket]] = []
    monkeypatch.setattr(CompiledSteps, "warm", lambda self, bucket, capture: warmed.append((id(self), bucket)))
    spec = SpeculativeConfig.resolve("NGRAM", num_draft_tokens=3)
    llm = LLM(tiny_dir, device="cpu", dtype="float32", speculative=spec, enforce_eager=False)
    llm.generate_plain(PROMPTS[:1], SamplingParams(max_new_tokens=2, ignore_eos=True))
    llm.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2, ignore_eos=True))
    llm.warm_compiled(max_batch=1)
    plain, spec_steps = (id(e.compiled) for e in llm._engines.values())
    assert [b for k, b in warmed if k == plain] == [ONE]
    assert [b for k, b in warmed if k == spec_steps] == [ONE, TREE]  # every width up to 3 rows, root included


@pytest.mark.parametrize(("quantization", "compiles"), [("none", {True}), ("int8", set())])
def test_dense_steps_compile_frozen_and_quantized_ones_run_fused(tiny_dir: Path, quantization: str,
                                                                  compiles: set[bool],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Dense weights are frozen into the compiled graph; a quantized CPU model compiles nothing: its layers are
    the kernel's fused calls (`models/fused.py`), which a graph would not make cheaper."""
    import specserve.engine.compiled as compiled

    seen: list[bool] = []

    def record(fn, name, freeze=True):  # type: ignore[no-untyped-def]
        seen.append(freeze)
        return fn  # run the step eager: only the choice is under test

    monkeypatch.setattr(compiled, "compile_named", record)
    llm = LLM(tiny_dir, device="cpu", dtype="float32", quantization=quantization, enforce_eager=False)
    out = llm.generate(PROMPTS[:1], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert out[0].num_tokens == 3
    assert set(seen) == compiles
    assert llm.model.runs_fused() == (quantization != "none")

"""Compiled decode steps (`engine/compiled.py`): in float32 they give exactly the eager engine's tokens, plain and
speculative, batched and one by one; each bucket compiles once however the context grows; passes outside every
bucket run eager; the server reports its buckets and takes --enforce-eager / --disable-cuda-graph."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest
import torch

from server_util import running_server
from specserve.config import SpeculativeConfig
from specserve.engine.compiled import BATCH, ONE, TREE, Bucket, CompiledSteps
from specserve.engine.engine_config import EngineConfig
from specserve.engine.llm import LLM
from specserve.engine.runner import Row
from specserve.speculative.dflash.checkpoint import init_random_dflash
from specserve.speculative.eagle3.checkpoint import init_random_eagle3
from specserve.speculative.eagle3.compiled import PAD, CompiledChains
from specserve.speculative.factory import DrafterBuilder, plan_drafter
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


@pytest.mark.server
def test_server_compiles_its_buckets_at_start_and_takes_the_flags(tiny_dir: Path, tmp_path: Path) -> None:
    body = {"model": "m", "prompt": "def add(a, b):", "max_tokens": 12, "temperature": 0}
    want = LLM(tiny_dir, device="cpu", dtype="float32", enforce_eager=True).generate(
        [body["prompt"]], SamplingParams(max_new_tokens=12))[0].text
    base = ["--model", str(tiny_dir), "--dtype", "float32", "--served-model-name", "m"]
    with running_server([*base, "--no-enforce-eager", "--cuda-graph-max-bs", "2", "--no-background-compile"],
                        tmp_path / "c.log") as srv:
        info = httpx.get(srv.url + "/server_info").json()
        assert info["compiled_steps"] and info["compiled_buckets"] == ["1x1", "Nx1"]
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"] == want
    with running_server([*base, "--disable-cuda-graph"], tmp_path / "e.log") as srv:
        info = httpx.get(srv.url + "/server_info").json()
        assert not info["compiled_steps"] and info["compiled_buckets"] == []


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
    for model_dir, captures in ((tiny_dir, [(1,), (2,)]), (tiny_draft_dir, [(1,)])):
        llm = LLM(model_dir, device="cpu", dtype="float32", enforce_eager=True)
        engine = llm.make_engine(EngineConfig(num_kv_blocks=64))
        steps = CompiledSteps(llm.model, engine.kv, max_batch=2, max_width=4)
        for capture in captures:
            for width in (1, 3):
                rows = [Row(list(range(5, 5 + width)), list(range(4, 4 + width)), list(range(4, 4 + width)),
                            [0, 1, 2, 3])]
                got = steps.forward(rows, capture)
                want = engine.runner.forward(rows, capture)
                assert got is not None
                assert torch.allclose(got[0].logits, want[0].logits, atol=1e-4)
                assert torch.allclose(got[0].captured, want[0].captured, atol=1e-4)
        assert steps.buckets == ["1x1", "1xN"]


def test_warmed_buckets_are_not_compiled_again_by_the_passes(tiny_dir: Path) -> None:
    llm = LLM(tiny_dir, device="cpu", dtype="float32", enforce_eager=True)
    engine = llm.make_engine(EngineConfig(num_kv_blocks=64))
    steps = CompiledSteps(llm.model, engine.kv, max_batch=2, max_width=3)
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


@pytest.mark.parametrize(("quantization", "frozen"), [("none", True), ("int8", False)])
def test_quantized_steps_compile_unfrozen(tiny_dir: Path, quantization: str, frozen: bool,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Dense weights are frozen into the graph; the quantized kernel's are not (freezing keeps AOT autograd's
    cache from holding the graph, and the kernel's op has nothing to fold)."""
    import specserve.engine.compiled as compiled

    seen: list[bool] = []

    def record(fn, name, freeze=True):  # type: ignore[no-untyped-def]
        seen.append(freeze)
        return fn  # run the step eager: only the choice is under test

    monkeypatch.setattr(compiled, "compile_named", record)
    llm = LLM(tiny_dir, device="cpu", dtype="float32", quantization=quantization, enforce_eager=False)
    out = llm.generate(PROMPTS[:1], SamplingParams(max_new_tokens=3, ignore_eos=True))
    assert out[0].num_tokens == 3
    assert seen and set(seen) == {frozen}


def test_a_background_warm_up_serves_eager_until_compiled_then_measures_the_profile(
        tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve`'s default start (`engine/warmup.py`): while the steps compile on their own thread, passes run eager
    (the engine's thread never compiles one itself) and decode plainly, the missing adaptive profile held on KV
    blocks of its own; once compiled, the profile is measured on the compiled steps, the blocks go back and the
    engine speculates, the tokens those of plain decoding throughout."""
    release = threading.Event()
    real = CompiledSteps._compile

    def held(self: CompiledSteps, bucket: Bucket, capture: tuple[int, ...]):  # type: ignore[no-untyped-def]
        assert release.wait(300)
        return real(self, bucket, capture)

    monkeypatch.setattr(CompiledSteps, "_compile", held)
    llm = LLM(tiny_dir, device="cpu", dtype="float32", enforce_eager=True,
              speculative=SpeculativeConfig.resolve("NGRAM", num_draft_tokens=3, tree="chain"))
    want = [o.token_ids for o in llm.generate_plain(PROMPTS, PARAMS)]
    cfg = EngineConfig(num_kv_blocks=128, max_num_seqs=2, cuda_graph_max_bs=1, enforce_eager=False)
    engine = llm.make_engine(cfg, adaptive=True, profile_path=tmp_path / "profile.json", warm_compiled=True,
                             background=True)
    assert engine.warmup is not None and engine.warmup.running and engine.profile_due is not None
    assert engine.describe()["compiling"] and not engine.profile_measurable
    held_blocks = len(engine.profile_due.blocks)
    assert engine.pool.num_free == engine.pool.num_blocks - held_blocks

    def decode(prompts: list[str]) -> list[list[int]]:
        for i, p in enumerate(prompts):
            engine.add_request(str(i), llm.encode(p), PARAMS)
        got: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
        while engine.has_unfinished:
            for o in engine.step():
                got[o.request_id] += o.new_token_ids
        return [got[str(i)] for i in range(len(prompts))]

    assert decode(PROMPTS[:2]) == want[:2]
    assert engine.compiled is not None and engine.compiled.hits == 0 and engine.counters.verify_rounds == 0
    release.set()
    assert engine.warmup.join(300) and engine.profile_measurable
    assert engine.compiled.buckets == ["1x1", "1xN"]
    engine.measure_due_profile()
    assert engine.policy is not None and engine.profile_due is None and (tmp_path / "profile.json").exists()
    assert engine.compiled.hits > 0  # the profile timed the compiled steps
    assert decode(PROMPTS) == want
    assert not engine.describe()["compiling"]

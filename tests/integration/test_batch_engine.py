"""The continuous-batching engine is lossless: at high concurrency, under preemption, with prefix and
host-tier cache hits and aborts, greedy output equals offline plain greedy decoding token for token for
every drafter; sampled output keeps the target's distribution; no KV block leaks."""

from __future__ import annotations

import shutil
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from reference_decoding import generate_plain
from specserve.config import SpeculativeConfig
from specserve.engine.adaptive import AdaptivePolicy, CostProfile
from specserve.engine.batch import MERGE_TOKENS, BatchEngine
from specserve.engine.engine_config import EngineConfig
from specserve.engine.llm import LLM
from specserve.engine.pass_log import PassLog, read_pass_log
from specserve.kv.contiguous import ContiguousKVCache
from specserve.kv.paged import PagedKVCache
from specserve.layers.sampling import target_probs
from specserve.speculative.dflash.checkpoint import init_random_dflash
from specserve.speculative.eagle3.checkpoint import init_random_eagle3
from specserve.speculative.factory import DrafterBuilder, plan_drafter
from specserve.types import SamplingParams

GREEDY = SamplingParams(max_new_tokens=24, ignore_eos=True)
SPECS = ["plain", "ngram-trie", "ngram-chain", "eagle3-chain", "eagle3-tree", "dflash-ddtree", "dflash-reveal",
         "dflash-bf16", "eagle3-bf16"]
#: drafters run in bfloat16 on the float32 target (`--speculative-draft-dtype`): proposals round differently,
#: the target's verification does not
BF16_DRAFTERS = {"dflash-bf16": "dflash-ddtree", "eagle3-bf16": "eagle3-chain"}


@pytest.fixture(scope="module")
def llm(tiny_dir: Path) -> LLM:
    return LLM(tiny_dir, device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def draft_dirs(tmp_path_factory: pytest.TempPathFactory, llm: LLM) -> dict[str, Path]:
    eagle = tmp_path_factory.mktemp("eagle3")
    init_random_eagle3(llm.config, eagle, seed=4)
    dflash = tmp_path_factory.mktemp("dflash")
    init_random_dflash(llm.config, dflash, seed=3, block_size=8)
    reveal = tmp_path_factory.mktemp("dflash-reveal")  # the same drafter, its trees' first paths shown to it
    init_random_dflash(llm.config, reveal, seed=3, block_size=8, sample_reveal=2, greedy_reveal=1,
                       tree_temperature=0.05)
    return {"eagle3": eagle, "dflash": dflash, "dflash-reveal": reveal}


def spec_for(name: str, dirs: dict[str, Path]) -> SpeculativeConfig | None:
    r = SpeculativeConfig.resolve
    e, f = str(dirs["eagle3"]), str(dirs["dflash"])
    name = BF16_DRAFTERS.get(name, name)
    return {
        "plain": None,
        "ngram-trie": r("NGRAM"),
        "ngram-chain": r("NGRAM", num_draft_tokens=5, tree="chain"),
        "eagle3-chain": r("EAGLE3", e, num_steps=3),
        "eagle3-tree": r("EAGLE3", e, num_steps=2, eagle_topk=3, num_draft_tokens=10),
        "dflash-ddtree": r("DFLASH", f, dflash_block_size=8, tree="ddtree", num_draft_tokens=12),
        "dflash-reveal": r("DFLASH", str(dirs["dflash-reveal"]), dflash_block_size=8, tree="ddtree",
                           num_draft_tokens=12),
    }[name]


@pytest.fixture(scope="module")
def builders(llm: LLM, draft_dirs: dict[str, Path]) -> dict[str, DrafterBuilder | None]:
    """Each drafter's weights loaded once, on the shared target."""
    out: dict[str, DrafterBuilder | None] = {}
    for name in SPECS:
        spec = spec_for(name, draft_dirs)
        dtype = torch.bfloat16 if name in BF16_DRAFTERS else llm.dtype
        out[name] = None if spec is None else DrafterBuilder(plan_drafter(spec, llm.config), llm.model,
                                                               llm.device, dtype)
    return out


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    """17 prompts of 3..40 tokens; the last one loops, so lookup drafters accept long runs."""
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, llm.config.vocab_size, (n,), generator=gen).tolist()
           for n in [3, 9, 17, 30, 5, 12, 40, 7] * 2]
    return [*ids, llm.encode("a = 1\nb = 2\n" * 4)]


def plain_ref(llm: LLM, ids: list[int], params: SamplingParams = GREEDY) -> list[int]:
    return generate_plain(llm.model, [ids], params, llm.eos_ids, llm.tokenizer.decode)[0].token_ids


@pytest.fixture(scope="module")
def expected(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [plain_ref(llm, p) for p in prompts]


def engine(llm: LLM, builder: DrafterBuilder | None, policy: AdaptivePolicy | None = None,
           **config: Any) -> BatchEngine:
    return BatchEngine(llm.model, llm.eos_ids, llm.tokenizer.decode, EngineConfig(**config), builder, policy)


class Run:
    """Drains an engine, collecting each request's tokens and finish reason."""

    def __init__(self, eng: BatchEngine) -> None:
        self.eng = eng
        self.tokens: dict[str, list[int]] = {}
        self.reasons: dict[str, str] = {}
        self.max_running = 0

    def add(self, rid: str, ids: list[int], params: SamplingParams = GREEDY) -> None:
        self.eng.add_request(rid, ids, params)
        self.tokens[rid] = []

    def step(self) -> None:
        for out in self.eng.step():
            assert out.request_id not in self.reasons, f"{out.request_id} produced output after finishing"
            self.tokens[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                self.reasons[out.request_id] = out.finish_reason
        self.max_running = max(self.max_running, self.eng.scheduler.num_running)

    def drain(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not self.eng.has_unfinished:
                return
            self.step()
        raise AssertionError(f"the engine did not finish in {max_steps} steps")


def assert_no_leak(eng: BatchEngine) -> None:
    """Every block is free or held by the prefix cache, and the bookkeeping is consistent."""
    eng.pool.check()
    cached = 0
    if eng.cache is not None:
        eng.cache.check()
        cached = eng.cache.num_device_blocks
    assert eng.pool.num_free + cached == eng.pool.num_blocks


# -- a. greedy at concurrency 17 equals offline plain greedy


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["padded", "invariant"])
@pytest.mark.parametrize("name", SPECS)
def test_greedy_concurrent_equals_plain(llm: LLM, builders: dict[str, DrafterBuilder | None],
                                        prompts: list[list[int]], expected: list[list[int]], name: str,
                                        batch_invariant: bool) -> None:
    eng = engine(llm, builders[name], batch_invariant=batch_invariant)
    run = Run(eng)
    for i, p in enumerate(prompts):
        run.add(str(i), p)
    run.drain()
    got = [run.tokens[str(i)] for i in range(len(prompts))]
    diverged = sum(g != e for g, e in zip(got, expected, strict=True))
    print(f"{name} batch_invariant={batch_invariant}: {diverged}/{len(prompts)} requests diverge from plain greedy")
    assert run.max_running >= 16
    assert got == expected
    assert all(r == "length" for r in run.reasons.values()) and len(run.reasons) == len(prompts)
    if builders[name] is not None:
        c = eng.counters
        assert c.spec_steps > 0 and c.verify_rounds > 0
        if name.startswith("ngram"):  # the looping prompt: lookups get drafts accepted
            assert c.accept_sum > c.verify_rounds and c.position_accepted[0] > 0
    assert_no_leak(eng)


class CyclingPolicy(AdaptivePolicy):
    """Verifies 0, 1, ..., max_width drafts in turn: every cut of the drafts, and plain steps in between."""

    def __init__(self, max_width: int) -> None:
        super().__init__(CostProfile("test", (1,), (1,), ((1.0,),)), max_width, stepwise=False)
        self.turn = 0

    def choose(self, batch: int, classes: Sequence[int] = ()) -> int:
        self.turn += 1
        return self.turn % (self.max_width + 1)


@pytest.mark.parametrize("name", ["ngram-trie", "eagle3-chain", "dflash-ddtree"])
def test_greedy_with_cut_drafts_equals_plain(llm: LLM, builders: dict[str, DrafterBuilder | None],
                                             prompts: list[list[int]], expected: list[list[int]],
                                             name: str) -> None:
    """Widths chosen step by step (as the adaptive policy does) truncate trees and skip drafting: still exact."""
    builder = builders[name]
    assert builder is not None
    policy = CyclingPolicy(builder.max_tree_nodes - 1)
    run = Run(engine(llm, builder, policy))
    for i, p in enumerate(prompts[:8]):
        run.add(str(i), p)
    run.drain()
    assert [run.tokens[str(i)] for i in range(8)] == expected[:8]
    assert policy.turn > policy.max_width + 1  # every width came up
    assert_no_leak(run.eng)


# -- b. sampling through the batched engine keeps the target's distribution


SAMPLE_N = 600


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=2, temperature=1.5, top_k=3, seed=seed, ignore_eos=True)


@pytest.fixture(scope="module")
def sample_prompt(llm: LLM) -> list[int]:
    """A random start and its greedy continuation: every drafter here gets some of its drafts accepted."""
    start = torch.randint(3, llm.config.vocab_size, (5,), generator=torch.Generator().manual_seed(0)).tolist()
    return start + plain_ref(llm, start, SamplingParams(max_new_tokens=12, ignore_eos=True))


@pytest.fixture(scope="module")
def near_target_builder(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path, llm: LLM) -> DrafterBuilder:
    """STANDALONE drafting with a noisy copy of the target: its sampled drafts are accepted often, not always."""
    from safetensors.torch import load_file, save_file

    path = tmp_path_factory.mktemp("near-target")
    shutil.copytree(tiny_dir, path, dirs_exist_ok=True)
    gen = torch.Generator().manual_seed(5)
    weights = {k: v + 0.3 * v.std() * torch.randn(v.shape, generator=gen)
               for k, v in load_file(str(tiny_dir / "model.safetensors")).items()}
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    spec = SpeculativeConfig.resolve("STANDALONE", str(path), num_steps=3)
    return DrafterBuilder(plan_drafter(spec, llm.config), llm.model, llm.device, llm.dtype)


def next_token_probs(llm: LLM, ids: list[int]) -> torch.Tensor:
    """The law plain decoding samples the token after `ids` from (`pick` = multinomial of `target_probs`): [V]."""
    cache = ContiguousKVCache.allocate(llm.config, 1, len(ids), llm.device, llm.dtype)
    with torch.inference_mode():
        out = llm.model(torch.tensor([ids]), torch.arange(len(ids))[None], cache.view(0, len(ids)), last_only=True)
    assert out.logits is not None
    return target_probs(out.logits[0], sampled(0))[0]


@pytest.fixture(scope="module")
def plain_law(llm: LLM, sample_prompt: list[int]) -> dict[tuple[int, int], float]:
    """Plain decoding's exact joint law of the first two tokens (top_k 3: at most 9 pairs)."""
    first = next_token_probs(llm, sample_prompt)
    law = {}
    for t1 in first.nonzero().flatten().tolist():
        second = next_token_probs(llm, [*sample_prompt, t1])
        for t2 in second.nonzero().flatten().tolist():
            law[(t1, t2)] = float(first[t1] * second[t2])
    assert abs(sum(law.values()) - 1) < 1e-5 and len(law) <= 9
    return law


@pytest.mark.parametrize("name", ["ngram-trie", "eagle3-chain", "standalone-chain", "dflash-ddtree",
                                  "dflash-reveal", "dflash-bf16"])
def test_sampling_matches_plain_distribution(llm: LLM, builders: dict[str, DrafterBuilder | None],
                                             near_target_builder: DrafterBuilder, sample_prompt: list[int],
                                             plain_law: dict[tuple[int, int], float], name: str) -> None:
    """Chi-square goodness of fit of 600 concurrent seeded requests to plain decoding's joint law of 2 tokens.

    NGRAM drafts deterministically (a one-hot draft law); the EAGLE3 and STANDALONE chains sample their
    drafts, and DFLASH draws a DDTree's siblings without replacement, so the rejection rule and its residual
    distribution are exercised with real draft laws.
    """
    from scipy.stats import chisquare

    builder = near_target_builder if name == "standalone-chain" else builders[name]
    eng = engine(llm, builder, max_num_seqs=SAMPLE_N, max_num_batched_tokens=16_384, max_waiting=SAMPLE_N)
    run = Run(eng)
    for s in range(SAMPLE_N):
        run.add(str(s), sample_prompt, sampled(s))
    run.drain()
    assert run.max_running == SAMPLE_N  # all of them in one batch
    c = eng.counters
    assert c.verify_rounds == SAMPLE_N  # every second token came from a verify round
    first_accepted = c.position_accepted[0] if c.position_accepted else 0
    assert first_accepted < SAMPLE_N  # drafts were rejected in some rounds ...
    if not name.startswith("dflash"):  # ... and accepted in others (the random DFlash drafter's drawn siblings are
        assert first_accepted > 0  # all rejected: what it checks is the residual left after each of them)
    counts = Counter(tuple(t) for t in run.tokens.values())
    assert set(counts) <= set(plain_law), "a pair plain decoding can never produce"
    big = sorted(k for k, p in plain_law.items() if p * SAMPLE_N >= 5)
    assert len(big) >= 3, "the test needs a spread-out distribution to have power"
    observed = [counts[k] for k in big] + [SAMPLE_N - sum(counts[k] for k in big)]
    expected = [plain_law[k] * SAMPLE_N for k in big] + [SAMPLE_N * (1 - sum(plain_law[k] for k in big))]
    if expected[-1] < 1e-6:
        observed, expected = observed[:-1], expected[:-1]
    expected = [e * sum(observed) / sum(expected) for e in expected]  # rounding
    p_value = chisquare(observed, expected).pvalue
    assert p_value > 0.001, (name, p_value, counts)


# -- c. preemption


@pytest.mark.parametrize("name", ["plain", "ngram-trie", "eagle3-chain"])
def test_preemption_keeps_outputs_exact(llm: LLM, builders: dict[str, DrafterBuilder | None],
                                        prompts: list[list[int]], expected: list[list[int]], name: str) -> None:
    eng = engine(llm, builders[name], num_kv_blocks=12, kv_block_size=4, max_num_batched_tokens=64)
    slots = eng.pool.num_slots
    run = Run(eng)
    for i, p in enumerate(prompts):
        run.add(str(i), p)
    run.drain()
    assert eng.scheduler.num_preemptions > 0
    fits = [i for i, p in enumerate(prompts) if len(p) + GREEDY.max_new_tokens <= slots]
    assert len(fits) >= 10
    for i, (p, want) in enumerate(zip(prompts, expected, strict=True)):
        got = run.tokens[str(i)]
        if i in fits:
            assert got == want, (name, i)
        else:  # its KV can never fit the pool: ended early, what it produced is still exact
            # the last token needs no KV slot: the sequence fills the pool, plus one
            assert run.reasons[str(i)] == "length" and got == want[: len(got)] and len(p) + len(got) == slots + 1
    assert_no_leak(eng)


# -- d. prefix cache and host tier


def with_prefix(prefix: list[int], n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [prefix + torch.randint(3, 300, (3 + 2 * i,), generator=gen).tolist() for i in range(n)]


class RecordingBuilder:
    """A `DrafterBuilder` whose drafters record the target states their prefill receives."""

    def __init__(self, inner: DrafterBuilder) -> None:
        self.inner = inner
        self.prefills: list[tuple[list[int], torch.Tensor]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def for_request(self, *args: Any, **kwargs: Any) -> Any:
        drafter = self.inner.for_request(*args, **kwargs)
        prefill = drafter.prefill

        def recorded(ids: list[int], hidden: torch.Tensor | None) -> None:
            assert hidden is not None and hidden.shape[0] == len(ids)
            self.prefills.append((list(ids), hidden.clone()))
            prefill(ids, hidden)

        drafter.prefill = recorded
        return drafter


def run_waves(eng: BatchEngine, waves: list[list[list[int]]], params: SamplingParams) -> Run:
    run = Run(eng)
    for w, wave in enumerate(waves):
        for i, p in enumerate(wave):
            run.add(f"{w}-{i}", p, params)
        run.drain()
    return run


@pytest.mark.parametrize("name", ["plain", "ngram-trie", "eagle3-chain", "dflash-ddtree"])
def test_prefix_cache_hits_stay_exact(llm: LLM, builders: dict[str, DrafterBuilder | None], name: str) -> None:
    """Second-wave requests skip the shared prefix and still decode exactly; drafters that read the target's
    states get, for the cached positions, the states stored with the blocks (equal to recomputed ones)."""
    prefix = torch.randint(3, 300, (37,), generator=torch.Generator().manual_seed(7)).tolist()
    waves = [with_prefix(prefix, 4, 1), with_prefix(prefix, 4, 2)]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    builder = builders[name]
    recorder = RecordingBuilder(builder) if builder is not None and builder.capture else None
    eng = engine(llm, recorder or builder, kv_block_size=4, num_kv_blocks=256)
    assert eng.cache is not None
    run = run_waves(eng, waves[:1], params)
    hits_after_first = eng.cache.stats.hit_tokens
    for i, p in enumerate(waves[1]):
        run.add(f"1-{i}", p, params)
    run.drain()
    # each request of the second wave finds at least the prefix's full blocks
    assert eng.cache.stats.hit_tokens - hits_after_first >= 4 * (len(prefix) // 4 * 4)
    for w, wave in enumerate(waves):
        for i, p in enumerate(wave):
            assert run.tokens[f"{w}-{i}"] == plain_ref(llm, p, params), (w, i)
    assert_no_leak(eng)
    if recorder is not None:  # the same prompts without the cache: every state recomputed
        fresh = RecordingBuilder(recorder.inner)
        run_waves(engine(llm, fresh, kv_block_size=4, num_kv_blocks=256,
                         enable_prefix_cache=False), waves, params)
        assert [ids for ids, _ in recorder.prefills] == [ids for ids, _ in fresh.prefills]
        for (_, cached), (_, recomputed) in zip(recorder.prefills, fresh.prefills, strict=True):
            torch.testing.assert_close(cached, recomputed, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["ngram-trie", "eagle3-chain"])
def test_host_tier_round_trip_stays_exact(llm: LLM, builders: dict[str, DrafterBuilder | None], name: str) -> None:
    """Wave 1 is cached; unrelated middle prompts push its blocks to the host tier; wave 3 brings them back
    (with the target states stored per slot, for EAGLE-3)."""
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    builder = builders[name]
    features = len(builder.capture) * llm.config.hidden_size if builder is not None else 0
    block_bytes = PagedKVCache(llm.config, 1, 4, torch.device("meta"), llm.dtype,
                               feature_dim=features).bytes_per_block
    host_blocks = 64  # room for everything evicted below: nothing is dropped from the host tier
    eng = engine(llm, builder, kv_block_size=4, num_kv_blocks=16,
                 hicache_gb=(host_blocks + 0.5) * block_bytes / 2**30)
    assert eng.cache is not None and eng.host is not None and eng.host.capacity == host_blocks
    gen = torch.Generator().manual_seed(11)
    prefix = torch.randint(3, 300, (32,), generator=gen).tolist()
    first = [*prefix, 5, 6, 7]
    middle = [torch.randint(3, 300, (40,), generator=gen).tolist() for _ in range(2)]
    third = [*prefix, 9, 10]
    run = Run(eng)
    for rid, p in [("first", first), ("mid0", middle[0]), ("mid1", middle[1])]:
        run.add(rid, p, params)  # one at a time: each wave finishes before the next arrives
        run.drain()
    assert eng.host.stats.device_to_host > 0
    assert eng.cache.num_host_blocks >= len(prefix) // 4  # the whole shared prefix went to the host
    run.add("third", third, params)
    run.drain()
    assert eng.cache.stats.host_hit_tokens >= len(prefix)
    assert eng.host.stats.host_to_device >= len(prefix) // 4
    for rid, p in [("first", first), ("mid0", middle[0]), ("mid1", middle[1]), ("third", third)]:
        assert run.tokens[rid] == plain_ref(llm, p, params), rid
    assert_no_leak(eng)


# -- e. abort


@pytest.mark.parametrize("name", ["plain", "ngram-trie", "eagle3-chain"])
def test_abort_frees_blocks_and_others_finish(llm: LLM, builders: dict[str, DrafterBuilder | None],
                                              prompts: list[list[int]], expected: list[list[int]],
                                              name: str) -> None:
    eng = engine(llm, builders[name], max_num_seqs=8, kv_block_size=4, num_kv_blocks=128)
    run = Run(eng)
    for i, p in enumerate(prompts):
        run.add(str(i), p)
    for _ in range(3):
        run.step()
    running = [s.request_id for s in eng.scheduler.running]
    waiting = [s.request_id for s in eng.scheduler.waiting]
    assert len(running) == 8 and len(waiting) >= 2
    aborted = set(running[1::3] + waiting[:2])
    for rid in sorted(aborted):
        seq = eng.scheduler.get(rid)
        assert seq is not None
        owned = [b for b in seq.block_table.blocks if eng.pool.ref_count(b) == 1]  # not shared with the cache
        assert bool(owned) == (rid in running)  # a running request holds blocks of its own; a waiting one none
        free_before = eng.pool.num_free
        assert eng.abort(rid)
        assert eng.pool.num_free - free_before == len(owned)
        assert seq.block_table.blocks == ()
        assert not eng.abort(rid)  # already gone
        eng.pool.check()
    seen = {rid: len(run.tokens[rid]) for rid in aborted}
    run.drain()
    assert eng.counters.finished.get("abort") == len(aborted)
    for i, want in enumerate(expected):
        rid = str(i)
        if rid in aborted:
            assert len(run.tokens[rid]) == seen[rid] and rid not in run.reasons  # nothing after the abort
        else:
            assert run.tokens[rid] == want, (name, rid)
    assert_no_leak(eng)


# -- f. drafters reading the target's hidden states keep them per KV slot, so the prefix cache stays on


def test_hidden_state_drafters_keep_features_per_slot(llm: LLM, builders: dict[str, DrafterBuilder | None]) -> None:
    for name in SPECS:
        eng = engine(llm, builders[name], num_kv_blocks=8)
        captures = name.startswith(("eagle3", "dflash"))
        assert eng.cache is not None, name
        assert bool(eng.capture) == captures, name
        assert (eng.kv.features is not None) == captures, name
        if eng.kv.features is not None:
            assert eng.kv.features.shape == (8 * 16 + 1, len(eng.capture) * llm.config.hidden_size)
    assert engine(llm, None, num_kv_blocks=8, enable_prefix_cache=False).cache is None


# -- g. the pass log (--speculative-adaptive-trace) records every prefill and decode pass, with or without drafts


@pytest.mark.parametrize("name", ["plain", "eagle3-chain"])
def test_pass_log_records_prefill_and_decode_passes(llm: LLM, builders: dict[str, DrafterBuilder | None],
                                                    prompts: list[list[int]], name: str, tmp_path: Path) -> None:
    eng = engine(llm, builders[name], enable_prefix_cache=False)
    eng.pass_log = PassLog(tmp_path / "passes.jsonl")
    run = Run(eng)
    for i, p in enumerate(prompts[:6]):
        run.add(str(i), p)
    run.drain()
    eng.pass_log.close()
    decodes = read_pass_log(tmp_path / "passes.jsonl")
    prefills = read_pass_log(tmp_path / "passes.jsonl", kind="prefill")
    assert len(decodes) + len(prefills) == len(read_pass_log(tmp_path / "passes.jsonl", kind=None))
    assert sum(p["tokens"] for p in prefills) == sum(len(p) for p in prompts[:6])  # every prompt token, once
    assert all(0 < p["forward_s"] <= p["seconds"] for p in decodes + prefills)
    # each request's first token comes from its prefill; the decode passes produced at least the rest
    assert sum(p["tokens"] for p in decodes) >= eng.counters.generation_tokens - 6
    if name == "plain":
        assert all(p["width"] == 0 and p["tokens"] == p["batch"] for p in decodes)
        assert all(p["drafter_s"] == 0 for p in prefills)
    else:  # the drafters take in each completed prompt inside the prefill pass
        assert sum(p["drafter_s"] > 0 for p in prefills) >= 1
        assert all(p["drafter_s"] < p["seconds"] for p in prefills)


@pytest.mark.parametrize("name", ["plain", "ngram-trie", "dflash-ddtree"])
def test_short_prefills_ride_in_the_decode_pass(llm: LLM, builders: dict[str, DrafterBuilder | None],
                                                prompts: list[list[int]], expected: list[list[int]], name: str,
                                                tmp_path: Path) -> None:
    """A closed loop of 4 clients (a finished request replaced at once, as served): a replacement whose prompt
    chunk is at most MERGE_TOKENS long goes into that step's decode forward (rows of unequal length, run
    packed), a longer one gets a forward of its own; outputs stay plain greedy decoding's, and the pass log says
    which was which."""
    eng = engine(llm, builders[name], enable_prefix_cache=False)
    eng.pass_log = PassLog(tmp_path / "passes.jsonl")
    run = Run(eng)
    waiting = list(enumerate(prompts))
    for _ in range(4):
        i, p = waiting.pop(0)
        run.add(str(i), p)
    for _ in range(3000):
        if not eng.has_unfinished and not waiting:
            break
        before = len(run.reasons)
        run.step()
        for _ in range(len(run.reasons) - before):
            if waiting:
                i, p = waiting.pop(0)
                run.add(str(i), p)
    eng.pass_log.close()
    assert [run.tokens[str(i)] for i in range(len(prompts))] == expected
    prefills = read_pass_log(tmp_path / "passes.jsonl", kind="prefill")
    merged = [p for p in prefills if p["merged"]]
    assert sum(p["batch"] for p in merged) == eng.counters.merged_prefills
    if name != "plain":  # (plain requests of one length finish together: their replacements come in waves)
        assert eng.counters.merged_prefills >= 3
    assert all(p["forward_s"] == 0 for p in merged) and all(p["forward_s"] > 0 for p in prefills if not p["merged"])
    assert all(p["tokens"] <= MERGE_TOKENS * p["batch"] for p in merged)
    assert any(p["tokens"] > MERGE_TOKENS for p in prefills if not p["merged"])  # the 17-40 token prompts
    assert sum(p["tokens"] for p in prefills) == sum(len(p) for p in prompts)  # every prompt token, once
    assert_no_leak(eng)

"""SUFFIX through the real engine at concurrency 16 (greedy equals plain, the cache across requests fills and
helps, sampling keeps the target's law with a filled cache), and what the prefix cache reuses of a conversation's
earlier turns, on the device and from the host tier."""

from __future__ import annotations

from pathlib import Path

import pytest

from reference_decoding import first_pairs_p_value
from specserve.config import SpeculativeConfig
from specserve.engine.engine_config import EngineConfig
from specserve.engine.llm import LLM
from specserve.engine.offline import generate_batch
from specserve.types import SamplingParams

CODE = [
    "def add(a, b):\n    return a + b\n\n\ndef", "import os\nimport sys\n", "class Foo:\n    def __init__(self",
    "x = [1, 2, 3]\nfor i in x:\n", "    return self._", "if __name__ == '__main__':\n", "# comment\n",
    "try:\n    pass\nexcept", "with open(path) as f:\n", "def f(*args, **kwargs):\n",
    "a = 1\nb = 2\n" * 4, "for i in range(10):\n    print(i)\n" * 3,
]


@pytest.fixture(scope="module")
def suffix_llm(tiny_dir: Path) -> LLM:
    return LLM(tiny_dir, device="cpu", dtype="float32", speculative=SpeculativeConfig.resolve("SUFFIX"),
               engine_config=EngineConfig(num_kv_blocks=512, max_num_seqs=16))


def test_greedy_equals_plain_at_concurrency_16(suffix_llm: LLM) -> None:
    prompts = [CODE[i % len(CODE)] + "#" * (i // len(CODE)) for i in range(20)]
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    want = [r.token_ids for r in suffix_llm.generate_plain(prompts, params)]
    first = suffix_llm.generate(prompts, params)
    assert [r.token_ids for r in first] == want
    cache = suffix_llm.drafter_builder.suffix_cache  # type: ignore[union-attr]
    assert cache is not None and len(cache) == 20  # every finished request's output was shared
    # the same prompts again: the cache now holds what they will write, so drafts come from other requests
    again = suffix_llm.generate(prompts, params)
    assert [r.token_ids for r in again] == want
    steps_first = sum(r.num_verify_steps for r in first)
    steps_again = sum(r.num_verify_steps for r in again)
    assert steps_again < 0.6 * steps_first, (steps_first, steps_again)
    assert cache.stats()["bytes"] > 0


def test_sampling_keeps_the_law_with_a_filled_cache(tiny_dir: Path) -> None:
    """Chi-square on the first two tokens' joint law, after a sampled batch of the same prompt filled the cache
    (its trees then come from other requests' samples)."""
    llm = LLM(tiny_dir, device="cpu", dtype="float32",
              speculative=SpeculativeConfig.resolve("SUFFIX", suffix_min_token_prob=0.0))
    ids = llm.encode("a = 1\nb = 2\na = 1\nb")

    def sampled(n: int, seed0: int, tokens: int) -> list[SamplingParams]:
        return [SamplingParams(max_new_tokens=tokens, temperature=1.5, top_k=3, seed=seed0 + s, ignore_eos=True)
                for s in range(n)]

    llm.generate([ids] * 64, sampled(64, 50_000, 12))
    assert llm.drafter_builder is not None and llm.drafter_builder.suffix_cache is not None
    assert len(llm.drafter_builder.suffix_cache) == 64
    n = 600
    sp = llm.generate([ids] * n, sampled(n, 0, 2))
    pl = llm.generate_plain([ids] * n, sampled(n, 10_000, 2))
    assert sum(r.num_verify_steps for r in sp) > 0
    assert first_pairs_p_value(sp, pl) > 0.001


def test_a_later_turn_reuses_its_conversation_blocks(tiny_dir: Path) -> None:
    """Turn 2's prompt = turn 1's prompt + its answer + a new user message: every full block of turn 1's
    computed tokens is a prefix hit; after other requests pushed them to the host tier, they come back."""
    llm = LLM(tiny_dir, device="cpu", dtype="float32")
    engine = llm.make_engine(EngineConfig(num_kv_blocks=40, kv_block_size=16, hicache_gb=0.05), plain=True)
    decode = llm.tokenizer.decode
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    turn1 = llm.encode("<|im_start|>user\nRefactor this:\n" + CODE[0] * 3 + "<|im_end|>\n<|im_start|>assistant\n")
    out1 = generate_batch(engine, [turn1], [params], decode)[0].token_ids
    history = turn1 + out1
    turn2 = history + llm.encode("<|im_end|>\n<|im_start|>user\nNow add tests.<|im_end|>\n<|im_start|>assistant\n")
    s0 = engine.stats()
    generate_batch(engine, [turn2], [params], decode)
    s1 = engine.stats()
    computed = len(history) - 1  # the last answer token was sampled, never fed: its KV does not exist
    assert s1.prefix_hit_tokens - s0.prefix_hit_tokens == computed // 16 * 16
    # other conversations fill the 40-block pool: turn 2's blocks move to the host tier
    others = [llm.encode(f"<|im_start|>user\nconversation {i}: " + CODE[i % len(CODE)] * 4) for i in range(6)]
    generate_batch(engine, others, [params] * len(others), decode)
    s2 = engine.stats()
    assert s2.device_to_host_blocks > s1.device_to_host_blocks
    turn3 = turn2 + out1[:8] + llm.encode("<|im_end|>\n<|im_start|>user\nThanks.")
    generate_batch(engine, [turn3], [params], decode)
    s3 = engine.stats()
    assert s3.host_hit_tokens > s2.host_hit_tokens
    assert s3.host_to_device_blocks > s2.host_to_device_blocks
    assert s3.prefix_hit_tokens - s2.prefix_hit_tokens >= len(turn2) // 16 * 16 - 16

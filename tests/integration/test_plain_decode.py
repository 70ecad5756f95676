"""Plain decoding: the lossless reference. Greedy equals transformers; batching changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specserve.engine.llm import LLM
from specserve.types import SamplingParams

transformers = pytest.importorskip("transformers")

PROMPTS = ["def add(a, b):\n    return", "import os\n", "class Foo:\n    def __init__(self", "x = [1, 2"]


@pytest.fixture(scope="module")
def llm(tiny_dir: Path) -> LLM:
    return LLM(tiny_dir, device="cpu", dtype="float32")


def test_greedy_matches_transformers_generate(llm: LLM, tiny_dir: Path) -> None:
    ref = transformers.Qwen3ForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    for prompt in PROMPTS:
        ids = llm.encode(prompt)
        out = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=40, min_new_tokens=40,
                           pad_token_id=0)
        [res] = llm.generate([ids], SamplingParams(max_new_tokens=40, ignore_eos=True))
        assert res.token_ids == out[0, len(ids):].tolist()


def test_batch_of_different_lengths_equals_one_by_one(llm: LLM) -> None:
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    batched = llm.generate(PROMPTS, params)
    for prompt, res in zip(PROMPTS, batched, strict=True):
        [alone] = llm.generate([prompt], params)
        assert res.token_ids == alone.token_ids


def test_seeded_sampling_is_reproducible_and_varies(llm: LLM) -> None:
    p = SamplingParams(max_new_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    a = llm.generate([PROMPTS[0]], p)[0].token_ids
    b = llm.generate([PROMPTS[0]], p)[0].token_ids
    c = llm.generate([PROMPTS[0]], SamplingParams(max_new_tokens=20, temperature=1.0, seed=8,
                                                  ignore_eos=True))[0].token_ids
    assert a == b
    assert a != c


def test_max_new_tokens_eos_and_stop_string(llm: LLM) -> None:
    [full] = llm.generate([PROMPTS[1]], SamplingParams(max_new_tokens=30, ignore_eos=True))
    assert full.num_tokens == 30 and full.finish_reason == "length"
    # EOS: declare the 5th greedy token an end token; decoding stops right there.
    eos_tok = full.token_ids[4]
    [cut] = llm.generate([PROMPTS[1]], SamplingParams(max_new_tokens=30, stop_token_ids=(eos_tok,)))
    first = full.token_ids.index(eos_tok)
    assert cut.token_ids == full.token_ids[: first + 1] and cut.finish_reason == "stop"
    # A stop string taken from the middle of the greedy text: output ends before it.
    text = full.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    if stop.strip():
        [s] = llm.generate([PROMPTS[1]], SamplingParams(max_new_tokens=30, stop=(stop,), ignore_eos=True))
        assert s.finish_reason == "stop"
        assert s.text == text[: text.find(stop)]
        assert s.token_ids == full.token_ids[: len(s.token_ids)]


def test_context_limit_ends_generation(tmp_path: Path) -> None:
    from tiny import make_checkpoint

    d = make_checkpoint(tmp_path, "Qwen3ForCausalLM", max_position_embeddings=40)
    llm = LLM(d, device="cpu", dtype="float32")
    ids = list(range(5, 35))  # 30 tokens of a 40-token context
    [res] = llm.generate([ids], SamplingParams(max_new_tokens=100, ignore_eos=True))
    assert res.num_tokens == 10 and res.finish_reason == "length"
    with pytest.raises(ValueError, match="context limit"):
        llm.generate([list(range(5, 45))], SamplingParams(max_new_tokens=5))

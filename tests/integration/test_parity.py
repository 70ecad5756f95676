"""Our model code against transformers' own implementation, fp32, prefill and step decode."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from specserve.kv.contiguous import ContiguousKVCache
from specserve.models.loader import load_model

from tiny import make_checkpoint

transformers = pytest.importorskip("transformers")

CASES: list[tuple[str, dict[str, Any]]] = [
    ("LlamaForCausalLM", {}),
    ("LlamaForCausalLM", {"tie_word_embeddings": True, "attention_bias": True}),
    ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    ("Qwen2ForCausalLM", {}),
    ("Qwen2ForCausalLM", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                                           "original_max_position_embeddings": 128}}),
    ("Qwen3ForCausalLM", {}),
    ("Qwen3ForCausalLM", {"tie_word_embeddings": True, "num_key_value_heads": 4}),
]


@pytest.mark.parametrize(("arch", "extra"), CASES, ids=[f"{a}-{i}" for i, (a, _) in enumerate(CASES)])
def test_logits_match_transformers(tmp_path: Path, arch: str, extra: dict[str, Any]) -> None:
    make_checkpoint(tmp_path, arch, tokenizer=False, **extra)
    ref = getattr(transformers, arch).from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours, cfg, _ = load_model(tmp_path, torch.device("cpu"), torch.float32)
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ref(ids).logits  # [2, 40, V]
        cache = ContiguousKVCache.allocate(cfg, 2, 64, torch.device("cpu"), torch.float32)
        pos = torch.arange(40)[None].expand(2, 40)
        prefill = ours(ids[:, :30], pos[:, :30], cache.view(0, 30)).logits
        steps = [ours(ids[:, t : t + 1], pos[:, t : t + 1], cache.view(t, 1)).logits for t in range(30, 40)]
        got = torch.cat([prefill, *steps], dim=1)
        no_cache = ours(ids, pos).logits
    assert (got - expected).abs().max().item() <= 1e-4
    assert (no_cache - expected).abs().max().item() <= 1e-4


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    make_checkpoint(tmp_path / "one", "Qwen3ForCausalLM", tokenizer=False)
    ref = transformers.Qwen3ForCausalLM.from_pretrained(tmp_path / "one", dtype=torch.float32)
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="60KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    a, _, _ = load_model(tmp_path / "one", torch.device("cpu"), torch.float32)
    b, _, _ = load_model(tmp_path / "sharded", torch.device("cpu"), torch.float32)
    ids = torch.arange(10)[None]
    pos = torch.arange(10)[None]
    assert torch.equal(a(ids, pos).logits, b(ids, pos).logits)

"""Architectures we can run, keyed by the `architectures` entry of config.json."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from specserve.config import ModelConfig
from specserve.models.llama import CausalLM

ARCHITECTURES: dict[str, Callable[[ModelConfig], nn.Module]] = {
    "LlamaForCausalLM": CausalLM,
    "Qwen2ForCausalLM": CausalLM,
    "Qwen3ForCausalLM": CausalLM,
}


def build(cfg: ModelConfig) -> nn.Module:
    try:
        ctor = ARCHITECTURES[cfg.architecture]
    except KeyError:
        raise ValueError(
            f"architecture {cfg.architecture!r} is not supported; supported: {', '.join(sorted(ARCHITECTURES))}"
        ) from None
    return ctor(cfg)

"""DFlash and DFlash 2 drafter checkpoints: read and check a config.json + safetensors directory against the
target, load, save, and write random-weight drafters (layout: `speculative/dflash/model.py`).

DFlash 2's codebooks are written as z-lab's published checkpoints name them, `candidate_selector.{predecessor,
successor}_codebook` without a `.weight` (its `from_pretrained` maps them onto its embeddings); the `.weight` form
its `save_pretrained` writes is read too.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from specserve.config import ModelConfig, SpeculativeConfig
from specserve.models.loader import resolve_model_path
from specserve.models.weights import fuse_hf_state, iter_tensors, save_safetensors, split_to_hf, weight_files
from specserve.speculative.dflash.conv import GroupedCausalConv
from specserve.speculative.dflash.model import ARCH, FLAG, DFlashConfig, DFlashDraftModel, default_target_layer_ids

_CODEBOOKS = tuple(f"candidate_selector.{n}_codebook" for n in ("predecessor", "successor"))


def _published_name(name: str) -> str:
    """A parameter or checkpoint name (either codebook form, `model.` prefix or not) -> the published one,
    unprefixed (codebooks without `.weight`)."""
    name = name.removeprefix("model.")
    return name.removesuffix(".weight") if name.removesuffix(".weight") in _CODEBOOKS else name


def _published_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {_published_name(k): v for k, v in state.items()}


def read_dflash_config(model_dir: Path) -> DFlashConfig:
    try:
        return DFlashConfig.from_hf(json.loads((model_dir / "config.json").read_text()))
    except (ValueError, OSError) as e:
        raise ValueError(f"{FLAG} {model_dir}: {e}") from None


def check_against_target(cfg: DFlashConfig, target: ModelConfig, where: str) -> None:
    """The drafter shares the target's embedding and LM head and reads its layers: sizes must agree."""
    b = cfg.body
    if b.hidden_size != target.hidden_size:
        raise ValueError(f"{where}: drafter hidden_size {b.hidden_size} != target hidden_size {target.hidden_size} "
                         "(DFlash uses the target's embedding and LM head); use a drafter trained for this target")
    if b.vocab_size != target.vocab_size:
        raise ValueError(f"{where}: drafter vocab_size {b.vocab_size} != target vocab_size {target.vocab_size}")
    if cfg.num_target_layers is not None and cfg.num_target_layers != target.num_hidden_layers:
        raise ValueError(f"{where}: drafter num_target_layers {cfg.num_target_layers} != the target's "
                         f"{target.num_hidden_layers} layers; use a drafter trained for this target")
    if max(cfg.target_layer_ids) >= target.num_hidden_layers:
        raise ValueError(f"{where}: dflash_config.target_layer_ids {list(cfg.target_layer_ids)} exceed the "
                         f"target's {target.num_hidden_layers} layers")


def dflash_block_size(spec: SpeculativeConfig, cfg: DFlashConfig) -> int:
    """The block drafted per round: --speculative-dflash-block-size if set, else the drafter's. A shorter block
    than trained is allowed (the reference shortens it near max length); a longer one was never trained."""
    bs = spec.dflash_block_size or cfg.block_size
    if bs > cfg.block_size:
        raise ValueError(f"--speculative-dflash-block-size {bs} exceeds the block_size {cfg.block_size} the drafter "
                         f"at {FLAG} {spec.draft_model_path} was trained with; use at most {cfg.block_size}")
    if spec.tree == "chain" and spec.num_draft_tokens > bs:
        raise ValueError(f"--speculative-num-draft-tokens {spec.num_draft_tokens} exceeds the DFlash block "
                         f"({bs}); a chain verifies at most block_size tokens")
    return bs


def _expected_shapes(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        state = DFlashDraftModel(cfg).state_dict()
    return {k: tuple(v.shape) for k, v in _published_names(split_to_hf(state, cfg.body)).items()}


def _check_weights(model_dir: Path, cfg: DFlashConfig) -> list[Path]:
    """Compare the safetensors headers with the config (no tensor data read); returns the weight files."""
    where = f"{FLAG} {model_dir}"
    try:
        files = weight_files(model_dir)
        found: dict[str, tuple[int, ...]] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                    found[_published_name(name)] = tuple(handle.get_slice(name).get_shape())
    except (ValueError, SafetensorError, OSError) as e:
        raise ValueError(f"{where}: {e}") from None
    expected = _expected_shapes(cfg)
    missing, extra = sorted(expected.keys() - found.keys()), sorted(found.keys() - expected.keys())
    if missing or extra:
        raise ValueError(f"{where}: weights do not match a {cfg.architecture} config: missing {missing[:4]}, "
                         f"unexpected {extra[:4]}")
    for name, shape in expected.items():
        if found[name] != shape:
            hint = (f" (= len(target_layer_ids) {len(cfg.target_layer_ids)} x hidden_size)" if name == "fc.weight"
                    else "")
            raise ValueError(f"{where}: {name} has shape {list(found[name])}, config implies {list(shape)}{hint}")
    return files


def check_dflash(draft_dir: Path, target_cfg: ModelConfig, spec: SpeculativeConfig) -> DFlashConfig:
    """Everything that can be checked without reading weights: config, target match, block size, weight shapes."""
    cfg = read_dflash_config(draft_dir)
    check_against_target(cfg, target_cfg, f"{FLAG} {draft_dir}")
    dflash_block_size(spec, cfg)
    _check_weights(draft_dir, cfg)
    return cfg


def load_dflash(path: str | Path, target_cfg: ModelConfig, device: torch.device,
                dtype: torch.dtype) -> DFlashDraftModel:
    """A checkpoint directory (or bundled name) -> eval-mode module with `.config`, validated against the target."""
    try:
        model_dir = resolve_model_path(path)
    except ValueError as e:
        raise ValueError(f"{FLAG}: {e}") from None
    cfg = read_dflash_config(model_dir)
    check_against_target(cfg, target_cfg, f"{FLAG} {model_dir}")
    files = _check_weights(model_dir, cfg)
    tensors = {f"model.{_published_name(k)}": t for k, t in iter_tensors(files)}
    fused = {k.removeprefix("model."): t for k, t in fuse_hf_state(tensors).items()}
    fused = {(f"{k}.weight" if k in _CODEBOOKS else k): t for k, t in fused.items()}
    with torch.device("meta"):
        module = DFlashDraftModel(cfg)
    module = module.to_empty(device="cpu")
    module.load_state_dict(fused, strict=True)
    module = module.to(device=device, dtype=dtype).eval()
    module.requires_grad_(False)
    return module


def save_dflash(module: DFlashDraftModel, cfg: DFlashConfig, path: Path) -> None:
    """Write config.json + model.safetensors in the public layout (split q/k/v and gate/up)."""
    path.mkdir(parents=True, exist_ok=True)
    state = _published_names(split_to_hf({k: v.detach() for k, v in module.state_dict().items()}, cfg.body))
    save_safetensors(state, path / "model.safetensors")
    dtype = next(module.parameters()).dtype
    (path / "config.json").write_text(json.dumps(cfg.to_hf(dtype), indent=2) + "\n")


def init_random_dflash(
    target_cfg: ModelConfig, path: Path, seed: int = 0, *, num_hidden_layers: int = 2, block_size: int = 16,
    target_layer_ids: Sequence[int] | None = None, mask_token_id: int | None = None,
    intermediate_size: int | None = None, num_attention_heads: int | None = None,
    num_key_value_heads: int | None = None, head_dim: int | None = None, **calibration: Any,
) -> DFlashConfig:
    """Write a random-weight drafter for `target_cfg` (HF-style init: N(0, 0.02) weights, unit norms).
    Defaults: the target's head layout, num_hidden_layers tapped layers spread by `default_target_layer_ids`,
    mask token = the last vocabulary id (padded vocabularies leave it unused); `calibration`: DFlashConfig's
    calibration fields (tree_temperature, sample_temperature, sample_reveal, greedy_reveal) or DFlash 2's sizes
    (conv_kernel_size, conv_group_size, selector_rank, selector_top_k: a DFlash 2 drafter, its convolutions
    starting as the identity plus N(0, 0.02) dynamic taps)."""
    body = replace(
        target_cfg, architecture=ARCH, num_hidden_layers=num_hidden_layers, qk_norm=True, tie_word_embeddings=False,
        intermediate_size=intermediate_size or target_cfg.intermediate_size,
        num_attention_heads=num_attention_heads or target_cfg.num_attention_heads,
        num_key_value_heads=num_key_value_heads or target_cfg.num_key_value_heads,
        head_dim=head_dim or target_cfg.head_dim, attention_bias=False, o_proj_bias=False, mlp_bias=False,
    )
    ids = tuple(target_layer_ids or default_target_layer_ids(target_cfg.num_hidden_layers, num_hidden_layers))
    mask = target_cfg.vocab_size - 1 if mask_token_id is None else mask_token_id
    cfg = DFlashConfig(body, ids, mask, block_size, target_cfg.num_hidden_layers, **calibration)
    module = DFlashDraftModel(cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
        for m in module.modules():
            if isinstance(m, GroupedCausalConv):
                m.reset_identity()
                m.kernel_projection.weight.normal_(0.0, 0.02, generator=gen)
    save_dflash(module, cfg, path)
    return cfg

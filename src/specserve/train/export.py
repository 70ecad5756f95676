"""`specserve train export`: a trained drafter as a Hugging Face directory other engines load.

  --format sglang | vllm   EAGLE-3: `LlamaForCausalLMEagle3` config.json (draft_vocab_size, target_hidden_size,
                           num_hidden_layers 1, each engine's aux-layer field) + model.safetensors with
                           fc.*, midlayer.*, norm.*, lm_head.*, d2t, t2d. Both engines read this one layout;
                           the format decides the serving instructions in the model card (README.md).
  --format dflash          `DFlashDraftModel` config.json (block_size, dflash_config.{target_layer_ids,
                           mask_token_id}) + model.safetensors, as published DFlash drafters are laid out.
The weights are cast to --dtype, written to a temporary directory, loaded back into specserve and run on a
fixed input next to the source cast the same way; only identical outputs are moved into --out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specserve.config import ModelConfig, parse_dtype
from specserve.models.loader import load_config, resolve_model_path
from specserve.speculative.dflash.checkpoint import load_dflash, save_dflash
from specserve.speculative.dflash.model import ARCH as DFLASH_ARCH
from specserve.speculative.dflash.model import ARCH2 as DFLASH2_ARCH
from specserve.speculative.dflash.model import DFlashDraftModel
from specserve.speculative.eagle3.checkpoint import load_eagle3, save_eagle3
from specserve.speculative.eagle3.model import ARCHITECTURES as EAGLE3_ARCHS
from specserve.speculative.eagle3.model import Eagle3Model
from specserve.train import checkpoint as ckpt

FORMATS = ("sglang", "vllm", "dflash")
CPU = torch.device("cpu")


@dataclass(frozen=True)
class ExportConfig:
    drafter: Path  # a drafter directory, or a training run directory holding drafter/
    target: str
    out: Path
    format: str
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"--format {self.format!r}: use one of {', '.join(FORMATS)}")
        parse_dtype(self.dtype)


def source_dir(path: Path) -> Path:
    if (path / "config.json").exists():
        return path
    if (path / "drafter" / "config.json").exists():
        return path / "drafter"
    raise ValueError(f"--drafter {path}: neither a drafter directory (config.json) nor a training run (drafter/)")


def _probe(model: Eagle3Model | DFlashDraftModel, target: ModelConfig) -> torch.Tensor:
    """A fixed input through the drafter -> its output [1, 8, *] (DFlash 2: with its selector's scores, flattened,
    so the codebooks and projection are checked too)."""
    gen = torch.Generator().manual_seed(0)
    dtype = next(model.parameters()).dtype
    pos = torch.arange(8)[None]
    with torch.no_grad():
        if isinstance(model, Eagle3Model):
            c = model.config
            states = torch.randn(1, 8, len(c.aux_layer_ids) * c.target_hidden_size, generator=gen).to(dtype)
            emb = torch.randn(1, 8, c.hidden_size, generator=gen).to(dtype)
            return model.draft_logits(model(emb, model.project(states), pos))
        d = model.config
        feats = torch.randn(1, 8, len(d.target_layer_ids) * target.hidden_size, generator=gen).to(dtype)
        noise = torch.randn(1, 4, target.hidden_size, generator=gen).to(dtype)
        out = model(noise, pos[:, 4:], model.context_kv(feats[:, :4], pos[:, :4]))  # [1, 4, H]
        if model.candidate_selector is None:
            return out
        unary = torch.randn(1, 3, d.body.vocab_size, generator=gen)
        tr = model.candidate_selector.transitions(out[:, 1:], unary, torch.tensor([1]))
        return torch.cat((out.float().flatten(), tr.first.flatten(), tr.step.flatten(), tr.cands.flatten().float()))


def _model_card(kind: str, fmt: str, out: Path, target: str, summary: dict[str, Any] | None) -> str:
    serve = {
        "sglang": f"python -m sglang.launch_server --model-path {target} --speculative-algorithm EAGLE3 "
                  f"--speculative-draft-model-path {out} --speculative-num-steps 5 --speculative-eagle-topk 1 "
                  "--speculative-num-draft-tokens 6",
        "vllm": f"vllm serve {target} --speculative-config "
                f"'{{\"method\": \"eagle3\", \"model\": \"{out}\", \"num_speculative_tokens\": 5}}'",
        "dflash": f"python -m sglang.launch_server --model-path {target} --speculative-algorithm DFLASH "
                  f"--speculative-draft-model-path {out}",
    }[fmt]
    algo = "EAGLE3" if kind == "eagle3" else "DFLASH"
    lines = [f"# {kind} drafter for `{target}`", "", f"Serve ({fmt}): `{serve}`", "",
             f"specserve: `specserve generate --model {target} --speculative-algorithm {algo} "
             f"--speculative-draft-model-path {out} --prompt ...`", ""]
    if summary is None:
        return "\n".join([*lines, "No train_summary.json was found next to the drafter: training facts unknown.", ""])
    data = summary.get("data", {})
    sets = data.get("datasets") or [data]  # several --data directories: each one's own facts
    share = summary.get("time_share", {})
    described = "; ".join(
        f"prompts `{d.get('settings', {}).get('prompts')}`, responses regenerated by the target at temperature "
        f"{d.get('settings', {}).get('temperature')}" for d in sets)
    lines += [
        "## Training", "",
        f"- data: {data.get('used_sequences')} sequences, {data.get('tokens')} tokens; {described}",
        f"- steps: {summary.get('steps')}, tokens seen: {summary.get('tokens_seen')}, "
        f"throughput {run_tokens_per_s(summary)} tokens/s on {summary.get('device')} x{summary.get('processes')} "
        f"({summary.get('precision')})",
        f"- time: target forward {share.get('target', 0):.0%}, drafter forward {share.get('drafter_fwd', 0):.0%}, "
        f"drafter backward + optimizer {share.get('drafter_bwd', 0):.0%}",
        f"- final loss: {summary.get('final_loss')}",
        f"- last acceptance evaluation: {json.dumps(summary.get('last_eval') or {})}", "",
    ]
    return "\n".join(lines)


def export(cfg: ExportConfig) -> dict[str, Any]:
    src = source_dir(cfg.drafter)
    arch = (json.loads((src / "config.json").read_text()).get("architectures") or [None])[0]
    kind = ("eagle3" if arch in EAGLE3_ARCHS else "dflash" if arch == DFLASH_ARCH
            else "dflash2" if arch == DFLASH2_ARCH else None)
    if kind is None:
        raise ValueError(f"--drafter {src}: architectures {arch!r} is neither EAGLE-3 nor DFlash (1 or 2)")
    if (kind == "eagle3") != (cfg.format in ("sglang", "vllm")):
        want = "sglang or vllm" if kind == "eagle3" else "dflash"
        raise ValueError(f"--format {cfg.format} does not fit a {kind} drafter ({src}); use --format {want}")
    target_cfg = load_config(resolve_model_path(cfg.target))
    dtype = parse_dtype(cfg.dtype)
    model: Eagle3Model | DFlashDraftModel
    if kind == "eagle3":
        model = load_eagle3(src, target_cfg, CPU, torch.float32).to(dtype)
    else:
        model = load_dflash(src, target_cfg, CPU, torch.float32).to(dtype)
    expected = _probe(model, target_cfg)
    summary_path = next((p for p in (src / "train_summary.json", src.parent / "train_summary.json") if p.exists()),
                        None)
    summary = json.loads(summary_path.read_text()) if summary_path else None

    def write(tmp: Path) -> None:
        if isinstance(model, Eagle3Model):
            save_eagle3(model, model.config, tmp)
            back: Eagle3Model | DFlashDraftModel = load_eagle3(tmp, target_cfg, CPU, dtype)
        else:
            save_dflash(model, model.config, tmp)
            back = load_dflash(tmp, target_cfg, CPU, dtype)
        if not torch.equal(_probe(back, target_cfg), expected):
            raise RuntimeError("the exported drafter does not reproduce the source's outputs")
        (tmp / "README.md").write_text(_model_card(kind, cfg.format, cfg.out, cfg.target, summary))

    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    ckpt.replace_dir(write, cfg.out)
    params = sum(p.numel() for p in model.parameters())
    return {"out": str(cfg.out), "format": cfg.format, "kind": kind, "dtype": cfg.dtype, "params": params,
            "round_trip": "identical", "source": str(src)}


def run_tokens_per_s(summary: dict[str, Any]) -> float | None:
    """Tokens per second of step time over the whole run (a resumed run's parts together) from a training
    summary (its own `tokens_per_s` where it holds no step time)."""
    step_s = summary.get("time_s", {}).get("step_s")
    if step_s:
        return round(summary["tokens_seen"] / step_s, 1)
    return summary.get("tokens_per_s")

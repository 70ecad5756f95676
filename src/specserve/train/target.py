"""`specserve train-target`: build the bundled demo target (tokenizer + small Qwen3 code model).

Reproducible from a seed: the corpus is the interpreter's standard library, split by file.
Checkpoints are Hugging Face directories; `--resume` continues from the last one, `--init-from` starts a new
schedule from a finished checkpoint (its architecture and tokenizer kept). Each evaluation also logs the loop
measure (repeated 4-grams of greedy output on the coding prompts), the figure a longer run must bring down.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from specserve.config import ModelConfig
from specserve.models.llama import CausalLM
from specserve.models.weights import save_safetensors, split_to_hf
from specserve.train import corpus


@dataclass(frozen=True)
class TargetTrainConfig:
    out: Path
    work: Path
    vocab_size: int = 8192
    hidden_size: int = 384
    num_layers: int = 6
    num_heads: int = 6
    num_kv_heads: int = 2
    intermediate_size: int = 1024
    seq_len: int = 512
    batch_size: int = 16
    lr: float = 1.5e-3
    warmup_steps: int = 200
    max_steps: int = 6000
    max_minutes: float | None = None
    eval_every: int = 250
    save_every: int = 250
    eval_batches: int = 16
    seed: int = 0
    threads: int | None = None
    compile: bool = False
    init_from: Path | None = None
    loop_eval: bool = True

    def __post_init__(self) -> None:
        if self.init_from is None and (self.vocab_size < 512 or self.vocab_size % 64):
            raise ValueError("--vocab-size must be a multiple of 64 and at least 512")
        if self.hidden_size % self.num_heads:
            raise ValueError("--hidden-size must be divisible by --num-heads")
        if self.max_steps <= self.warmup_steps:
            raise ValueError("--max-steps must exceed --warmup-steps")
        if self.init_from is not None and not (Path(self.init_from) / "config.json").is_file():
            raise ValueError(f"--init-from {self.init_from}: not a Hugging Face checkpoint directory "
                             "(no config.json); pass a directory written by train-target, e.g. "
                             "src/specserve/assets/models/demo")


def with_init_architecture(cfg: TargetTrainConfig) -> TargetTrainConfig:
    """The architecture of `--init-from`'s checkpoint replaces the size flags (the weights must fit it)."""
    if cfg.init_from is None:
        return cfg
    raw = json.loads((Path(cfg.init_from) / "config.json").read_text())
    return replace(cfg, vocab_size=raw["vocab_size"], hidden_size=raw["hidden_size"],
                   num_layers=raw["num_hidden_layers"], num_heads=raw["num_attention_heads"],
                   num_kv_heads=raw["num_key_value_heads"], intermediate_size=raw["intermediate_size"])


def hf_config(cfg: TargetTrainConfig, eos_id: int) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.hidden_size // cfg.num_heads,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "bfloat16",
    }


def prepare_data(cfg: TargetTrainConfig) -> tuple[np.ndarray, np.ndarray, Path]:
    """Tokenizer + token streams, cached under `work/` (train.npy, val.npy, tokenizer.json)."""
    cfg.work.mkdir(parents=True, exist_ok=True)
    tok_path, train_path, val_path = cfg.work / "tokenizer.json", cfg.work / "train.npy", cfg.work / "val.npy"
    if cfg.init_from is not None:
        init_tok = (Path(cfg.init_from) / "tokenizer.json").read_text()
        if tok_path.exists() and tok_path.read_text() != init_tok:
            raise ValueError(f"--work {cfg.work} holds a tokenizer other than --init-from's; "
                             "pass a fresh --work directory")
        if not tok_path.exists():
            tok_path.write_text(init_tok)
            train_path.unlink(missing_ok=True)
            val_path.unlink(missing_ok=True)
    if not (tok_path.exists() and train_path.exists() and val_path.exists()):
        files = corpus.stdlib_files()
        train_texts: list[str] = []
        val_texts: list[str] = []
        for f in tqdm(files, desc="reading stdlib", unit="file"):
            text = corpus.read_text(f)
            if text:
                (val_texts if corpus.is_validation(f) else train_texts).append(text)
        if tok_path.exists():
            from tokenizers import Tokenizer as HFTok

            tok = HFTok.from_file(str(tok_path))
        else:
            tok = corpus.train_tokenizer(train_texts, cfg.vocab_size - len(corpus.ADDED_TOKENS))
            tok.save(str(tok_path))
        eos = eos_id_of(tok)
        for texts, path in ((train_texts, train_path), (val_texts, val_path)):
            ids: list[int] = []
            for enc in tqdm(tok.encode_batch(texts), desc=f"tokenizing {path.stem}", unit="file"):
                ids.extend(enc.ids)
                ids.append(eos)
            np.save(path, np.asarray(ids, dtype=np.int32))
    return np.load(train_path), np.load(val_path), tok_path


def eos_id_of(tok: Any) -> int:
    eos = tok.token_to_id(corpus.EOS)
    if eos is None:
        raise ValueError(f"tokenizer has no {corpus.EOS} token")
    return int(eos)


def lr_at(step: int, cfg: TargetTrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def batch(data: np.ndarray, cfg: TargetTrainConfig, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(data) - cfg.seq_len - 1, (cfg.batch_size,), generator=gen)  # [B]
    return torch.stack([torch.from_numpy(data[s : s + cfg.seq_len + 1].astype(np.int64)) for s in starts.tolist()])


def lm_loss(model: CausalLM, tokens: torch.Tensor) -> torch.Tensor:
    """tokens [B, T+1] -> mean next-token cross-entropy."""
    inp, tgt = tokens[:, :-1], tokens[:, 1:]
    pos = torch.arange(inp.shape[1])[None].expand_as(inp)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(inp, pos, compute_logits=True)
    assert out.logits is not None
    return F.cross_entropy(out.logits.float().flatten(0, 1), tgt.flatten())


@torch.no_grad()
def evaluate(model: CausalLM, val: np.ndarray, cfg: TargetTrainConfig) -> float:
    model.eval()
    gen = torch.Generator().manual_seed(1234)
    losses = [lm_loss(model, batch(val, cfg, gen)).item() for _ in range(cfg.eval_batches)]
    model.train()
    return float(np.mean(losses))


def loop_measure(checkpoint: Path, max_new_tokens: int = 128) -> float:
    """Mean fraction of repeated 4-grams in greedy output from the coding prompts (0 = no loops)."""
    from specserve.bench.acceptance import repeated_ngram_fraction
    from specserve.bench.suites import coding_prompts
    from specserve.engine.llm import LLM
    from specserve.types import SamplingParams

    llm = LLM(checkpoint, device="cpu", dtype="bfloat16")
    prompts = [p for _, p in coding_prompts()]
    results = llm.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True))
    return float(np.mean([repeated_ngram_fraction(r.token_ids) for r in results]))


def save_checkpoint(model: CausalLM, mcfg: ModelConfig, raw_cfg: dict[str, Any], tok_path: Path, out: Path,
                    state: dict[str, Any]) -> None:
    """HF directory (bf16 weights, tokenizer, config) + training state for --resume."""
    save_hf_dir(model, mcfg, raw_cfg, tok_path, out)
    tmp = out / "train_state.pt.tmp"
    torch.save(state, tmp)
    tmp.replace(out.parent / f"{out.name}.train_state.pt")


def save_hf_dir(model: CausalLM, mcfg: ModelConfig, raw_cfg: dict[str, Any], tok_path: Path, out: Path) -> None:
    """The model as a Hugging Face directory the engine loads: bf16 weights, tokenizer, configs."""
    from specserve.tokenizer import Tokenizer  # noqa: F401 - documents the files written here

    out.mkdir(parents=True, exist_ok=True)
    tensors = split_to_hf({k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}, mcfg)
    save_safetensors(tensors, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(raw_cfg, indent=2) + "\n")
    (out / "tokenizer.json").write_text(tok_path.read_text())
    eos = corpus.EOS
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "pad_token": eos, "bos_token": None,
        "model_max_length": raw_cfg["max_position_embeddings"], "chat_template": corpus.CHAT_TEMPLATE,
    }, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": raw_cfg["eos_token_id"], "eos_token_id": raw_cfg["eos_token_id"], "do_sample": False},
        indent=2) + "\n")


def train(cfg: TargetTrainConfig, resume: bool = False) -> dict[str, Any]:
    cfg = with_init_architecture(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    train_ids, val_ids, tok_path = prepare_data(cfg)
    from tokenizers import Tokenizer as HFTok

    eos_id = eos_id_of(HFTok.from_file(str(tok_path)))
    # --init-from: its own config (the weights must load into it), else the one the size flags make
    raw = (json.loads((Path(cfg.init_from) / "config.json").read_text()) if cfg.init_from is not None
           else hf_config(cfg, eos_id))
    mcfg = ModelConfig.from_hf(raw)
    torch.manual_seed(cfg.seed)
    model = CausalLM(mcfg)
    _init_weights(model, cfg.num_layers)
    if cfg.init_from is not None:
        from specserve.models.loader import load_model

        init, _, _ = load_model(str(cfg.init_from), torch.device("cpu"), torch.float32)
        model.load_state_dict(init.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(cfg.seed)
    step, tokens_seen, best = 0, 0, float("inf")
    state_path = cfg.out.parent / f"{cfg.out.name}.train_state.pt"
    log_path = cfg.work / "train_log.jsonl"
    if resume and state_path.exists():
        st = torch.load(state_path, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optim"])
        gen.set_state(st["gen"])
        step, tokens_seen = st["step"], st["tokens_seen"]
    n_params = sum(p.numel() for p in model.parameters())
    started = time.time()
    bar = tqdm(total=cfg.max_steps, initial=step, desc="train-target", unit="step")
    model.train()
    loss_fn = torch.compile(lm_loss) if cfg.compile else lm_loss
    last: dict[str, Any] = {}
    while step < cfg.max_steps:
        if cfg.max_minutes is not None and (time.time() - started) / 60 > cfg.max_minutes:
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        loss = loss_fn(model, batch(train_ids, cfg, gen))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens_seen += cfg.batch_size * cfg.seq_len
        elapsed = time.time() - started
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{tokens_seen / max(elapsed, 1e-9):.0f}")
        last = {"step": step, "loss": loss.item(), "lr": lr_at(step - 1, cfg), "tokens_seen": tokens_seen,
                "elapsed_s": round(elapsed, 1)}
        evaluating = step % cfg.eval_every == 0 or step == cfg.max_steps
        saving = step % cfg.save_every == 0 or step == cfg.max_steps
        if evaluating:
            last["val_loss"] = evaluate(model, val_ids, cfg)
            best = min(best, last["val_loss"])
        if saving:
            save_checkpoint(model, mcfg, raw, tok_path, cfg.out, {
                "model": model.state_dict(), "optim": opt.state_dict(), "gen": gen.get_state(),
                "step": step, "tokens_seen": tokens_seen, "config": {k: str(v) for k, v in asdict(cfg).items()},
            })
        if evaluating and cfg.loop_eval:  # greedy decoding by the engine, from the weights of this step
            probe = cfg.out if saving else cfg.work / "loop-eval"
            if not saving:
                save_hf_dir(model, mcfg, raw, tok_path, probe)
            last["loop_greedy"] = loop_measure(probe)
            bar.write(f"step {step}: val_loss {last['val_loss']:.3f}, loop measure {last['loop_greedy']:.2f}")
        with log_path.open("a") as fh:
            fh.write(json.dumps(last) + "\n")
    bar.close()
    if "val_loss" not in last:
        last["val_loss"] = evaluate(model, val_ids, cfg)
    save_checkpoint(model, mcfg, raw, tok_path, cfg.out, {
        "model": model.state_dict(), "optim": opt.state_dict(), "gen": gen.get_state(),
        "step": step, "tokens_seen": tokens_seen, "config": {k: str(v) for k, v in asdict(cfg).items()},
    })
    return {**last, "params": n_params, "train_tokens": len(train_ids), "val_tokens": len(val_ids)}


def _init_weights(model: CausalLM, num_layers: int) -> None:
    for name, p in model.named_parameters():
        if p.dim() == 2:
            std = 0.02 / math.sqrt(2 * num_layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
            torch.nn.init.normal_(p, std=std)
        elif name.endswith("bias"):
            torch.nn.init.zeros_(p)

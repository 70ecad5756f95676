"""The drafter-training loop shared by EAGLE-3 and DFlash.

AdamW with linear warmup and cosine decay, gradient clipping, bf16 autocast where it pays (CUDA with bf16),
a tqdm bar (tokens/s, loss, ETA), a JSON-lines log, checkpoints every N steps and at exit, and `--resume`
that continues exactly: weights, optimizer, scheduler, every process's RNGs, and the data position.
Under `torchrun` the drafter is wrapped in DistributedDataParallel (gloo on CPU, nccl on CUDA); each
process takes its own slice of every global batch, and only rank 0 logs and writes files.

Run directory (`--out`): checkpoint.pt (training state), drafter/ (the latest weights as a loadable HF
directory), train_log.jsonl, train_summary.json. Time per step is split into the target's forward, the
drafter's forward (loss included) and its backward + optimizer step, so the log shows where time goes.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from specserve.train import checkpoint as ckpt
from specserve.train.data import Example
from specserve.train.distributed import Batcher, DistContext, sync
from specserve.train.features import FeatureSource

PRECISIONS = ("auto", "bf16", "fp32")


@dataclass(frozen=True)
class TrainConfig:
    out: Path
    steps: int
    batch_size: int = 8  # sequences per process per step
    lr: float = 3e-4
    warmup_steps: int | None = None  # default: 4% of the steps
    min_lr_ratio: float = 0.05  # the cosine ends at lr * min_lr_ratio
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    save_every: int = 500
    log_every: int = 10
    eval_every: int = 0  # 0: no periodic acceptance evaluation
    seed: int = 0
    precision: str = "auto"
    resume: bool = False
    progress: bool = True
    max_minutes: float | None = None  # stop (with a checkpoint) after this much time: a chunk of a longer run
    checkpoint_dtype: str = "float32"  # bfloat16: half the size; the run continues from the rounded state

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "save_every", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.lr <= 0 or self.grad_clip <= 0 or self.weight_decay < 0:
            raise ValueError("--lr and --grad-clip must be positive and --weight-decay >= 0")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps is not None and not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"--warmup-steps must be in [0, --steps {self.steps}), got {self.warmup_steps}")
        if self.eval_every < 0:
            raise ValueError(f"--eval-every must be >= 0 (0 = off), got {self.eval_every}")
        if self.max_minutes is not None and self.max_minutes <= 0:
            raise ValueError(f"--max-minutes must be positive, got {self.max_minutes}")
        if self.checkpoint_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"--checkpoint-dtype {self.checkpoint_dtype!r}: use float32 or bfloat16")
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision {self.precision!r}: use one of {', '.join(PRECISIONS)}")

    @property
    def warmup(self) -> int:
        return self.warmup_steps if self.warmup_steps is not None else max(1, round(0.04 * self.steps))


class StepLoss(NamedTuple):
    loss: torch.Tensor  # scalar, differentiable
    tokens: int  # sequence tokens this process processed
    target_s: float  # seconds spent in the target's forward
    metrics: dict[str, float]  # same keys every step (averaged over processes in the log)


class Objective(ABC):
    """One drafter family's training: the module, the loss of a batch, how its weights are written."""

    kind: str
    drafter: nn.Module
    capture: tuple[int, ...]  # the target states the drafter taps
    features: FeatureSource  # where the target's features come from (the target itself, or a cache)

    def use_features(self, source: FeatureSource) -> None:
        if source.capture != self.capture:
            raise ValueError(f"--feature-cache holds the target states {source.capture}, the drafter taps "
                             f"{self.capture}; build a cache for this drafter in a new directory")
        self.features = source

    @abstractmethod
    def loss(self, batch: list[Example], gen: torch.Generator) -> StepLoss: ...

    @abstractmethod
    def save_drafter(self, path: Path) -> None: ...


class WarmupCosine:
    """LR multiplier: linear warmup to 1, then cosine to `floor` at `total` (picklable for LambdaLR)."""

    def __init__(self, warmup: int, total: int, floor: float) -> None:
        self.warmup, self.total, self.floor = warmup, total, floor

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * progress))


class _LossModule(nn.Module):
    """What DDP wraps: holds the drafter's parameters; its forward is the objective's loss."""

    def __init__(self, objective: Objective) -> None:
        super().__init__()
        self.drafter = objective.drafter
        self.objective_loss = objective.loss

    def forward(self, batch: list[Example], gen: torch.Generator) -> StepLoss:
        return self.objective_loss(batch, gen)


def step_generator(seed: int, step: int, rank: int) -> torch.Generator:
    """The objective's randomness for one step of one process: a pure function of (seed, step, rank)."""
    return torch.Generator().manual_seed(((seed * 1_000_003 + step) * 1_009 + rank) % 2**63)


TIMERS = ("target_s", "drafter_fwd_s", "drafter_bwd_s", "step_s")


class Trainer:
    def __init__(self, cfg: TrainConfig, objective: Objective, data: list[Example], ctx: DistContext,
                 device: torch.device, evaluate: Callable[[Path], dict[str, Any]] | None = None,
                 info: dict[str, Any] | None = None) -> None:
        self.cfg, self.objective, self.data, self.ctx, self.device = cfg, objective, data, ctx, device
        self.evaluate, self.info = evaluate, info or {}
        self.batcher = Batcher(len(data), cfg.batch_size, ctx, cfg.seed)
        self.ckpt_path, self.log_path = cfg.out / "checkpoint.pt", cfg.out / "train_log.jsonl"
        self.bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and device.type == "cuda"
                                                 and torch.cuda.is_bf16_supported())
        params = [p for p in objective.drafter.parameters() if p.requires_grad]
        self.params = params
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, WarmupCosine(cfg.warmup, cfg.steps,
                                                                              cfg.min_lr_ratio))
        self.step, self.tokens_seen = 0, 0
        self.times = dict.fromkeys(TIMERS, 0.0)
        self.last_eval: dict[str, Any] = {}
        # the best evaluation so far ({"step", "score", "eval"}); its drafter is out/best/ (`_evaluate`)
        self.best_path = cfg.out / "best" / "eval.json"
        self.best: dict[str, Any] | None = None
        ckpt.seed_everything(cfg.seed + ctx.rank)  # a resume restores the saved states over these
        if ctx.main:
            cfg.out.mkdir(parents=True, exist_ok=True)
        if cfg.resume:
            self._restore()
        elif self.ckpt_path.exists():
            raise ValueError(f"--out {cfg.out} already holds a checkpoint; pass --resume to continue it "
                             "or choose a new --out")

    # ---- state ------------------------------------------------------------------------------------------

    def _fingerprint(self) -> dict[str, Any]:
        c = self.cfg
        return {"kind": self.objective.kind, "world": self.ctx.world, "steps": c.steps, "batch_size": c.batch_size,
                "seed": c.seed, "sequences": len(self.data)}

    def _restore(self) -> None:
        if not self.ckpt_path.exists():
            raise ValueError(f"--resume: no checkpoint at {self.ckpt_path}; start without --resume")
        st = torch.load(self.ckpt_path, map_location="cpu", weights_only=False)
        for key, value in self._fingerprint().items():
            if st["fingerprint"].get(key) != value:
                raise ValueError(f"--resume: the checkpoint was written with {key}={st['fingerprint'].get(key)}, "
                                 f"this run has {value}; resume with the same settings (processes, data)")
        try:
            self.objective.drafter.load_state_dict(st["model"])
        except RuntimeError as e:
            first = str(e).splitlines()[1].strip() if len(str(e).splitlines()) > 1 else str(e)
            raise ValueError(f"--resume: the checkpoint's drafter does not match this run's drafter flags "
                             f"({first}); pass the flags the run started with") from None
        self.opt.load_state_dict(st["optimizer"])
        self.sched.load_state_dict(st["scheduler"])
        self.batcher.load_state_dict(st["batcher"])
        ckpt.set_rng_state(st["rng"][self.ctx.rank])
        self.step, self.tokens_seen, self.times = st["step"], st["tokens_seen"], st["times"]
        self.last_eval = st.get("last_eval", {})
        if self.best_path.exists():
            self.best = json.loads(self.best_path.read_text())
        if self.ctx.main:
            ckpt.truncate_log(self.log_path, self.step)

    def save(self) -> None:
        """Checkpoint (collective: every process hands in its RNG state; rank 0 writes)."""
        states: list[Any] = [ckpt.rng_state()]
        if self.ctx.world > 1:
            states = [None] * self.ctx.world
            dist.all_gather_object(states, ckpt.rng_state())
        compact = self.cfg.checkpoint_dtype == "bfloat16"
        if compact:  # every process goes on from exactly what a resume would read
            ckpt.round_to_bf16(self.objective.drafter, self.opt)
        if self.ctx.main:
            ckpt.replace_dir(self.objective.save_drafter, self.cfg.out / "drafter")
            model, opt = self.objective.drafter.state_dict(), self.opt.state_dict()
            if compact:
                model, opt = ckpt.bf16_copy(model), ckpt.bf16_copy(opt)
            ckpt.atomic_torch_save({
                "fingerprint": self._fingerprint(), "step": self.step, "tokens_seen": self.tokens_seen,
                "times": self.times, "model": model, "optimizer": opt,
                "scheduler": self.sched.state_dict(), "batcher": self.batcher.state_dict(), "rng": states,
                "last_eval": self.last_eval, "config": {k: str(v) for k, v in asdict(self.cfg).items()},
            }, self.ckpt_path)
        if self.ctx.world > 1:
            dist.barrier()

    def _log(self, record: dict[str, Any]) -> None:
        with self.log_path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")

    # ---- loop -------------------------------------------------------------------------------------------

    def _one_step(self, module: nn.Module) -> tuple[float, int, dict[str, float]]:
        batch = [self.data[i] for i in self.batcher.next()]
        gen = step_generator(self.cfg.seed, self.step, self.ctx.rank)
        sync(self.device)
        t0 = time.perf_counter()
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            out: StepLoss = module(batch, gen)
        sync(self.device)
        t1 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        out.loss.backward()
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip))
        self.opt.step()
        self.sched.step()
        sync(self.device)
        t2 = time.perf_counter()
        names = sorted(out.metrics)
        vec = torch.tensor([out.loss.item(), out.tokens, out.target_s, *(out.metrics[k] for k in names)],
                           dtype=torch.float64, device=self.device)
        if self.ctx.world > 1:
            dist.all_reduce(vec)
            vec[[0, *range(3, len(vec))]] /= self.ctx.world
            vec[2] /= self.ctx.world
        v = vec.tolist()
        self.times["target_s"] += v[2]
        self.times["drafter_fwd_s"] += t1 - t0 - v[2]
        self.times["drafter_bwd_s"] += t2 - t1
        self.times["step_s"] += t2 - t0
        return v[0], int(v[1]), {"grad_norm": grad_norm, **dict(zip(names, v[3:], strict=True))}

    def run(self) -> dict[str, Any]:
        cfg, ctx = self.cfg, self.ctx
        module: nn.Module = _LossModule(self.objective)
        if ctx.world > 1:
            module = nn.parallel.DistributedDataParallel(module)
        self.objective.drafter.train()
        bar = tqdm(total=cfg.steps, initial=self.step, desc=f"train {self.objective.kind}", unit="step",
                   disable=not (ctx.main and cfg.progress), dynamic_ncols=True)
        started, start_tokens = time.perf_counter(), self.tokens_seen
        window: list[float] = []
        final_loss = float("nan")
        self.stopped_early = False
        try:
            while self.step < cfg.steps:
                if self._out_of_time(started):
                    self.stopped_early = True
                    self.save()
                    break
                loss, tokens, metrics = self._one_step(module)
                self.step += 1
                self.tokens_seen += tokens
                window.append(loss)
                rate = (self.tokens_seen - start_tokens) / max(time.perf_counter() - started, 1e-9)
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{rate:.0f}",
                                **({"acc": f"{self.last_eval['score']:.2f}"} if "score" in self.last_eval else {}))
                if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                    final_loss = sum(window) / len(window)
                    if ctx.main:
                        self._log({"step": self.step, "loss": round(final_loss, 5),
                                   "lr": self.sched.get_last_lr()[0], "tokens_seen": self.tokens_seen,
                                   "tokens_per_s": round(rate, 1), **{k: round(x, 5) for k, x in metrics.items()},
                                   **{k: round(x, 3) for k, x in self.times.items()}})
                    window = []
                if self.step % cfg.save_every == 0 or self.step == cfg.steps:
                    self.save()
                if self.evaluate is not None and cfg.eval_every and self.step % cfg.eval_every == 0:
                    self._evaluate(bar)
        except KeyboardInterrupt:
            if ctx.world == 1 and self.step > 0:
                self.save()
            raise
        finally:
            bar.close()
        return self._summary(final_loss, (self.tokens_seen - start_tokens) / max(time.perf_counter() - started, 1e-9))

    def _out_of_time(self, started: float) -> bool:
        """--max-minutes spent (every process takes rank 0's answer, so all stop at the same step)."""
        if self.cfg.max_minutes is None or self.step == 0:
            return False
        flag = torch.tensor([time.perf_counter() - started > 60 * self.cfg.max_minutes], device=self.device)
        if self.ctx.world > 1:
            dist.broadcast(flag, 0)
        return bool(flag.item())

    def _evaluate(self, bar: tqdm) -> None:
        """Measure the drafter (`train/evaluate.py`); where its score beats every earlier one, it becomes
        out/best/ (the checkpoint to export: chosen by acceptance, not by loss)."""
        if self.ctx.main:
            assert self.evaluate is not None
            with tempfile.TemporaryDirectory() as d:
                self.objective.save_drafter(Path(d) / "drafter")
                self.last_eval = self.evaluate(Path(d) / "drafter")
                score = self.last_eval.get("score", self.last_eval["accept_length"])
                better = self.best is None or score > self.best["score"]
                if better:
                    self.best = {"step": self.step, "score": score, "eval": self.last_eval}
                    record = json.dumps(self.best, indent=1) + "\n"

                    def write(path: Path) -> None:
                        shutil.copytree(Path(d) / "drafter", path)
                        (path / "eval.json").write_text(record)

                    ckpt.replace_dir(write, self.cfg.out / "best")
            self._log({"step": self.step, "eval": self.last_eval, "best_step": self.best and self.best["step"]})
            ref = self.last_eval.get("percent_of_reference")
            head = self.last_eval.get("headline_accept_length")
            bar.write(f"step {self.step}: accept length {self.last_eval['accept_length']:.3f}"
                      + (f", worst cut kind (non-looping) {head:.3f}" if head is not None else "")
                      + (f", {ref:.0f}% of the reference's streak" if ref is not None else "")
                      + (" (best so far: out/best/)" if better else ""))
        if self.ctx.world > 1:
            dist.barrier()

    def _summary(self, final_loss: float, rate: float) -> dict[str, Any]:
        total = max(self.times["step_s"], 1e-9)  # time inside training steps, kept across resumes
        summary = {
            "kind": self.objective.kind, "steps": self.step, "tokens_seen": self.tokens_seen,
            "finished": self.step >= self.cfg.steps,
            # the whole run's (a resumed run's first part included), and this process's since it started
            "tokens_per_s": round(self.tokens_seen / total, 1), "tokens_per_s_this_process": round(rate, 1),
            "final_loss": round(final_loss, 5), "processes": self.ctx.world,
            "precision": "bf16" if self.bf16 else "fp32", "device": str(self.device),
            "time_s": {k: round(v, 2) for k, v in self.times.items()},
            "time_share": {k.removesuffix("_s"): round(self.times[k] / total, 4) for k in TIMERS[:3]},
            "last_eval": self.last_eval, "best_eval": self.best, "data": self.info, "out": str(self.cfg.out),
        }
        if self.ctx.main:
            (self.cfg.out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary

"""Drafter training end to end on a tiny target: prepare -> train (EAGLE-3, DFlash) -> resume after SIGKILL,
two-process DDP, export -> load round trip, and the errors users meet first."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from reference_decoding import generate_plain
from specserve.models.llama import CausalLM
from specserve.models.loader import load_config, load_model
from specserve.speculative.dflash.checkpoint import init_random_dflash, load_dflash
from specserve.speculative.eagle3.checkpoint import init_random_eagle3, load_eagle3
from specserve.speculative.eagle3.model import Eagle3Model
from specserve.tokenizer import Tokenizer
from specserve.train.cli import add_train_parsers, main, run_training
from specserve.train.data import BUNDLED_PROMPTS, load_data, read_prompts, read_shard
from specserve.train.prompts import build_continuations, evaluation_texts
from specserve.types import SamplingParams

CPU = torch.device("cpu")
PROMPTS = ["def add(a, b):\n", "class Stack:\n    def push(self, item):\n", "import os\n\n\ndef walk(path):\n",
           "def parse(text):\n    \"\"\"Split text into words.\"\"\"\n", "for i in range(10):\n",
           "def is_prime(n):\n", "class Point:\n    def __init__(self, x, y):\n", "with open(path) as f:\n",
           "def reverse(items):\n"]
SMALL = ["--batch-size", "2", "--max-len", "48", "--device", "cpu", "--no-progress", "--log-every", "1"]
DFLASH = ["--block-size", "4", "--anchors-per-seq", "6", "--num-layers", "1"]
EAGLE = ["--ttt-steps", "3", "--draft-vocab-size", "200"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("train-data")
    lines = [json.dumps({"prompt": p}) for p in PROMPTS]
    lines.append(json.dumps({"messages": [{"role": "user", "content": "Write a sort function."}]}))
    (root / "prompts.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["prepare", "--target", str(tiny_dir), "--prompts", str(root / "prompts.jsonl"), "--out",
                 str(root / "data"), "--max-new-tokens", "16", "--batch-size", "4", "--shard-size", "4",
                 "--device", "cpu", "--dtype", "float32"]) == 0
    return root / "data"


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_train_parsers(parser.add_subparsers(dest="command"))
    return parser.parse_args(list(argv))


def test_prepare_writes_target_samples(data_dir: Path, tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    meta = json.loads((data_dir / "meta.json").read_text())
    assert meta["sequences"] == 10 and meta["vocab_size"] == 320 and len(meta["shards"]) == 3
    examples = [e for name in meta["shards"] for e in read_shard(data_dir / name)]
    tok = Tokenizer(tiny_dir)
    assert examples[0].tokens[: examples[0].prompt_len].tolist() == tok.encode(PROMPTS[0])
    chat = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Write a sort function."}]))
    assert examples[-1].tokens[: examples[-1].prompt_len].tolist() == chat
    assert all(1 <= e.response_len <= 16 for e in examples)
    # rerun with the same settings: finished shards are kept as they are; other settings are refused
    before = [(data_dir / n).stat().st_mtime_ns for n in meta["shards"]]
    argv = ["prepare", "--target", str(tiny_dir), "--prompts", str(data_dir.parent / "prompts.jsonl"), "--out",
            str(data_dir), "--max-new-tokens", "16", "--batch-size", "4", "--shard-size", "4", "--device", "cpu",
            "--dtype", "float32"]
    assert main(argv) == 0
    assert [(data_dir / n).stat().st_mtime_ns for n in meta["shards"]] == before
    capsys.readouterr()
    assert main([*argv, "--temperature", "0.5"]) == 2
    assert "other settings" in capsys.readouterr().err


def test_greedy_prepare_stores_the_targets_own_continuation(tiny_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": PROMPTS[5]}) + "\n")
    assert main(["prepare", "--target", str(tiny_dir), "--prompts", str(tmp_path / "p.jsonl"), "--out",
                 str(tmp_path / "d"), "--temperature", "0", "--max-new-tokens", "12", "--device", "cpu",
                 "--dtype", "float32"]) == 0
    [ex] = read_shard(tmp_path / "d" / "shard-00000.npz")
    model, cfg, _ = load_model(tiny_dir, CPU, torch.float32)
    assert isinstance(model, CausalLM)
    prompt = ex.tokens[: ex.prompt_len].tolist()
    [res] = generate_plain(model, [prompt], SamplingParams(max_new_tokens=12), cfg.eos_token_ids)
    assert ex.tokens[ex.prompt_len :].tolist() == res.token_ids


def test_answered_chat_lines_are_written_as_they_stand(tiny_dir: Path, tmp_path: Path) -> None:
    """A chat line ending in the assistant's answer is written as the template renders that turn, through its end
    of turn, once whatever --samples-per-prompt says, beside a generated line; an answer cut by --max-new-tokens
    keeps its first tokens."""
    user = {"role": "user", "content": "Write a sort function."}
    answer = "def sort(xs):\n    return sorted(xs)"
    (tmp_path / "p.jsonl").write_text(
        json.dumps({"messages": [user, {"role": "assistant", "content": answer}]}) + "\n"
        + json.dumps({"prompt": PROMPTS[0]}) + "\n")
    for out, cap in (("d", 64), ("cut", 5)):
        assert main(["prepare", "--target", str(tiny_dir), "--prompts", str(tmp_path / "p.jsonl"), "--out",
                     str(tmp_path / out), "--max-new-tokens", str(cap), "--samples-per-prompt", "2", "--device",
                     "cpu", "--dtype", "float32"]) == 0
    examples = read_shard(tmp_path / "d" / "shard-00000.npz")
    assert len(examples) == 3  # the answered line once, the plain prompt twice
    tok = Tokenizer(tiny_dir)
    prompt_text = tok.apply_chat_template([user])
    full = tok.apply_chat_template([user, {"role": "assistant", "content": answer}], add_generation_prompt=False)
    assert full.startswith(prompt_text) and examples[0].tokens.tolist() == tok.encode(full.rstrip())
    assert examples[0].prompt_len == len(tok.encode(prompt_text))
    want = tok.encode(full[len(prompt_text):].rstrip())
    assert examples[0].tokens[examples[0].prompt_len:].tolist() == want and len(want) > 5
    [cut, *_] = read_shard(tmp_path / "cut" / "shard-00000.npz")
    assert cut.tokens[cut.prompt_len:].tolist() == want[:5]


def test_bundled_prompts_are_stdlib_openings_not_evaluation_prompts() -> None:
    prompts = read_prompts(BUNDLED_PROMPTS)
    assert 200 <= len(prompts) <= 500 and BUNDLED_PROMPTS.stat().st_size < 150_000
    texts = [p.text or "" for p in prompts]
    assert all(t.lstrip().startswith(("def ", "class ", "async def ")) for t in texts)
    evaluation = evaluation_texts()
    assert len(evaluation) >= 10
    assert not [t for t in texts for e in evaluation if t in e or e in t]
    sources = [json.loads(line)["source"] for line in BUNDLED_PROMPTS.read_text().splitlines()]
    assert len({s.split(":")[0] for s in sources}) == len(sources)  # one opening per stdlib file


def test_malformed_prompts_file_is_an_error_naming_the_line(tiny_dir: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "def f():"}\n{"prompt": 3}\n{"prompt": "x"}\n')
    assert main(["prepare", "--target", str(tiny_dir), "--prompts", str(bad), "--out", str(tmp_path / "o")]) == 2
    err = "".join(capsys.readouterr()).strip()
    assert len(err.splitlines()) == 1 and f"{bad}:2:" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_target_drafter_and_data_mismatches_stop_before_training(
        data_dir: Path, tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from dataclasses import replace

    other = replace(load_config(tiny_dir), hidden_size=32, head_dim=8, num_attention_heads=4)
    init_random_eagle3(other, tmp_path / "e3")
    init_random_dflash(other, tmp_path / "df", block_size=4, mask_token_id=3)
    common = ["--target", str(tiny_dir), "--data", str(data_dir), "--steps", "2", *SMALL]
    for kind, path, needle in (("eagle3", "e3", "target_hidden_size 32"), ("dflash", "df", "hidden_size 32")):
        out = tmp_path / f"run-{kind}"
        assert main([kind, *common, "--out", str(out), "--init-from", str(tmp_path / path)]) == 2
        assert needle in capsys.readouterr().err
        assert not (out / "checkpoint.pt").exists()
    wrong = tmp_path / "data"
    shutil.copytree(data_dir, wrong)
    meta = json.loads((wrong / "meta.json").read_text())
    (wrong / "meta.json").write_text(json.dumps({**meta, "vocab_size": 384}))
    assert main(["eagle3", *common[:2], "--data", str(wrong), *common[4:], "--out", str(tmp_path / "r")]) == 2
    assert "vocab_size 384" in capsys.readouterr().err
    # one bad directory among several is named as well
    assert main(["eagle3", *common[:2], "--data", str(data_dir), str(wrong), *common[4:],
                 "--out", str(tmp_path / "r")]) == 2
    assert f"--data {wrong}" in capsys.readouterr().err


def test_several_data_directories_are_pooled(data_dir: Path, tiny_dir: Path) -> None:
    vocab = load_config(tiny_dir).vocab_size
    one, info = load_data([data_dir], vocab, 1024)
    assert info["data_dir"] == str(data_dir) and info["used_sequences"] == len(one)
    two, both = load_data([data_dir, data_dir], vocab, 1024)
    assert len(two) == 2 * len(one) and [e.prompt_len for e in two] == [e.prompt_len for e in one] * 2
    assert [d["data_dir"] for d in both["datasets"]] == [str(data_dir)] * 2
    assert both["used_sequences"] == len(two) and both["tokens"] == 2 * info["tokens"]
    from specserve.train.export import _model_card

    card = _model_card("dflash", "dflash", Path("out"), "demo", {"data": both, "steps": 1})
    assert card.count(f"`{info['settings']['prompts']}`") == 2 and "temperature None" not in card


def test_continuation_prompts_are_mid_file_training_code_not_evaluation() -> None:
    cuts = build_continuations(40)
    assert len(cuts) == 40 and len({c.source for c in cuts}) == 40
    assert all(20 <= len(c.prompt) <= 1200 for c in cuts)
    files = {c.source.rsplit(":", 1)[0] for c in cuts}
    assert len(files) == 40  # round-robin over files: one cut each before any file gets a second
    evaluation = evaluation_texts()
    assert not [c for c in cuts for e in evaluation if c.prompt in e or e in c.prompt]
    assert build_continuations(40) == cuts  # reproducible
    gone = frozenset(c.source for c in cuts[:5])
    other = build_continuations(40, seed=1, exclude=gone)
    assert len(other) == 40 and not gone & {c.source for c in other}
    assert all(c.prompt.endswith("\n") for c in cuts)  # the default: after a newline, as before


def test_continuation_prompts_at_every_cut_kind() -> None:
    """--cut-kinds: the contexts end, in turn, after a newline, at a line's end and inside a line (the kinds of
    `bench/cuts.py`), at the lines the default cuts after a newline."""
    kinds = ("after_newline", "line_end", "mid_line")
    mixed = build_continuations(60, cut_kinds=kinds)
    assert len(mixed) == 60 and mixed == build_continuations(60, cut_kinds=kinds)
    assert all(sum(c.kind == k for c in mixed) >= 10 for k in kinds)  # kinds rotate over the cuts
    for c in mixed:
        assert c.prompt.endswith("\n") == (c.kind == "after_newline")
        line = c.prompt.rsplit("\n", 1)[-1]
        assert c.kind == "after_newline" or line.strip()  # code before a cut inside or at the end of a line
    with pytest.raises(ValueError, match="--cut-kinds middle"):
        build_continuations(10, cut_kinds=("middle",))


KILL_AT_STEP_5 = """
import os, signal, sys
from specserve.train import trainer
log = trainer.Trainer._log
def log_then_die(self, record):
    log(self, record)
    if record.get("step") == 5:  # after the step-4 checkpoint, mid-interval
        os.kill(os.getpid(), signal.SIGKILL)
trainer.Trainer._log = log_then_die
from specserve.train.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigkill_then_resume_matches_an_uninterrupted_run(data_dir: Path, tiny_dir: Path, tmp_path: Path) -> None:
    """Exact: bitwise-equal weights (same process setup, deterministic CPU kernels, one thread)."""
    def argv(out: str) -> list[str]:
        return ["dflash", "--target", str(tiny_dir), "--data", str(data_dir), "--out", str(tmp_path / out),
                "--steps", "6", "--save-every", "2", "--lr", "3e-3", *SMALL, *DFLASH]

    run = [sys.executable, "-m", "specserve.train.cli"]
    subprocess.run([*run, *argv("full")], env=ENV, check=True, capture_output=True)
    killed = subprocess.run([sys.executable, "-c", KILL_AT_STEP_5, *argv("killed")], env=ENV, capture_output=True)
    assert killed.returncode == -signal.SIGKILL
    assert torch.load(tmp_path / "killed" / "checkpoint.pt", weights_only=False)["step"] == 4
    subprocess.run([*run, *argv("killed"), "--resume"], env=ENV, check=True, capture_output=True)
    full, resumed = (load_file(tmp_path / d / "drafter" / "model.safetensors") for d in ("full", "killed"))
    assert full.keys() == resumed.keys() and all(torch.equal(full[k], resumed[k]) for k in full)
    logs = [[json.loads(x) for x in (tmp_path / d / "train_log.jsonl").read_text().splitlines()]
            for d in ("full", "killed")]
    assert [r["step"] for r in logs[1]] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in logs[1]] == [r["loss"] for r in logs[0]]
    assert logs[0][0]["loss"] > logs[0][-1]["loss"]
    # the resumed run's summary counts its tokens and step time from step 0, not from the resume
    summary = json.loads((tmp_path / "killed" / "train_summary.json").read_text())
    tokens, step_s = summary["tokens_seen"], summary["time_s"]["step_s"]  # step_s rounded to 0.01 s
    assert tokens == logs[1][-1]["tokens_seen"] and step_s >= logs[1][3]["step_s"] - 0.006
    assert tokens / (step_s + 0.006) <= summary["tokens_per_s"] <= tokens / (step_s - 0.006)


DDP_SCRIPT = """
import argparse, sys, torch
from specserve.train import cli, distributed
seen = []
nxt = distributed.Batcher.next
def record(self):
    seen.append(nxt(self))
    return seen[-1]
distributed.Batcher.next = record
p = argparse.ArgumentParser()
cli.add_train_parsers(p.add_subparsers(dest="command"))
a = p.parse_args(sys.argv[1:])
t, summary = cli.run_training(a.command, a)
torch.save({"weights": t.objective.drafter.state_dict(), "seen": seen}, a.out / f"rank{t.ctx.rank}.pt")
"""


def test_two_process_ddp_keeps_ranks_identical(data_dir: Path, tiny_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "ddp.py").write_text(DDP_SCRIPT)
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(tmp_path / "ddp.py"), "eagle3", "--target", str(tiny_dir), "--data", str(data_dir),
                           "--out", str(out), "--steps", "2", "--lr", "3e-3", *SMALL, *EAGLE],
                          env=ENV, capture_output=True, text=True, cwd=tmp_path, check=False)
    assert proc.returncode == 0, f"torchrun exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    r0, r1 = (torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert all(torch.equal(r0["weights"][k], r1["weights"][k]) for k in r0["weights"])
    for a, b in zip(r0["seen"], r1["seen"], strict=True):
        assert len(a) == len(b) == 2 and not set(a) & set(b)  # each rank trained on its own slice
    saved = load_file(out / "drafter" / "model.safetensors")
    assert torch.equal(saved["fc.weight"], r0["weights"]["fc.weight"])
    assert json.loads((out / "train_summary.json").read_text())["processes"] == 2


def _probe_eagle(model: Eagle3Model) -> torch.Tensor:
    dtype = model.fc.weight.dtype
    gen = torch.Generator().manual_seed(0)
    emb, states = torch.randn(1, 5, 64, generator=gen).to(dtype), torch.randn(1, 5, 192, generator=gen).to(dtype)
    with torch.no_grad():
        return model.draft_logits(model(emb, model.project(states), torch.arange(5)[None]))


def test_eagle3_run_with_evaluation_exports_and_round_trips(data_dir: Path, tiny_dir: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    ref = tmp_path / "ref"
    init_random_eagle3(load_config(tiny_dir), ref, seed=9)
    a = _parse("eagle3", "--target", str(tiny_dir), "--data", str(data_dir), "--out", str(tmp_path / "run"),
               "--steps", "2", "--eval-every", "1", "--eval-prompts", "3", "--eval-max-new-tokens", "8",
               "--reference-draft", str(ref), *SMALL, *EAGLE)
    trainer, summary = run_training("eagle3", a)
    assert {"accept_length", "percent_of_reference", "loop_4gram", "score"} <= summary["last_eval"].keys()
    assert summary["last_eval"]["accept_length"] >= 1.0
    # the validation cuts of every kind; the best evaluation's drafter kept in out/best/ (chosen by its score)
    assert set(summary["last_eval"]["by_kind"]) == {"line_end", "after_newline", "mid_line"}
    evals = [json.loads(line) for line in (tmp_path / "run" / "train_log.jsonl").read_text().splitlines()
             if '"eval"' in line]
    assert [e["step"] for e in evals] == [1, 2]
    best = max(evals, key=lambda e: (e["eval"]["score"], -e["step"]))
    kept = json.loads((tmp_path / "run" / "best" / "eval.json").read_text())
    assert kept["step"] == best["step"] == summary["best_eval"]["step"] == evals[-1]["best_step"]
    assert kept["score"] == best["eval"]["score"] and (tmp_path / "run" / "best" / "model.safetensors").exists()
    assert set(summary["time_share"]) == {"target", "drafter_fwd", "drafter_bwd"}
    trained = trainer.objective.drafter.eval()
    tcfg = load_config(tiny_dir)
    for fmt, dtype in (("sglang", "float32"), ("vllm", "bfloat16")):
        out = tmp_path / fmt
        assert main(["export", "--drafter", str(tmp_path / "run"), "--target", str(tiny_dir), "--format", fmt,
                     "--out", str(out), "--dtype", dtype]) == 0
        raw = json.loads((out / "config.json").read_text())
        assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["draft_vocab_size"] == 200
        assert "final loss" in (out / "README.md").read_text()
        back = load_eagle3(out, tcfg, CPU, getattr(torch, dtype))
        want = _probe_eagle(trained.to(getattr(torch, dtype)))
        assert torch.equal(_probe_eagle(back), want)
        assert torch.equal(back.d2t, trained.d2t)
    capsys.readouterr()
    assert main(["export", "--drafter", str(tmp_path / "run"), "--target", str(tiny_dir), "--format", "dflash",
                 "--out", str(tmp_path / "x")]) == 2
    assert "--format sglang or vllm" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_dflash_export_round_trips(data_dir: Path, tiny_dir: Path, tmp_path: Path, kind: str) -> None:
    v2 = ("--conv-group-size", "16", "--selector-rank", "4", "--selector-top-k", "4") if kind == "dflash2" else ()
    a = _parse(kind, "--target", str(tiny_dir), "--data", str(data_dir), "--out", str(tmp_path / "run"),
               "--steps", "2", *SMALL, *DFLASH, *v2)
    trainer, summary = run_training(kind, a)
    if kind == "dflash2":
        assert summary["kind"] == "dflash2" and trainer.objective.drafter.candidate_selector is not None
    trained = trainer.objective.drafter.eval()
    assert main(["export", "--drafter", str(tmp_path / "run" / "drafter"), "--target", str(tiny_dir),
                 "--format", "dflash", "--out", str(tmp_path / "exp"), "--dtype", "float32"]) == 0
    back = load_dflash(tmp_path / "exp", load_config(tiny_dir), CPU, torch.float32)
    gen = torch.Generator().manual_seed(1)
    feats, noise = torch.randn(1, 6, 64, generator=gen), torch.randn(1, 4, 64, generator=gen)
    pos = torch.arange(10)[None]
    with torch.no_grad():
        got, want = (m(noise, pos[:, 6:], m.context_kv(feats, pos[:, :6])) for m in (back, trained))
    assert torch.equal(got, want)
    raw = json.loads((tmp_path / "exp" / "config.json").read_text())
    arch = "DFlash2DraftModel" if kind == "dflash2" else "DFlashDraftModel"
    assert raw["architectures"] == [arch] and raw["dflash_config"]["mask_token_id"] == 3
    assert np.isfinite(json.loads((tmp_path / "run" / "train_summary.json").read_text())["final_loss"])


def test_train_target_init_from_keeps_the_checkpoint_and_logs_the_loop_measure(
        tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`train-target --init-from`: starts from the checkpoint's weights (at a vanishing learning rate the result is
    the checkpoint), keeps its tokenizer and config, and logs the loop measure at each evaluation."""
    from specserve.cli import main as cli_main
    from specserve.train import corpus

    files = [p for p in corpus.stdlib_files() if p.name in ("textwrap.py", "shlex.py", "base64.py")]
    monkeypatch.setattr(corpus, "stdlib_files", lambda: files)
    monkeypatch.setattr(corpus, "is_validation", lambda p, fraction=0.02: p.name == "base64.py")
    out, work = tmp_path / "target", tmp_path / "work"
    args = ["train-target", "--init-from", str(tiny_dir), "--out", str(out), "--work", str(work),
            "--max-steps", "2", "--warmup-steps", "1", "--lr", "1e-12", "--seq-len", "32", "--batch-size", "2",
            "--eval-every", "2"]
    assert cli_main(args) == 0
    assert (out / "tokenizer.json").read_text() == (tiny_dir / "tokenizer.json").read_text()
    assert json.loads((out / "config.json").read_text()) == json.loads((tiny_dir / "config.json").read_text())
    want, got = load_file(str(tiny_dir / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert want.keys() == got.keys()
    for name, w in want.items():
        assert torch.allclose(got[name].float(), w.float(), atol=1e-2, rtol=1e-2), name
    (entry,) = [json.loads(line) for line in (work / "train_log.jsonl").read_text().splitlines()
                if "loop_greedy" in line]
    assert entry["step"] == 2 and 0.0 <= entry["loop_greedy"] <= 1.0
    assert cli_main([*args[:2], str(tmp_path / "missing"), *args[3:]]) != 0
    err = "".join(capsys.readouterr())
    assert "--init-from" in err and "no config.json" in err


def test_train_target_logs_the_loop_measure_at_every_evaluation(
        tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Evaluations between checkpoints measure loops too, on the weights of their own step."""
    from specserve.train import corpus, target

    files = [p for p in corpus.stdlib_files() if p.name in ("textwrap.py", "shlex.py", "base64.py")]
    monkeypatch.setattr(corpus, "stdlib_files", lambda: files)
    monkeypatch.setattr(corpus, "is_validation", lambda p, fraction=0.02: p.name == "base64.py")
    measure, measured = target.loop_measure, []

    def short_measure(checkpoint: Path) -> float:
        measured.append(checkpoint)
        return measure(checkpoint, max_new_tokens=8)

    monkeypatch.setattr(target, "loop_measure", short_measure)
    out, work = tmp_path / "target", tmp_path / "work"
    cfg = target.TargetTrainConfig(out=out, work=work, init_from=tiny_dir, max_steps=4, warmup_steps=1, lr=1e-12,
                                   seq_len=32, batch_size=2, eval_batches=1, eval_every=2, save_every=4)
    target.train(cfg)
    log = [json.loads(line) for line in (work / "train_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log if "loop_greedy" in e] == [e["step"] for e in log if "val_loss" in e] == [2, 4]
    assert measured == [work / "loop-eval", out]  # step 2: no checkpoint of its own, so a directory to decode from


def test_training_evaluation_measures_the_served_accept_length(tiny_dir: Path, tmp_path: Path) -> None:
    """The figure training logs and chooses checkpoints by is the engine's own accept length on those prompts:
    it equals what `LLM.generate` (the serving engine) measures, prompt by prompt, greedy."""
    from specserve.config import SpeculativeConfig
    from specserve.engine.llm import LLM
    from specserve.train.evaluate import AcceptanceEvaluator, EvalConfig
    from specserve.train.val_cuts import validation_cuts

    drafter = tmp_path / "eagle"
    init_random_eagle3(load_config(tiny_dir), drafter, seed=2)
    target, _, _ = load_model(str(tiny_dir), CPU, torch.float32)
    assert isinstance(target, CausalLM)
    cfg = EvalConfig(num_prompts=6, max_new_tokens=12, eagle_steps=3)
    evaluator = AcceptanceEvaluator("eagle3", target, tiny_dir, cfg)
    measured = evaluator.measure(drafter)
    tasks = validation_cuts(6)
    assert [r["kind"] for r in measured.rows] == [t.kind for t in tasks] == ["line_end", "after_newline",
                                                                            "mid_line"] * 2
    llm = LLM(tiny_dir, device="cpu", dtype="float32", enforce_eager=True,
              speculative=SpeculativeConfig.resolve("EAGLE3", str(drafter), num_steps=3, eagle_topk=1))
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    served = [llm.generate([ids], params)[0] for ids in evaluator.prompts]
    assert [r["accept_length"] for r in measured.rows] == [r.accept_length for r in served]
    assert measured.verify_steps == sum(len(r.accept_lengths) for r in served)
    figures = evaluator(drafter)
    assert figures["score"] == figures["headline_accept_length"] == min(figures["by_kind"].values())
    from specserve.bench.suites import load_suite
    from specserve.train.val_cuts import main as write_cuts

    assert write_cuts(["--count", "6", "--out", str(tmp_path / "val.jsonl")]) == 0  # the same contexts, as a suite
    assert load_suite(str(tmp_path / "val.jsonl")) == tasks

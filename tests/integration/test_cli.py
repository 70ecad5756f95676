"""`specserve generate`: JSON output, `--compile` (the eager tokens), one-line errors (no traceback) for bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specserve.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_json(capsys: pytest.CaptureFixture[str], tiny_dir: Path) -> None:
    code, out, _ = run(capsys, "generate", "--model", str(tiny_dir), "--prompt", "def f(x):",
                       "--max-new-tokens", "12", "--ignore-eos", "--json", "--device", "cpu")
    assert code == 0
    obj = json.loads(out)
    assert obj["num_tokens"] == 12 == len(obj["token_ids"])
    assert obj["tokens_per_s"] > 0 and isinstance(obj["text"], str)


def test_generate_speculates_adaptively_by_default(capsys: pytest.CaptureFixture[str], tiny_dir: Path,
                                                   tmp_path: Path) -> None:
    """As `serve`: the measured policy decides each step (a drafter that does not pay is not verified); the tokens
    are plain greedy's either way; --no-speculative-adaptive verifies every step; asked for with no drafter, an
    error naming the flag."""
    base = ["generate", "--model", str(tiny_dir), "--prompt", "def f(x):", "--max-new-tokens", "12", "--ignore-eos",
            "--json", "--device", "cpu", "--dtype", "float32"]
    code, plain, _ = run(capsys, *base)
    ngram = [*base, "--speculative-algorithm", "NGRAM", "--speculative-adaptive-profile", str(tmp_path / "p.json")]
    code1, adaptive, _ = run(capsys, *ngram)
    code2, forced, _ = run(capsys, *ngram, "--no-speculative-adaptive")
    assert code == code1 == code2 == 0
    assert json.loads(adaptive)["adaptive"] and not json.loads(forced)["adaptive"]
    assert json.loads(forced)["num_verify_steps"] > 0 and (tmp_path / "p.json").exists()
    assert json.loads(adaptive)["token_ids"] == json.loads(forced)["token_ids"] == json.loads(plain)["token_ids"]
    code3, _, err = run(capsys, *base, "--speculative-adaptive")
    _one_line_error(code3, err, "--speculative-adaptive")


def test_generate_compile_gives_the_eager_tokens(capsys: pytest.CaptureFixture[str], tiny_dir: Path) -> None:
    import torch

    argv = ["generate", "--model", str(tiny_dir), "--prompt", "def f(x):", "--max-new-tokens", "12", "--ignore-eos",
            "--json", "--device", "cpu", "--dtype", "float32"]
    code, eager, _ = run(capsys, *argv)
    torch._dynamo.utils.counters.clear()
    code2, compiled, _ = run(capsys, *argv, "--compile")
    assert code == code2 == 0
    assert json.loads(compiled)["token_ids"] == json.loads(eager)["token_ids"]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0  # --compile did compile the decode step


def _one_line_error(code: int, err: str, *needles: str) -> None:
    assert code != 0
    lines = [ln for ln in err.strip().splitlines() if ln]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], lines[0]


def test_bad_inputs(capsys: pytest.CaptureFixture[str], tiny_dir: Path, tmp_path: Path) -> None:
    code, _, err = run(capsys, "generate", "--model", str(tmp_path / "nope"), "--prompt", "x")
    _one_line_error(code, err, "does not exist")

    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run(capsys, "generate", "--model", str(empty), "--prompt", "x")
    _one_line_error(code, err, "config.json")

    trunc = tmp_path / "trunc"
    shutil.copytree(tiny_dir, trunc)
    weights = trunc / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    code, _, err = run(capsys, "generate", "--model", str(trunc), "--prompt", "x")
    _one_line_error(code, err, "model.safetensors", "truncated")

    arch = tmp_path / "arch"
    shutil.copytree(tiny_dir, arch)
    cfg = json.loads((arch / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (arch / "config.json").write_text(json.dumps(cfg))
    code, _, err = run(capsys, "generate", "--model", str(arch), "--prompt", "x")
    _one_line_error(code, err, "GPT2LMHeadModel", "not supported")

    code, _, err = run(capsys, "generate", "--model", str(tiny_dir), "--prompt", "x", "--max-new-tokens", "-1")
    _one_line_error(code, err, "--max-new-tokens")

    code, _, err = run(capsys, "generate", "--model", str(tiny_dir), "--prompt", "x",
                       "--speculative-algorithm", "NGRAM", "--speculative-tree", "ddtree")
    _one_line_error(code, err, "--speculative-tree ddtree", "DFLASH")


def test_console_script_exit_code(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("specserve")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "specserve.cli"]
    proc = subprocess.run([*cmd, "generate", "--model", str(tmp_path / "missing"), "--prompt", "x"],
                          capture_output=True, text=True, env={**os.environ}, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "does not exist" in proc.stderr

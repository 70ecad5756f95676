"""Training in chunks from a feature cache: the target runs once per sequence (a killed build resumes), the loss
equals the online one up to bf16 features, and `--max-minutes` chunks with bf16 checkpoints resume exactly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from specserve.models.llama import CausalLM
from specserve.models.loader import load_model
from specserve.train.cli import main
from specserve.train.data import load_data
from specserve.train.features import OnlineFeatures, build_feature_cache

CPU = torch.device("cpu")
PROMPTS = ["def add(a, b):\n", "class Stack:\n    def push(self, item):\n", "import os\n\n\ndef walk(path):\n",
           "def is_prime(n):\n", "for i in range(10):\n", "def reverse(items):\n"]
SMALL = ["--batch-size", "2", "--max-len", "40", "--device", "cpu", "--no-progress", "--log-every", "1"]
EAGLE = ["--ttt-steps", "3", "--draft-vocab-size", "200"]
DFLASH = ["--block-size", "4", "--anchors-per-seq", "6", "--num-layers", "1", "--soft-label-weight", "0.5"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("cache-data")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p, "name": f"src{i % 2}"}) + "\n"
                                                for i, p in enumerate(PROMPTS)))
    assert main(["prepare", "--target", str(tiny_dir), "--prompts", str(root / "prompts.jsonl"), "--out",
                 str(root / "data"), "--max-new-tokens", "12", "--batch-size", "3", "--shard-size", "3",
                 "--device", "cpu", "--dtype", "float32", "--enforce-eager"]) == 0
    return root / "data"


def test_cache_holds_the_targets_features_and_a_killed_build_resumes(data_dir: Path, tiny_dir: Path,
                                                                      tmp_path: Path) -> None:
    target, tcfg, tdir = load_model(str(tiny_dir), CPU, torch.float32)
    assert isinstance(target, CausalLM)
    data, _ = load_data([data_dir], tcfg.vocab_size, 40)
    assert [e.source for e in data] == [f"src{i % 2}" for i in range(len(PROMPTS))]
    capture = (1, 2)
    cache = build_feature_cache(tmp_path / "c", target, tdir, capture, data, 40, progress=False)
    batch = data[1:4]
    online, cached = OnlineFeatures(target, capture)(batch, CPU), cache(batch, CPU)
    for row, e in enumerate(batch):
        n = len(e.tokens)
        assert torch.equal(online.argmax[row, :n], cached.argmax[row, :n])
        for a, b in ((online.captured, cached.captured), (online.hidden, cached.hidden)):
            torch.testing.assert_close(a[row, :n], b[row, :n], rtol=1e-2, atol=1e-2)  # bf16, other batch shapes
    # a build killed after some sequences: the rest is computed on the next call, the same values result (to bf16
    # rounding: the batches are cut otherwise)
    done = np.load(tmp_path / "c" / "done.npy")
    done[2:] = False
    np.save(tmp_path / "c" / "done.npy", done)
    before = np.fromfile(tmp_path / "c" / "hidden.bin", dtype=np.int16).copy()
    hidden = np.memmap(tmp_path / "c" / "hidden.bin", dtype=np.int16, mode="r+").reshape(-1, tcfg.hidden_size)
    hidden[int(sum(len(e.tokens) for e in data[:2])):] = 0
    hidden.flush()
    del hidden
    build_feature_cache(tmp_path / "c", target, tdir, capture, data, 40, progress=False)
    def floats(bits: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(bits).view(torch.bfloat16).float()

    after = np.fromfile(tmp_path / "c" / "hidden.bin", dtype=np.int16)
    torch.testing.assert_close(floats(after), floats(before), rtol=1e-2, atol=1e-2)
    # data grown by new shards: the rows cached stay as they are, the new sequences are built
    grow = tmp_path / "g"
    build_feature_cache(grow, target, tdir, capture, data[:4], 40, progress=False)
    first = np.fromfile(grow / "hidden.bin", dtype=np.int16).copy()
    build_feature_cache(grow, target, tdir, capture, data, 40, progress=False)
    grown = np.fromfile(grow / "hidden.bin", dtype=np.int16)
    assert np.array_equal(grown[: len(first)], first) and len(grown) == len(before)
    torch.testing.assert_close(floats(grown), floats(before), rtol=1e-2, atol=1e-2)
    shuffled = [replace(e, index=i) for i, e in enumerate(reversed(data))]
    with pytest.raises(ValueError, match="built for other data"):
        build_feature_cache(grow, target, tdir, capture, shuffled, 40, progress=False)
    with pytest.raises(ValueError, match="built for other capture, max_len"):
        build_feature_cache(tmp_path / "c", target, tdir, (1,), data, 32, progress=False)


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_training_from_the_cache_learns_as_online(kind: str, data_dir: Path, tiny_dir: Path, tmp_path: Path) -> None:
    flags = EAGLE if kind == "eagle3" else DFLASH
    common = [kind, "--target", str(tiny_dir), "--data", str(data_dir), "--steps", "3", *SMALL, *flags]
    assert main([*common, "--out", str(tmp_path / "online")]) == 0
    assert main([*common, "--out", str(tmp_path / "cached"), "--feature-cache", str(tmp_path / "fc")]) == 0
    logs = [[json.loads(x) for x in (tmp_path / d / "train_log.jsonl").read_text().splitlines()]
            for d in ("online", "cached")]
    for a, b in zip(*logs, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-2)
    assert (tmp_path / "fc" / "meta.json").exists()


def test_chunks_with_bf16_checkpoints_resume_to_the_same_state(data_dir: Path, tiny_dir: Path,
                                                               tmp_path: Path) -> None:
    """--max-minutes stops after the first step of each chunk (every step is a checkpoint here, rounded to bf16
    in every run), so three chunks equal one uninterrupted run bit for bit."""
    def argv(out: str) -> list[str]:
        return [sys.executable, "-m", "specserve.train.cli", "eagle3", "--target", str(tiny_dir), "--data",
                str(data_dir), "--out", str(tmp_path / out), "--steps", "4", "--save-every", "1", "--lr", "3e-3",
                "--checkpoint-dtype", "bfloat16", "--feature-cache", str(tmp_path / "fc"), *SMALL, *EAGLE]

    subprocess.run(argv("full"), env=ENV, check=True, capture_output=True)
    chunk = ["--max-minutes", "1e-6"]
    subprocess.run([*argv("chunks"), *chunk], env=ENV, check=True, capture_output=True)
    summary = json.loads((tmp_path / "chunks" / "train_summary.json").read_text())
    assert summary["steps"] == 1 and not summary["finished"]
    subprocess.run([*argv("chunks"), *chunk, "--resume"], env=ENV, check=True, capture_output=True)
    assert json.loads((tmp_path / "chunks" / "train_summary.json").read_text())["steps"] == 2
    subprocess.run([*argv("chunks"), "--resume"], env=ENV, check=True, capture_output=True)
    full, chunks = (load_file(tmp_path / d / "drafter" / "model.safetensors") for d in ("full", "chunks"))
    assert full.keys() == chunks.keys() and all(torch.equal(full[k], chunks[k]) for k in full)
    state = torch.load(tmp_path / "chunks" / "checkpoint.pt", weights_only=False)
    assert {v.dtype for v in state["model"].values() if v.is_floating_point()} == {torch.bfloat16}
    moments = [v for s in state["optimizer"]["state"].values() for k, v in s.items() if k != "step"]
    assert moments and {v.dtype for v in moments} == {torch.bfloat16}

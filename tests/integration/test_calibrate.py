"""`specserve train calibrate`: a DFlash drafter's DDTree temperature picked on validation prompts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specserve.cli import main
from specserve.models.loader import load_model
from specserve.speculative.dflash.checkpoint import init_random_dflash, read_dflash_config
from specserve.train.calibrate import CalibrateConfig


def drafter_and_suite(tiny_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A random one-layer DFlash drafter for the tiny target, and a prompts file as `specserve.train.prompts`
    writes it (no names)."""
    _, cfg, _ = load_model(tiny_dir, torch.device("cpu"), torch.float32)
    drafter = tmp_path / "dflash"
    init_random_dflash(cfg, drafter, seed=3, num_hidden_layers=1)
    suite = tmp_path / "val.jsonl"
    suite.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("def add(a, b):", "for i in range(")))
    return drafter, suite


def test_calibrate_measures_the_grid_and_writes_the_best(tiny_dir: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    drafter, suite = drafter_and_suite(tiny_dir, tmp_path)
    weights = (drafter / "model.safetensors").read_bytes()
    args = ["train", "calibrate", "--drafter", str(drafter), "--target", str(tiny_dir), "--suite", str(suite),
            "--grid", "0.5", "1.0", "--max-new-tokens", "8", "--ddtree-budget", "4"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["accept_length"]) == {"0.5", "1.0"} and report["prompts"] == 2 and not report["written"]
    assert all(a >= 1.0 for a in report["accept_length"].values())
    assert read_dflash_config(drafter).tree_temperature == 1.0  # not written without --write
    assert main([*args, "--write"]) == 0
    report = json.loads(capsys.readouterr().out)
    best = report["best"]
    assert report["accept_length"][str(best)] == max(report["accept_length"].values())
    assert read_dflash_config(drafter).tree_temperature == best
    assert (drafter / "model.safetensors").read_bytes() == weights  # the weights are not touched


def test_calibrate_sample_temperature_on_sampled_decoding(tiny_dir: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """--temperature > 0 calibrates dflash_config.sample_temperature, averaged over --seeds sampled runs; the
    greedy tree temperature is left alone."""
    drafter, suite = drafter_and_suite(tiny_dir, tmp_path)
    assert main(["train", "calibrate", "--drafter", str(drafter), "--target", str(tiny_dir), "--suite", str(suite),
                 "--temperature", "0.9", "--seeds", "2", "--grid", "1.0", "1.5", "--max-new-tokens", "8",
                 "--ddtree-budget", "4", "--write"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["field"], report["temperature"], report["seeds"]) == ("sample_temperature", 0.9, 2)
    assert set(report["accept_length"]) == {"1.0", "1.5"}
    written = read_dflash_config(drafter)
    assert written.sample_temperature == report["best"] and written.tree_temperature == 1.0


@pytest.mark.parametrize(("field", "temperature"), [("sample_reveal", "0.9"), ("greedy_reveal", "0")])
def test_calibrate_reveal(tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str,
                          temperature: str) -> None:
    """--field sample_reveal | greedy_reveal measures how deep a sampled | greedy tree's first path is shown to the
    drafter (whole numbers), writes the best as a whole number and leaves the temperatures alone."""
    drafter, suite = drafter_and_suite(tiny_dir, tmp_path)
    assert main(["train", "calibrate", "--drafter", str(drafter), "--target", str(tiny_dir), "--suite", str(suite),
                 "--temperature", temperature, "--field", field, "--grid", "0", "2", "--max-new-tokens", "8",
                 "--ddtree-budget", "6", "--write"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["field"] == field and set(report["accept_length"]) == {"0", "2"}
    written = read_dflash_config(drafter)
    assert getattr(written, field) == report["best"] and isinstance(report["best"], int)
    assert (written.sample_temperature, written.tree_temperature) == (1.0, 1.0)


def test_calibrate_refuses_evaluation_suites_and_bad_grids(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not an evaluation suite"):
        CalibrateConfig(drafter=tmp_path, suite="heldout-code")
    with pytest.raises(ValueError, match="--grid"):
        CalibrateConfig(drafter=tmp_path, suite="val.jsonl", grid=(0.0, 1.0))
    with pytest.raises(ValueError, match="whole numbers"):
        CalibrateConfig(drafter=tmp_path, suite="val.jsonl", temperature=0.7, field="sample_reveal", grid=(1.5,))
    with pytest.raises(ValueError, match="--temperature > 0"):
        CalibrateConfig(drafter=tmp_path, suite="val.jsonl", field="sample_reveal", grid=(1.0,))
    with pytest.raises(ValueError, match="--temperature 0"):
        CalibrateConfig(drafter=tmp_path, suite="val.jsonl", temperature=0.7, field="greedy_reveal", grid=(1.0,))
    with pytest.raises(ValueError, match="--seeds"):
        CalibrateConfig(drafter=tmp_path, suite="val.jsonl", temperature=0.7, seeds=0)

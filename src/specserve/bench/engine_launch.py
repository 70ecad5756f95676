"""How `bench tune --engine sglang|vllm` starts another engine's server: the launcher, its version, the commands
of the grid's configurations, the health wait and the stop.

Launcher (`--launcher PREFIX`): words put before the engine's command, e.g. `/opt/sglang/bin/python` (a venv's
interpreter replaces `python` of `python -m sglang.launch_server`), `/opt/vllm/bin/vllm` (replaces `vllm` of
`vllm serve`), `docker run --rm --gpus all --network host IMAGE` or `ssh gpu-host` (put before the whole command).
The version is asked of the same launcher (`PREFIX python -c "import sglang; print(sglang.__version__)"`,
`PREFIX vllm --version`) unless `--engine-version` gives it. Commands come from the deploy engine maps and the
version rules (`specserve.deploy.engine_plan`, in a child process: bench sits below deploy). Each server runs in
its own process group, so a wrapper's children (SGLang's scheduler processes, docker) stop with it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx

from specserve.config import SpeculativeConfig

ENGINES = ("specserve", "sglang", "vllm")
COMMANDS = {"sglang": ("python", "-m", "sglang.launch_server"), "vllm": ("vllm", "serve")}
VERSION_PROBES = {"sglang": ("python", "-c", "import sglang; print(sglang.__version__)"), "vllm": ("vllm", "--version")}
#: grid keys each engine has a flag for, per algorithm (the rest are specserve's own)
ENGINE_KEYS: dict[str, dict[str, tuple[str, ...]]] = {
    "sglang": {"EAGLE3": ("steps", "topk", "draft", "path"), "STANDALONE": ("steps", "topk", "draft", "path"),
               "DFLASH": ("block", "draft", "path", "tree"), "NGRAM": ("draft",)},
    "vllm": {"EAGLE3": ("steps", "topk", "path"), "STANDALONE": ("steps", "path"), "DFLASH": ("block", "path", "tree"),
             "NGRAM": ("steps",)},
}
FIXES = {("sglang", "NGRAM", "steps"): "SGLang's NGRAM takes its depth from the trie; vary draft instead",
         ("vllm", "EAGLE3", "draft"): "vLLM verifies num_speculative_tokens + 1 = steps + 1; vary steps instead",
         ("vllm", "STANDALONE", "draft"): "vLLM verifies num_speculative_tokens + 1 = steps + 1; vary steps instead",
         ("vllm", "NGRAM", "draft"): "vLLM's ngram drafts num_speculative_tokens = steps; vary steps instead",
         ("vllm", "STANDALONE", "topk"): "vLLM's draft_model drafts a chain; drop topk"}


def check_grid_keys(engine: str, entries: Sequence[tuple[str, Sequence[str]]]) -> None:
    """ValueError naming the fix for a grid key `engine` has no flag for. `entries`: (algorithm, keys)."""
    if engine == "specserve":
        return
    for algorithm, keys in entries:
        if algorithm == "NONE":
            continue
        have = ENGINE_KEYS[engine].get(algorithm)
        if have is None:
            raise ValueError(f"--grid {algorithm}: {engine} has no {algorithm}; drop it or use --engine specserve")
        for key in keys:
            if key not in have:
                fix = FIXES.get((engine, algorithm, key), f"drop {key}= or use --engine specserve")
                raise ValueError(f"--grid {algorithm}:{key}=...: {engine} has no flag for {key}; {fix}")


def launcher_words(engine: str, prefix: str | None) -> list[str]:
    """The engine's launch words after `prefix` (an interpreter or binary at its end replaces the default one)."""
    base = list(COMMANDS[engine])
    words = shlex.split(prefix) if prefix else []
    if words and os.path.basename(words[-1]).startswith(base[0]):
        return [*words, *base[1:]]
    return [*words, *base]


def _probe_words(engine: str, prefix: str | None) -> list[str]:
    probe = list(VERSION_PROBES[engine])
    words = shlex.split(prefix) if prefix else []
    if words and os.path.basename(words[-1]).startswith(probe[0]):
        return [*words, *probe[1:]]
    return [*words, *probe]


def detect_version(engine: str, prefix: str | None, timeout_s: float = 60.0) -> tuple[str | None, str]:
    """(version or None, what was run and what it said)."""
    cmd = _probe_words(engine, prefix)
    shown = shlex.join(cmd)
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return None, f"`{shown}`: {cmd[0]} not found"
    except subprocess.TimeoutExpired:
        return None, f"`{shown}` did not answer within {timeout_s:g} s"
    words = done.stdout.split()
    if done.returncode != 0 or not words or not words[-1][:1].isdigit():
        said = (done.stderr.strip().splitlines() or done.stdout.strip().splitlines() or ["nothing"])[-1]
        return None, f"`{shown}` exited with code {done.returncode}: {said}"
    return words[-1], f"`{shown}` said {words[-1]}"


def plan_commands(engine: str, version: str | None, model: str, candidates: Sequence[tuple[str, SpeculativeConfig]],
                  host: str, page_size: int, adaptive: bool) -> list[dict[str, Any]]:
    """Per candidate {"name", "argv" (port 0), "env", "notes", "skip"} from `specserve.deploy.engine_plan`."""
    request = {"engine": engine, "version": version, "model": model, "host": host, "page_size": page_size,
               "adaptive": adaptive, "candidates": [{"name": n, "speculative": asdict(s)} for n, s in candidates]}
    done = subprocess.run([sys.executable, "-m", "specserve.deploy.engine_plan"], input=json.dumps(request),
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise ValueError((done.stderr.strip().splitlines() or [f"engine_plan exited with {done.returncode}"])[-1]
                         .removeprefix("error: "))
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def with_launcher(argv: Sequence[str], engine: str, words: Sequence[str]) -> list[str]:
    """A planned argv (the engine's default launcher words) with `words` as its launcher."""
    return [*words, *argv[len(COMMANDS[engine]):]]


def with_port(argv: Sequence[str], port: int) -> list[str]:
    out = list(argv)
    i = out.index("--port")
    out[i + 1] = str(port)
    return out


def start_engine(argv: Sequence[str], env: dict[str, str], url: str, log: Path,
                 timeout_s: float) -> subprocess.Popen[bytes]:
    """The server process once GET url/health answers 200; RuntimeError (the process group stopped) otherwise."""
    with log.open("wb") as out:
        try:
            proc = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, **env}, start_new_session=True)
        except OSError as e:
            raise RuntimeError(f"cannot start {argv[0]}: {e.strerror}") from None
    return wait_healthy(proc, url, timeout_s, stop_engine)


def wait_healthy(proc: subprocess.Popen[bytes], url: str, timeout_s: float,
                 stop: Callable[..., None]) -> subprocess.Popen[bytes]:
    """Poll `url`/health until it answers 200; the process stopped (with `stop`) and RuntimeError when it exits
    first or `timeout_s` passes (or on Ctrl-C: no server is left behind)."""
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with code {proc.returncode} before /health answered")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                    return proc
            time.sleep(0.25)
    except BaseException:
        stop(proc, grace_s=0.0)
        raise
    stop(proc, grace_s=0.0)
    raise RuntimeError(f"server did not answer /health within {timeout_s:g} s (--server-timeout)")


def stop_engine(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """SIGTERM to the server's process group, SIGKILL after `grace_s`."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM if grace_s > 0 else signal.SIGKILL)
    try:
        proc.wait(timeout=max(grace_s, 1.0))
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

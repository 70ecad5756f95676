"""Server start-up: seconds from `specserve serve` to its first chat answer, on an empty cache and again.

    python benchmarks/startup.py --model smollm2 -- --speculative-algorithm NGRAM

Starts the server twice with the flags after `--`. The first start gets an empty cache: a new
`XDG_CACHE_HOME` (the GGUF's checkpoint directory, the adaptive cost profile) and a new
`TORCHINDUCTOR_CACHE_DIR` (compiled steps), as on a fresh machine after `scripts/setup.sh`; the kernels'
extension, which setup builds, is kept. The second start reuses both caches. Per start: seconds until `/health`
answers 200, until the first chat completion (16 tokens) comes back, and until the compiled steps and the
adaptive profile are ready (`compiled_s`: by default they are built in the background while the server answers
eager; with `--no-background-compile` the server listens only once they are). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from torch.utils.cpp_extension import get_default_build_root

from specserve.bench.machine import cpu_info


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_once(model: str, flags: list[str], env: dict[str, str], log: Path, timeout: float) -> dict[str, Any]:
    port = free_port()
    cmd = [sys.executable, "-m", "specserve.server.cli", "--model", model, *flags, "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        ready = None
        while time.perf_counter() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    ready = time.perf_counter() - t0
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        if ready is None:
            raise RuntimeError(f"not healthy within {timeout} s: {log.read_text()[-2000:]}")
        body = {"model": model, "messages": [{"role": "user", "content": "Write a Python function that adds two "
                                              "numbers."}], "max_tokens": 16, "temperature": 0}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)
        answered = time.perf_counter() - t0
        r.raise_for_status()
        while (info := httpx.get(url + "/server_info", timeout=10).json()).get("compiling") or \
                info.get("adaptive_profile_due"):  # a background warm-up (the default): until it is done
            if time.perf_counter() - t0 > timeout:
                raise RuntimeError(f"still compiling after {timeout} s: {log.read_text()[-2000:]}")
            time.sleep(0.5)
        compiled = time.perf_counter() - t0
    finally:
        proc.kill()
        proc.wait()
    return {"ready_s": round(ready, 1), "first_answer_s": round(answered, 1), "compiled_s": round(compiled, 1),
            "compiled_buckets": info.get("compiled_buckets"), "compiled_drafting": info.get("compiled_drafting"),
            "log_tail": [line for line in log.read_text(errors="replace").splitlines() if "ready on" in line][-1:]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--timeout", type=float, default=1200.0)
    ap.add_argument("--logs", default=None, metavar="DIR", help="keep the two servers' logs here")
    ap.add_argument("flags", nargs="*", help="server flags (after `--`)")
    a = ap.parse_args()
    ext = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()  # before XDG_CACHE_HOME moves
    runs: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "XDG_CACHE_HOME": str(Path(tmp) / "cache"),
               "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "inductor"), "TORCH_EXTENSIONS_DIR": ext}
        for name in ("fresh", "second"):
            runs[name] = start_once(a.model, a.flags, env, Path(tmp) / f"{name}.log", a.timeout)
            print(f"{name}: {runs[name]['first_answer_s']} s", file=sys.stderr)
            if a.logs:
                Path(a.logs).mkdir(parents=True, exist_ok=True)
                shutil.copy(Path(tmp) / f"{name}.log", Path(a.logs) / f"{name}.log")
    print(json.dumps({"benchmark": "startup", "model": a.model, "server_flags": a.flags, "command_line": sys.argv,
                      "cpu": cpu_info(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                      "runs": runs}, indent=2))


if __name__ == "__main__":
    main()

"""Issue 27: SGLang's `bench_serving` and `specserve bench serving` against one speculative server, side by side.

    .venv/bin/python benchmarks/sglang_client.py --rounds 2

1. Builds a throw-away venv (`--venv`, default /tmp/specserve-sglang-venv; reused when it already runs SGLang's
   client) with `sglang` installed `--no-deps` plus only what `sglang.benchmark.serving` imports at run time
   (SGLANG_RUNTIME_PACKAGES below). No torch, no triton: `sglang/__init__.py` and `sglang.srt.utils` import
   torch/triton eagerly, so the client is started through a small shim that registers those packages as bare
   namespaces (their `__init__` is not run) and stubs `sglang.srt.disaggregation.utils`, of which the client
   needs one string constant. The code that runs is SGLang's own `sglang.benchmark.serving.cli_main`, which is
   what `python -m sglang.bench_serving` re-exports.
2. Starts one real `specserve serve --model demo --speculative-algorithm NGRAM --no-speculative-adaptive`.
3. Runs R rounds, order alternating (SGLang first in odd rounds), of SGLang's client (`--backend sglang-oai`,
   i.e. streamed /v1/completions; output tokens counted by re-tokenizing each chunk with `--tokenizer`, the demo
   checkpoint) and `specserve bench serving` (its `--tokenizer` set to the same checkpoint), both on the same 32
   prompts at the same concurrency and output length, both with ignore_eos.
   SGLang's `--dataset-name random` samples text from ShareGPT, which it downloads from Hugging Face; that is not
   reachable here, so both clients read one prompts set (specserve's built-in coding prompts), written once as
   a ShareGPT-format JSON for SGLang (`--dataset-name sharegpt --sharegpt-output-len N`) and a JSONL for specserve.
4. Prints one JSON object: per round and client median ITL, median TPOT and output tok/s, taken from the
   programs' own outputs (SGLang's `--output-file` JSONL, falling back to its printed summary; specserve's
   `--out` run JSON), and the ratios specserve/SGLang.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DEMO_CHECKPOINT = REPO / "src" / "specserve" / "assets" / "models" / "demo"
SGLANG_SPEC = "sglang==0.5.23"  # the version this script was written against (`--sglang-spec` overrides)
# found by running the client and installing what it failed to import, one at a time
SGLANG_RUNTIME_PACKAGES = (
    "aiohttp", "numpy", "requests", "tqdm", "transformers", "msgspec", "orjson", "pybase64",
    "psutil", "pyzmq",  # sglang.srt.utils.network (resolve_base_url)
    "pillow",  # sglang.benchmark.datasets.image
    "datasets",  # sglang.benchmark.datasets.mmmu
)

SHIM = '''"""Run sglang.benchmark.serving.cli_main without executing sglang/__init__.py (which imports torch/triton)."""
import importlib.util
import sys
import types

root = importlib.util.find_spec("sglang").submodule_search_locations[0]
for name, sub in (("sglang", ""), ("sglang.srt", "/srt"), ("sglang.srt.utils", "/srt/utils"),
                  ("sglang.srt.disaggregation", "/srt/disaggregation")):
    mod = types.ModuleType(name)
    mod.__path__ = [root + sub]
    sys.modules[name] = mod
stub = types.ModuleType("sglang.srt.disaggregation.utils")
stub.FAKE_BOOTSTRAP_HOST = "2.2.2.2"  # the one name sglang.benchmark.serving takes from it (torch-heavy module)
sys.modules[stub.__name__] = stub

from sglang.benchmark.serving import cli_main  # noqa: E402

if __name__ == "__main__":
    cli_main()
'''

# SGLang's printed summary lines -> the keys its --output-file JSONL uses
SUMMARY_LINES = {
    "median_itl_ms": r"Median ITL \(ms\):\s+([\d.]+)",
    "median_tpot_ms": r"Median TPOT \(ms\):\s+([\d.]+)",
    "output_throughput": r"Output token throughput \(tok/s\):\s+([\d.]+)",
}


def log(msg: str) -> None:
    print(f"[sglang_client] {msg}", file=sys.stderr, flush=True)


def run_logged(cmd: list[str], log_path: Path, env: dict[str, str] | None = None, timeout: float = 1800) -> int:
    with log_path.open("wb") as out:
        return subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def write_shim(workdir: Path) -> Path:
    shim = workdir / "run_sglang_bench_serving.py"
    shim.write_text(SHIM)
    return shim


def client_runs(venv: Path, shim: Path) -> bool:
    py = venv_python(venv)
    if not py.exists():
        return False
    proc = subprocess.run([str(py), str(shim), "--help"], capture_output=True, timeout=300)
    return proc.returncode == 0


def ensure_venv(venv: Path, shim: Path, sglang_spec: str, workdir: Path) -> list[str]:
    """Create/reuse the venv; return `pip freeze` of it. Raises RuntimeError with the failing command and output."""
    if client_runs(venv, shim):
        log(f"reusing {venv}")
    else:
        steps = [
            [sys.executable, "-m", "venv", str(venv)],
            [str(venv_python(venv)), "-m", "pip", "install", "-q", "--no-deps", sglang_spec],
            [str(venv_python(venv)), "-m", "pip", "install", "-q", *SGLANG_RUNTIME_PACKAGES],
        ]
        if not venv_python(venv).exists():
            shutil.rmtree(venv, ignore_errors=True)
        else:
            steps = steps[1:]
        for i, cmd in enumerate(steps):
            log("+ " + " ".join(cmd))
            lp = workdir / f"install_{i}.log"
            if run_logged(cmd, lp) != 0:
                raise RuntimeError(f"install failed: {' '.join(cmd)}\n{lp.read_text(errors='replace')[-3000:]}")
        proc = subprocess.run([str(venv_python(venv)), str(shim), "--help"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"SGLang's client does not start: {venv_python(venv)} {shim} --help\n"
                               f"{(proc.stdout + proc.stderr)[-3000:]}")
    freeze = subprocess.run([str(venv_python(venv)), "-m", "pip", "freeze"], capture_output=True, text=True)
    return sorted(line for line in freeze.stdout.splitlines() if line.strip())


def write_prompts(workdir: Path, num_prompts: int, output_len: int) -> tuple[Path, Path]:
    sys.path.insert(0, str(REPO / "src"))
    from specserve.bench.prompts import CODING_PROMPTS

    texts = []
    for i in range(num_prompts):
        base = CODING_PROMPTS[i % len(CODING_PROMPTS)]
        rep = i // len(CODING_PROMPTS)
        texts.append(base if rep == 0 else f"{base} Variant {rep}: add type hints and a docstring.")
    jsonl = workdir / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    sharegpt = workdir / "prompts_sharegpt.json"
    # the "gpt" turn only matters when --sharegpt-output-len is unset (it is set); keep it long enough to pass filters
    sharegpt.write_text(json.dumps([
        {"id": str(i), "conversations": [{"from": "human", "value": t}, {"from": "gpt", "value": "ok " * output_len}]}
        for i, t in enumerate(texts)]))
    return jsonl, sharegpt


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(port: int, workdir: Path, timeout: float = 300) -> subprocess.Popen[bytes]:
    exe = Path(sys.executable).with_name("specserve")
    cmd = [str(exe), "serve"] if exe.exists() else [sys.executable, "-m", "specserve.cli", "serve"]
    cmd += ["--model", "demo", "--speculative-algorithm", "NGRAM", "--no-speculative-adaptive",
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    log("+ " + " ".join(cmd))
    log_path = workdir / "server.log"
    with log_path.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log_path.read_text(errors='replace')[-3000:]}")
        with contextlib.suppress(OSError), urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            if r.status == 200:
                return proc
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"server not healthy within {timeout} s:\n{log_path.read_text(errors='replace')[-3000:]}")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_sglang(args: argparse.Namespace, ctx: dict[str, Any], tag: str) -> dict[str, Any]:
    out_file = ctx["workdir"] / f"sglang_{tag}.jsonl"
    out_file.unlink(missing_ok=True)  # SGLang appends to --output-file
    log_path = ctx["workdir"] / f"sglang_{tag}.log"
    cmd = [str(venv_python(ctx["venv"])), str(ctx["shim"]), "--backend", args.sglang_backend,
           "--base-url", ctx["base_url"], "--model", ctx["model"], "--tokenizer", str(DEMO_CHECKPOINT),
           "--dataset-name", "sharegpt", "--dataset-path", str(ctx["sharegpt"]),
           "--sharegpt-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
           "--max-concurrency", str(args.concurrency), "--request-rate", "inf", "--temperature", "0",
           "--warmup-requests", "1", "--disable-tqdm", "--output-file", str(out_file)]
    # offline: otherwise transformers retries huggingface.co for the served name ('demo') for ~50 s
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    t0 = time.monotonic()
    rc = run_logged(cmd, log_path, env=env)
    res: dict[str, Any] = {"rc": rc, "wall_s": round(time.monotonic() - t0, 2), "log": str(log_path)}
    text = log_path.read_text(errors="replace")
    if rc != 0:
        raise RuntimeError(f"SGLang client failed (rc {rc}): {' '.join(cmd)}\n{text[-3000:]}")
    src: dict[str, Any] = {}
    if out_file.exists() and out_file.read_text().strip():
        src = json.loads(out_file.read_text().strip().splitlines()[-1])
        res["source"] = str(out_file)
    else:
        res["source"] = f"{log_path} (printed summary)"
    for key, pattern in SUMMARY_LINES.items():
        m = re.search(pattern, text)
        printed = float(m.group(1)) if m else None
        res[key] = src.get(key, printed)
    res["completed"] = src.get("completed")
    res["total_output_tokens"] = src.get("total_output_tokens")
    res["total_output_tokens_retokenized"] = src.get("total_output_tokens_retokenized")
    res["accept_length"] = src.get("accept_length")
    res["command"] = cmd
    return res


def run_specserve(args: argparse.Namespace, ctx: dict[str, Any], tag: str) -> dict[str, Any]:
    out_file = ctx["workdir"] / f"specserve_{tag}.json"
    log_path = ctx["workdir"] / f"specserve_{tag}.log"
    exe = Path(sys.executable).with_name("specserve")
    cmd = [str(exe), "bench", "serving"] if exe.exists() else [sys.executable, "-m", "specserve.cli", "bench",
                                                                  "serving"]
    cmd += ["--base-url", ctx["base_url"], "--model", ctx["model"], "--concurrency", str(args.concurrency),
            "--num-prompts", str(args.num_prompts), "--output-len", str(args.output_len),
            "--dataset", str(ctx["jsonl"]), "--tokenizer", str(DEMO_CHECKPOINT), "--ignore-eos",
            "--temperature", "0", "--no-progress", "--out", str(out_file)]
    t0 = time.monotonic()
    rc = run_logged(cmd, log_path)
    res: dict[str, Any] = {"rc": rc, "wall_s": round(time.monotonic() - t0, 2), "log": str(log_path)}
    if rc != 0 or not out_file.exists():
        raise RuntimeError(f"specserve client failed (rc {rc}): {' '.join(cmd)}\n"
                           f"{log_path.read_text(errors='replace')[-3000:]}")
    run = json.loads(out_file.read_text())
    level = run["levels"][0]
    res.update(source=str(out_file), median_itl_ms=level["itl_ms"]["p50"], median_tpot_ms=level["tpot_ms"]["p50"],
               output_throughput=level["output_throughput"], completed=level["completed"],
               total_output_tokens=level["total_output_tokens"], token_counts=level.get("token_counts"),
               accept_length=level.get("accept_length"), ignore_eos_applied=run.get("warmup", {}).get(
                   "ignore_eos_applied"), command=cmd)
    return res


METRICS = ("median_itl_ms", "median_tpot_ms", "output_throughput")


def ratios(spec: dict[str, Any], sgl: dict[str, Any]) -> dict[str, float | None]:
    return {k: (round(spec[k] / sgl[k], 3) if spec.get(k) is not None and sgl.get(k) else None) for k in METRICS}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--venv", type=Path, default=Path("/tmp/specserve-sglang-venv"))
    p.add_argument("--workdir", type=Path, default=None, help="logs and outputs (default: a new /tmp dir)")
    p.add_argument("--sglang-spec", default=SGLANG_SPEC, help="pip requirement for sglang (installed --no-deps)")
    p.add_argument("--sglang-backend", default="sglang-oai", help="SGLang client --backend (OpenAI /v1/completions)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--port", type=int, default=0, help="server port (default: a free one)")
    p.add_argument("--json-out", type=Path, default=None, help="also write the result JSON here")
    args = p.parse_args(argv)

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="sglang_client_", dir="/tmp"))
    workdir.mkdir(parents=True, exist_ok=True)
    shim = write_shim(workdir)
    result: dict[str, Any] = {"workdir": str(workdir)}
    try:
        result["installed"] = ensure_venv(args.venv, shim, args.sglang_spec, workdir)
    except RuntimeError as e:
        result["error"] = str(e)
        print(json.dumps(result, indent=2))
        return 1
    jsonl, sharegpt = write_prompts(workdir, args.num_prompts, args.output_len)
    port = args.port or free_port()
    ctx = {"venv": args.venv, "shim": shim, "workdir": workdir, "jsonl": jsonl, "sharegpt": sharegpt,
           "base_url": f"http://127.0.0.1:{port}", "model": "demo"}
    server = start_server(port, workdir)
    rounds: list[dict[str, Any]] = []
    try:
        with urllib.request.urlopen(ctx["base_url"] + "/v1/models", timeout=10) as r:
            ctx["model"] = json.load(r)["data"][0]["id"]
        for i in range(args.rounds):
            order = ["sglang", "specserve"] if i % 2 == 0 else ["specserve", "sglang"]
            entry: dict[str, Any] = {"round": i + 1, "order": order}
            for client in order:
                log(f"round {i + 1}: {client}")
                fn = run_sglang if client == "sglang" else run_specserve
                entry[client] = fn(args, ctx, f"r{i + 1}")
            entry["specserve_over_sglang"] = ratios(entry["specserve"], entry["sglang"])
            rounds.append(entry)
    except RuntimeError as e:
        result["error"] = str(e)
    finally:
        stop_server(server)

    result["setup"] = {
        "server": f"specserve serve --model demo --speculative-algorithm NGRAM --no-speculative-adaptive --port {port}",
        "model": ctx["model"], "tokenizer": str(DEMO_CHECKPOINT), "num_prompts": args.num_prompts,
        "concurrency": args.concurrency, "output_len": args.output_len, "sglang_backend": args.sglang_backend,
        "prompts": "specserve's coding prompts, same texts for both clients (SGLang: sharegpt-format file)",
        "sglang_entry": "sglang.benchmark.serving.cli_main via a shim (sglang/__init__ not run: it imports torch)",
    }
    result["rounds"] = [
        {"round": r["round"], "order": r["order"],
         **{c: {k: r[c][k] for k in METRICS} for c in ("sglang", "specserve")},
         "specserve_over_sglang": r["specserve_over_sglang"]} for r in rounds]
    if rounds:
        result["median_over_rounds"] = {
            c: {k: statistics.median(r[c][k] for r in rounds) for k in METRICS} for c in ("sglang", "specserve")}
        result["median_over_rounds"]["specserve_over_sglang"] = ratios(
            result["median_over_rounds"]["specserve"], result["median_over_rounds"]["sglang"])
    result["details"] = rounds
    text = json.dumps(result, indent=2)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    print(text)
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())

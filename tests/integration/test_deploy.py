"""`specserve deploy`: freeze (production.md, systemd unit, pinned serve.yaml), install, status, export.

systemd does not run in the test container, but `systemd-analyze verify` does: it parses the unit, checks
every key and value and that the ExecStart/ExecStartPost binaries exist and are executable. It exits 0 on
unknown keys (it only logs them), so `analyze_unit` counts every line about the file as a problem; a broken
unit shows that the check fails when it should.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from server_util import free_port
from specserve.bench.cli import main as bench_main
from specserve.config import SpeculativeConfig
from specserve.deploy.cli import main as deploy_main
from specserve.deploy.engine_map import build_command
from specserve.deploy.export import EngineExportConfig, export_engine
from specserve.deploy.freeze import FreezeConfig, freeze, load_serve_config
from specserve.deploy.health import wait_healthy
from specserve.deploy.install import format_status, install, plan_install, status
from specserve.deploy.known_flags import check_command, load_engine_flags, missing_fields
from specserve.deploy.systemd import analyze_unit, exec_line
from specserve.models.loader import load_config
from specserve.server.serve_config import ServeConfig
from specserve.speculative.dflash.checkpoint import init_random_dflash
from specserve.speculative.eagle3.checkpoint import init_random_eagle3

needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")


def write_yaml(path: Path, **entries: Any) -> Path:
    path.write_text(yaml.safe_dump({k.replace("_", "-"): v for k, v in entries.items()}))
    return path


def level(c: int, tok_s: float, ttft: float, tpot: float, accept: float | None, errors: int = 0) -> dict[str, Any]:
    return {"concurrency": c, "num_requests": 8, "completed": 8 - errors, "errors": errors,
            "output_throughput": tok_s, "ttft_ms": {"mean": ttft, "p50": ttft}, "tpot_ms": {"mean": tpot, "p50": tpot},
            "accept_length": accept}


def serving_json(path: Path, speculative: dict[str, Any], levels: list[dict[str, Any]]) -> Path:
    run = {"kind": "serving", "config": {"model": "tiny", "num_prompts": 8, "output_len": 64, "temperature": 0.0},
           "dataset": {"name": "coding"}, "server": {"source": "server_info",
                                                     "info": {"speculative": speculative, "device": "cpu"}},
           "levels": levels}
    path.write_text(json.dumps(run))
    return path


@pytest.fixture
def ngram_yaml(tmp_path: Path, tiny_dir: Path) -> Path:
    return write_yaml(tmp_path / "serve.yaml", model=str(tiny_dir), speculative_algorithm="NGRAM", port=30123,
                      api_key="s3cret", device="cpu")


# `specserve serve` engine flags (serve.yaml keys), two ways away from their defaults
ENGINE_A: dict[str, Any] = {  # a pool in blocks, a host tier, no overlap, deterministic, a saved cost profile
    "max_num_seqs": 8, "max_num_batched_tokens": 96, "kv_block_size": 32, "num_kv_blocks": 40,
    "enable_hierarchical_cache": True, "hicache_size": 2.5, "disable_overlap_schedule": True,
    "enable_deterministic_inference": True, "speculative_adaptive_profile": "PROFILE"}
ENGINE_B: dict[str, Any] = {  # a pool in GiB, no prefix cache, a fixed draft width, a step budget below the batch
    "max_num_seqs": 8, "max_num_batched_tokens": 4, "kv_cache_gb": 3.0, "disable_radix_cache": True,
    "speculative_adaptive": False}
NEW_FLAGS = {"--max-num-seqs", "--max-num-batched-tokens", "--kv-block-size", "--kv-cache-gb", "--disable-radix-cache",
             "--enable-hierarchical-cache", "--disable-overlap-schedule", "--enable-deterministic-inference",
             "--speculative-adaptive"}


def engine_entries(settings: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    profile = str(tmp_path / "adaptive-profile.json")
    return {k: profile if v == "PROFILE" else v for k, v in settings.items()}


@needs_analyze
@pytest.mark.parametrize("settings", [{}, ENGINE_A, ENGINE_B], ids=["defaults", "engine-a", "engine-b"])
def test_freeze_unit_passes_systemd_analyze_and_pins_the_config(tmp_path: Path, ngram_yaml: Path,
                                                                settings: dict[str, Any]) -> None:
    entries = engine_entries(settings, tmp_path)
    source_entries = {k.replace("-", "_"): v for k, v in yaml.safe_load(ngram_yaml.read_text()).items()}
    write_yaml(ngram_yaml, **source_entries, **entries)
    out = tmp_path / "deploy"
    facts = freeze(FreezeConfig(config=ngram_yaml, out=out))
    unit = out / "specserve.service"
    assert analyze_unit(unit) == []
    broken = tmp_path / "broken.service"
    broken.write_text(unit.read_text().replace("Restart=on-failure", "Restart=sometimes"))
    assert analyze_unit(broken), "systemd-analyze must reject an invalid Restart= value"

    text = unit.read_text()
    for line in ("After=network-online.target", "Wants=network-online.target", "Restart=on-failure",
                 "RestartSec=10", "StartLimitBurst=5", "WantedBy=multi-user.target", "User=specserve",
                 "LimitNOFILE=65536", f"EnvironmentFile={out.resolve()}/specserve.env", "TimeoutStopSec=45",
                 f"ExecStart={facts['exec_start']}", "CacheDirectory=specserve",
                 "Environment=XDG_CACHE_HOME=/var/cache/specserve"):
        assert line in text.splitlines(), line
    assert "-m specserve.deploy.health --url http://127.0.0.1:30123/health" in text
    assert facts["command"][-2:] == ["--api-key", "${SPECSERVE_API_KEY}"]
    # The key lives only in the root-only environment file.
    env = out / "specserve.env"
    assert stat.S_IMODE(env.stat().st_mode) == 0o600 and "SPECSERVE_API_KEY=s3cret" in env.read_text()
    assert all("s3cret" not in (out / f).read_text() for f in ("serve.yaml", "production.md", "specserve.service"))
    # The frozen file reproduces the source configuration with every flag explicit.
    source, frozen = load_serve_config(ngram_yaml), load_serve_config(out / "serve.yaml")
    assert frozen == replace(source, api_key=None, model=str(Path(source.model).resolve()))
    frozen_yaml = yaml.safe_load((out / "serve.yaml").read_text())
    assert set(frozen_yaml["model-sha256"]) >= {"config.json", "model.safetensors"}
    for key in ("max-num-seqs", "max-num-batched-tokens", "kv-block-size", "num-kv-blocks", "kv-cache-gb",
                "disable-radix-cache", "enable-hierarchical-cache", "disable-overlap-schedule",
                "enable-deterministic-inference", "speculative-adaptive"):
        assert key in frozen_yaml, key  # every engine flag explicit
    for key, value in entries.items():
        assert frozen_yaml[key.replace("_", "-")] == value

    doc = (out / "production.md").read_text()
    what_runs = doc.split("## What runs")[1].split("## Start command")[0]
    e = source.engine
    assert (f"- batching: up to {e.max_num_seqs} requests decoded together (`max-num-seqs`), "
            f"{e.max_num_batched_tokens} tokens per engine step") in what_runs
    assert "| `--speculative-adaptive` |" in what_runs
    if settings is ENGINE_A:
        assert "- KV pool (`num-kv-blocks`, `kv-cache-gb`, `kv-block-size`): 40 blocks of 32 tokens (1280 token " \
               "slots)" in what_runs
        assert "- prefix cache: on, host tier of 2.5 GiB keeps prefix blocks evicted" in what_runs
        assert "- output/compute overlap: off (`disable-overlap-schedule`)" in what_runs
        assert "- deterministic mode: on (`enable-deterministic-inference`)" in what_runs
        assert f"- adaptive speculation: on: per step, as many drafts as pay at the current batch size (or none); " \
               f"cost profile `{entries['speculative_adaptive_profile']}`" in what_runs
        assert f"| `--speculative-adaptive-profile` | `{entries['speculative_adaptive_profile']}` |" in what_runs
    elif settings is ENGINE_B:
        assert ": 3 GiB of device memory in blocks of 16 tokens" in what_runs
        assert "- prefix cache: off (`disable-radix-cache`), no host tier" in what_runs
        assert "- adaptive speculation: off (`no-speculative-adaptive`)" in what_runs
        assert "- deterministic mode: off" in what_runs and "- output/compute overlap: on" in what_runs
    else:
        assert "cost profile `/var/cache/specserve/specserve/adaptive/<key>.json`" in what_runs
        assert ": 1 GiB of device memory in blocks of 16 tokens" in what_runs


def test_production_md_reports_the_bench_figures(tmp_path: Path, ngram_yaml: Path) -> None:
    spec = asdict(load_serve_config(ngram_yaml).speculative)
    plain = serving_json(tmp_path / "plain.json", {"algorithm": "NONE"},
                         [level(1, 101.234, 20.0, 9.5, None), level(4, 350.0, 40.0, 11.0, None)])
    fast = serving_json(tmp_path / "spec.json", spec,
                        [level(1, 95.1, 30.0, 10.2, 2.5), level(4, 455.5, 41.0, 8.0, 2.25, errors=1)])
    accept = tmp_path / "accept.json"
    accept.write_text(json.dumps({"kind": "acceptance", "config": {"model": "tiny", "device": "cpu",
                                                                   "speculative": spec},
                                  "summary": {"accept_length": 1.9, "speedup": 1.05},
                                  "tasks": [{"name": "code", "accept_length": 2.346, "speedup": 1.234,
                                             "spec_tokens_per_s": 50.0, "plain_tokens_per_s": 40.5},
                                            {"name": "chat", "accept_length": 1.1, "speedup": 0.87,
                                             "spec_tokens_per_s": 30.0, "plain_tokens_per_s": 34.5}]}))
    freeze(FreezeConfig(config=ngram_yaml, out=tmp_path / "d", bench=(fast, accept, plain)))
    doc = (tmp_path / "d" / "production.md").read_text()
    assert "| 1 | 101.2 | 95.1 | 0.94x | 20.0 / 30.0 | 9.5 / 10.2 | 2.50 |" in doc
    assert "| 4 | 350.0 | 455.5 | 1.30x | 40.0 / 41.0 | 11.0 / 8.0 | 2.25 |" in doc
    assert "| code | 2.35 | 1.23x | 50.0 | 40.5 |" in doc and "| chat | 1.10 | 0.87x | 30.0 | 34.5 |" in doc
    assert "Speculation costs 6.1% of output throughput at concurrency 1 (95.1 vs 101.2 tok/s" in doc
    assert "Time to first token (p50) is 50.0% higher than plain decoding at concurrency 1" in doc
    assert "1 request(s) failed at concurrency 4" in doc
    assert "Task chat: speculation is slower than plain decoding (speedup 0.87x" in doc
    assert "plain decoding: `plain.json`" in doc and "this configuration: `spec.json`" in doc
    assert "| `--speculative-algorithm` | `NGRAM` |" in doc and "| `--speculative-num-draft-tokens` | `12` |" in doc
    for section in ("## Start command", "## Known limits", "## Rollback", "journalctl -u specserve", "/health"):
        assert section in doc


def test_production_md_from_tune_json(tmp_path: Path, ngram_yaml: Path) -> None:
    spec = asdict(load_serve_config(ngram_yaml).speculative)
    tune_dir = tmp_path / "tune"
    tune_dir.mkdir()
    serving_json(tune_dir / "none.json", {"algorithm": "NONE"}, [level(2, 80.0, 10.0, 12.0, None)])
    serving_json(tune_dir / "n12.json", spec, [level(2, 120.0, 12.0, 8.0, 2.0)])
    serving_json(tune_dir / "n4.json", {**spec, "num_draft_tokens": 4}, [level(2, 777.7, 12.0, 8.0, 1.5)])
    (tune_dir / "tune.json").write_text(json.dumps({
        "kind": "tune", "baseline": "NONE",
        "configs": [{"name": "NONE", "flags": {"speculative-algorithm": "NONE"}, "run": "none.json"},
                    {"name": "n4", "flags": {"speculative-algorithm": "NGRAM", "speculative-num-draft-tokens": 4},
                     "run": "n4.json"},
                    {"name": "n12", "flags": {"speculative-algorithm": "NGRAM", "speculative-num-draft-tokens": 12},
                     "run": "n12.json"}],
        "winners": [{"concurrency": 2, "config": "n12", "output_tok_s": 120.0, "ratio_to_baseline": 1.5}]}))
    freeze(FreezeConfig(config=ngram_yaml, out=tmp_path / "d", bench=(tune_dir / "tune.json",)))
    doc = (tmp_path / "d" / "production.md").read_text()
    assert "| 2 | 80.0 | 120.0 | 1.50x |" in doc and "777.7" not in doc
    assert "`bench tune` config `n12`" in doc
    assert "`bench tune` winner at concurrency 2: `n12` (120.0 tok/s, 1.50x baseline)" in doc


def test_install_dry_run_lists_actions_and_touches_nothing(tmp_path: Path, ngram_yaml: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "deploy"
    freeze(FreezeConfig(config=ngram_yaml, out=out, user="specserve-test-user"))
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.iterdir()}
    calls: list[tuple[str, ...]] = []

    def runner(argv: Any) -> subprocess.CompletedProcess[str]:
        calls.append(tuple(argv))
        return subprocess.CompletedProcess(argv, 0, "", "")

    lines: list[str] = []
    systemd_dir = tmp_path / "etc-systemd"
    install(out, dry_run=True, systemd_dir=systemd_dir, runner=runner, out=lines.append)
    assert calls == [] and not systemd_dir.exists()
    assert before == {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out.iterdir()}
    assert all(line.startswith("[dry-run] ") for line in lines)
    expected = [f"copy {out / 'specserve.service'} -> {systemd_dir / 'specserve.service'} (mode 0644)",
                "run: systemctl daemon-reload", "run: systemctl enable specserve.service",
                "run: systemctl restart specserve.service"]
    actions = [line.removeprefix("[dry-run] ") for line in lines]
    assert actions[-4:] == expected
    assert "run: useradd --system --no-create-home --shell /usr/sbin/nologin specserve-test-user" in actions

    assert deploy_main(["install", str(out), "--dry-run", "--systemd-dir", str(systemd_dir)]) == 0
    assert "[dry-run] run: systemctl restart specserve.service" in capsys.readouterr().out
    assert not systemd_dir.exists()

    install(out, systemd_dir=systemd_dir, runner=runner, out=lines.append)  # for real, with a recording runner
    assert (systemd_dir / "specserve.service").read_bytes() == (out / "specserve.service").read_bytes()
    assert [c[:2] for c in calls] == [("useradd", "--system"), ("systemctl", "daemon-reload"),
                                      ("systemctl", "enable"), ("systemctl", "restart")]


def test_changed_drafter_file_is_refused_at_start(tmp_path: Path, tiny_dir: Path) -> None:
    drafter = tmp_path / "dflash"
    init_random_dflash(load_config(tiny_dir), drafter, seed=0, num_hidden_layers=1, block_size=4)
    cfg = write_yaml(tmp_path / "serve.yaml", model=str(tiny_dir), speculative_algorithm="DFLASH",
                     speculative_draft_model_path=str(drafter), device="cpu")
    out = tmp_path / "deploy"
    freeze(FreezeConfig(config=cfg, out=out))
    assert load_serve_config(out / "serve.yaml").speculative.dflash_block_size == 4  # unchanged: accepted
    weights = drafter / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one byte different
    weights.write_bytes(bytes(data))
    proc = subprocess.run([sys.executable, "-m", "specserve.server.cli", "--config", str(out / "serve.yaml"),
                           "--port", str(free_port())], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 2, proc.stderr
    assert "refusing to start: the drafter checkpoint" in proc.stderr
    assert "changed: model.safetensors" in proc.stderr
    with pytest.raises(ValueError, match=r"changed: model\.safetensors"):
        plan_install(out)
    (drafter / "extra.bin").write_bytes(b"x")
    (drafter / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"missing: model\.safetensors; new: extra\.bin"):
        load_serve_config(out / "serve.yaml")


FAKE_ENGINE = '#!/bin/sh\nprintf "%s\\n" "$@" > "$ARGV_OUT"\n'


@needs_analyze
@pytest.mark.parametrize(("engine", "algorithm"), [("sglang", "EAGLE3"), ("vllm", "EAGLE3"), ("sglang", "DFLASH"),
                                                   ("vllm", "DFLASH"), ("vllm", "DFLASH2"), ("vllm", "NGRAM"),
                                                   ("vllm", "SUFFIX")])
def test_export_uses_known_flags_and_engine_drafter_fields(tmp_path: Path, tiny_dir: Path, engine: str,
                                                           algorithm: str) -> None:
    """DFLASH2: a DFlash 2 drafter under the DFLASH algorithm; vLLM drafts its whole block (7 for block 8)."""
    target = load_config(tiny_dir)
    dflash2 = algorithm == "DFLASH2"
    if dflash2:
        algorithm = "DFLASH"
        init_random_dflash(target, tmp_path / "drafter-src", seed=0, num_hidden_layers=1, block_size=8,
                           conv_kernel_size=3, conv_group_size=16, selector_rank=4, selector_top_k=4)
    spec: dict[str, Any] = {"speculative_algorithm": algorithm}
    if algorithm == "EAGLE3":
        init_random_eagle3(target, tmp_path / "drafter-src", seed=0)
        spec.update(speculative_draft_model_path=str(tmp_path / "drafter-src"), speculative_num_steps=3,
                    speculative_eagle_topk=2, speculative_num_draft_tokens=6)
    elif algorithm == "DFLASH":
        if not dflash2:
            init_random_dflash(target, tmp_path / "drafter-src", seed=0, num_hidden_layers=1, block_size=4)
        spec.update(speculative_draft_model_path=str(tmp_path / "drafter-src"))
    settings = {"EAGLE3": ENGINE_A, "DFLASH": ENGINE_B}.get(algorithm, {})  # NGRAM: the engine defaults
    cfg = write_yaml(tmp_path / "serve.yaml", model=str(tiny_dir), device="cpu", api_key="k", max_queue=17,
                     tool_call_parser="qwen3", **spec, **engine_entries(settings, tmp_path))
    bin_dir = tmp_path / "engine-bin"
    bin_dir.mkdir()
    for name in ("python", "vllm"):
        (bin_dir / name).write_text(FAKE_ENGINE)
        (bin_dir / name).chmod(0o755)
    out = tmp_path / "export"
    facts = export_engine(EngineExportConfig(engine=engine, config=cfg, out=out, tp=2, hierarchical_cache=True,
                                             engine_bin=bin_dir))
    assert analyze_unit(out / f"{engine}.service") == []

    argv_file = tmp_path / "argv.txt"
    subprocess.run(["/bin/sh", str(out / "launch.sh")], check=True, timeout=30,
                   env={"PATH": os.environ["PATH"], "API_KEY": "k", "ARGV_OUT": str(argv_file)})
    seen = argv_file.read_text().splitlines()
    known = load_engine_flags(engine)
    if engine == "sglang":
        assert seen[:2] == ["-m", "sglang.launch_server"]
        launched = ["python", *seen]
    else:
        assert seen[:2] == ["serve", str(tiny_dir.resolve())]
        launched = ["vllm", *seen]
    check_command(known, launched)  # every flag (and every listed value) is in the known-flag data
    assert launched == ["k" if w == "$API_KEY" else w for w in facts["argv"]]  # launch.sh runs exactly that
    args = dict(itertools.pairwise(seen))
    assert args["--api-key"] == "k" and args["--served-model-name"] == str(tiny_dir)
    unmapped = {u["flag"] for u in facts["unmapped"]}
    mapped = {m["flag"] for m in facts["mapped"]}
    assert mapped | unmapped >= NEW_FLAGS and not mapped & unmapped & NEW_FLAGS  # each engine flag, once
    env_file = (out / f"{engine}.env").read_text().splitlines()
    drafter_cfg = json.loads((out / "drafter" / "config.json").read_text()) if algorithm in ("EAGLE3", "DFLASH") \
        else {}
    if engine == "sglang":
        assert args["--speculative-algorithm"] == algorithm and args["--tp-size"] == "2"
        assert args["--max-queued-requests"] == "17" and args["--tool-call-parser"] == "qwen25"
        assert seen.count("--enable-hierarchical-cache") == 1  # the export option, or the serve flag and it
        assert args["--speculative-draft-model-path"] == str(out.resolve() / "drafter")
        assert args["--max-running-requests"] == "8"
        assert args["--chunked-prefill-size"] == str(settings["max_num_batched_tokens"])
    else:
        sc = json.loads(args["--speculative-config"])
        method = {"EAGLE3": "eagle3", "DFLASH": "dflash", "NGRAM": "ngram", "SUFFIX": "suffix"}[algorithm]
        # DFLASH: block 4 minus the root; DFlash 2: its whole block of 8, whatever the verify width
        steps = {"EAGLE3": 3, "DFLASH": 7 if dflash2 else 3, "NGRAM": 6, "SUFFIX": 16}[algorithm]
        assert sc["method"] == method and sc["num_speculative_tokens"] == steps
        assert args["--tensor-parallel-size"] == "2" and args["--tool-call-parser"] == "hermes"
        assert "--enable-auto-tool-choice" in seen
        assert "--speculative-tree" in unmapped
        seqs = settings.get("max_num_seqs", 64)
        assert args["--max-num-seqs"] == str(seqs) and args["--max-num-queued-reqs"] == str(17 + seqs)
        assert "--speculative-adaptive" in unmapped if settings is not ENGINE_B else "--speculative-adaptive" in mapped
        if algorithm in ("EAGLE3", "DFLASH"):
            assert sc["model"] == str(out.resolve() / "drafter")
        if algorithm == "SUFFIX":  # vLLM's suffix_decoding_* settings, from the speculative_suffix_* flags
            assert sc["suffix_decoding_max_tree_depth"] == 24 and sc["suffix_decoding_max_cached_requests"] == 1000
    if settings is ENGINE_A:
        assert "--speculative-adaptive-profile" in unmapped and "--hicache-size" in mapped
        assert "--disable-radix-cache" not in seen and "--no-enable-prefix-caching" not in seen
        if engine == "sglang":
            assert args["--page-size"] == "32" and args["--max-total-tokens"] == "1280"
            assert args["--hicache-size"] == "3"  # 2.5 GiB = 2.68 GB, SGLang takes whole GB
            assert {"--disable-overlap-schedule", "--enable-deterministic-inference"} <= set(seen)
            assert "--speculative-adaptive" in unmapped  # SGLang adapts topk-1 chains only; this is topk 2
        else:
            assert args["--max-num-batched-tokens"] == "96" and args["--block-size"] == "32"
            assert args["--num-gpu-blocks-override"] == "40" and args["--kv-offloading-size"] == "2.5"
            assert "--no-async-scheduling" in seen and "VLLM_BATCH_INVARIANT=1" in env_file
    elif settings is ENGINE_B:
        assert "--kv-cache-gb" in unmapped and "--speculative-adaptive" in mapped
        assert not {"--disable-overlap-schedule", "--no-async-scheduling", "--max-total-tokens", "--block-size",
                    "--num-gpu-blocks-override", "--enable-deterministic-inference"} & set(seen)
        if engine == "sglang":
            assert "--disable-radix-cache" in seen and args["--page-size"] == "16"
        else:
            assert "--no-enable-prefix-caching" in seen and "--max-num-batched-tokens" in unmapped
            assert "--hierarchical-cache (export option)" in unmapped
            reason = next(u["reason"] for u in facts["unmapped"] if u["flag"] == "--kv-cache-gb")
            assert "--kv-cache-memory-bytes 1610612736 (per GPU)" in reason  # 3 GiB over tensor parallel 2
    else:
        assert args["--max-num-batched-tokens"] == "1024" and "--kv-offloading-size" not in seen
        assert not any(line.startswith("VLLM_BATCH_INVARIANT") for line in env_file)
    if algorithm == "EAGLE3":
        assert missing_fields(drafter_cfg, known.drafter_fields["EAGLE3"]) == []
        assert drafter_cfg["architectures"] == ["LlamaForCausalLMEagle3"]
        top = drafter_cfg["eagle_aux_hidden_state_layer_ids"]
        assert drafter_cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i - 1 for i in top]
    elif dflash2:
        assert missing_fields(drafter_cfg, known.drafter_fields["DFLASH2"]) == []
        assert drafter_cfg["architectures"] == ["DFlash2DraftModel"] and drafter_cfg["block_size"] == 8
        assert "DFlash2DraftModel" in next(m["note"] for m in facts["mapped"]
                                           if m["flag"] == "--speculative-draft-model-path")
    elif algorithm == "DFLASH":
        assert missing_fields(drafter_cfg, known.drafter_fields["DFLASH"]) == []
        assert drafter_cfg["architectures"] == ["DFlashDraftModel"] and drafter_cfg["block_size"] == 4
    doc = (out / "EXPORT.md").read_text()
    assert "## Without an equivalent" in doc
    assert all(f"`{flag}" in doc for flag in NEW_FLAGS)


@pytest.mark.parametrize("topk", [1, 2])
def test_adaptive_speculation_maps_to_sglang_for_eagle3_chains_only(topk: int) -> None:
    spec = SpeculativeConfig(algorithm="EAGLE3", draft_model_path="/d", num_steps=3, eagle_topk=topk,
                             num_draft_tokens=4, tree="chain" if topk == 1 else "eagle")
    cfg = ServeConfig(model="/m", speculative=spec, speculative_adaptive_profile="/p.json")
    sglang = build_command(load_engine_flags("sglang"), cfg, "/m", "/d")
    vllm = build_command(load_engine_flags("vllm"), cfg, "/m", "/d")
    unmapped = {u.flag: u.reason for u in sglang.unmapped}
    assert ("--speculative-adaptive" in sglang.argv) == (topk == 1)
    assert ("--speculative-adaptive" in unmapped) == (topk == 2)
    assert ("default is used" in unmapped["--speculative-adaptive-profile"]) == (topk == 1)
    assert "--speculative-adaptive" not in vllm.argv
    assert {"--speculative-adaptive", "--speculative-adaptive-profile"} <= {u.flag for u in vllm.unmapped}
    plain = build_command(load_engine_flags("sglang"), ServeConfig(model="/m"), "/m", None)
    assert "--speculative-adaptive" in {m.flag for m in plain.mapped}  # nothing to adapt without drafts


def test_check_command_rejects_unknown_flags_and_values() -> None:
    sglang, vllm = load_engine_flags("sglang"), load_engine_flags("vllm")
    launcher = list(sglang.launcher)
    check_command(sglang, [*launcher, "--model-path", "/m", "--speculative-algorithm", "DFLASH"])
    with pytest.raises(ValueError, match="not a known sglang flag"):
        check_command(sglang, [*launcher, "--speculative-ddtree-budget", "64"])
    with pytest.raises(ValueError, match="known values"):
        check_command(sglang, [*launcher, "--speculative-algorithm", "DDTREE"])
    with pytest.raises(ValueError, match="method"):
        check_command(vllm, ["vllm", "serve", "/m", "--speculative-config", '{"method": "ddtree"}'])


def test_exec_line_escapes_systemd_specifiers_and_variables() -> None:
    assert exec_line(["/usr/bin/python", "a b", "50%", "$HOME", 'say "hi"', "${KEY}"], variables=("${KEY}",)) == \
        '/usr/bin/python "a b" 50%% $$HOME "say \\"hi\\"" ${KEY}'


def test_status_reports_an_unreachable_server(capsys: pytest.CaptureFixture[str]) -> None:
    assert deploy_main(["status", "--url", f"http://127.0.0.1:{free_port()}"]) == 1
    out = capsys.readouterr().out
    assert "health http://127.0.0.1:" in out and "unreachable" in out and "service specserve:" in out


@pytest.mark.slow
def test_bench_freeze_then_serve_the_frozen_command(tmp_path: Path) -> None:
    """The whole path on the demo model: `bench tune` (plain vs NGRAM, a server per config, serving benches)
    -> freeze the winner's config with the tune report -> the unit's command in the foreground -> /health (the
    unit's ExecStartPost), a completion, `deploy status`, graceful stop."""
    tune_dir = tmp_path / "tune"
    assert bench_main(["tune", "--model", "demo", "--grid", "NONE NGRAM", "--concurrency", "1,2",
                       "--num-prompts", "2", "--output-len", "8", "--seed", "0", "--server-timeout", "180",
                       "--no-progress", "--out-dir", str(tune_dir)]) == 0
    report = json.loads((tune_dir / "tune.json").read_text())
    runs = {c["name"]: tune_dir / c["run"] for c in report["configs"]}
    assert set(runs) == {"NONE", "NGRAM"}
    port = free_port()
    cfg = write_yaml(tmp_path / "serve.yaml", model="demo", speculative_algorithm="NGRAM", port=port,
                     api_key="k3y", shutdown_timeout=5)
    out = tmp_path / "deploy"
    assert deploy_main(["freeze", "--config", str(cfg), "--out", str(out), "--bench", str(tune_dir / "tune.json")]) == 0
    doc = (out / "production.md").read_text()
    spec_levels = {lv["concurrency"]: lv for lv in json.loads(runs["NGRAM"].read_text())["levels"]}
    plain_levels = {lv["concurrency"]: lv for lv in json.loads(runs["NONE"].read_text())["levels"]}
    for c in (1, 2):
        s, p = spec_levels[c]["output_throughput"], plain_levels[c]["output_throughput"]
        assert f"| {c} | {p:.1f} | {s:.1f} | {s / p:.2f}x |" in doc
        winner = next(w for w in report["winners"] if w["concurrency"] == c)
        assert f"`bench tune` winner at concurrency {c}: `{winner['config']}`" in doc

    facts = json.loads((out / "deploy.json").read_text())
    env = dict(line.split("=", 1) for line in (out / "specserve.env").read_text().splitlines()
               if line and not line.startswith("#"))
    argv = [env["SPECSERVE_API_KEY"] if w == "${SPECSERVE_API_KEY}" else w for w in facts["command"]]
    log = (tmp_path / "frozen.log").open("wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=out,
                            env={**os.environ, **env, "OMP_NUM_THREADS": "1"})
    try:
        assert wait_healthy(facts["health_url"], timeout_s=120, interval_s=0.5), (tmp_path / "frozen.log").read_text()
        post = subprocess.run([sys.executable, "-m", "specserve.deploy.health", "--url", facts["health_url"],
                               "--timeout", "10"], capture_output=True, text=True, timeout=60)
        assert post.returncode == 0, post.stderr  # the unit's ExecStartPost
        base = facts["health_url"].removesuffix("/health")
        assert httpx.post(f"{base}/v1/completions", json={"model": "demo", "prompt": "def add(a, b):",
                                                          "max_tokens": 8}, timeout=60).status_code == 401
        r = httpx.post(f"{base}/v1/completions", headers={"Authorization": "Bearer k3y"},
                       json={"model": "demo", "prompt": "def add(a, b):", "max_tokens": 8}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
        os.environ["SPECSERVE_API_KEY"] = "k3y"
        try:
            st = status(out)
        finally:
            del os.environ["SPECSERVE_API_KEY"]
        assert st["live"]["health"] == "ok" and st["live"]["algorithm"] == "NGRAM"
        assert st["live"]["accept_length"] is not None and any("accept length" in x for x in format_status(st))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()

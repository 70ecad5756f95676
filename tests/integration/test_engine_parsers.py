"""Every command `deploy export` and `bench tune --dry-run` write, parsed by SGLang's and vLLM's own argument parsers
(`specserve.deploy.peers`: the pinned releases fetched `--no-deps` into ~/.cache/specserve/peers once, heavy
imports stubbed), and the version rules (`engine_rules.py`) agreeing with each parser on what it rejects.

Measured on the 2-core development machine: cold (first run: three wheels downloaded, unpacked, their small
dependencies installed; ~350 MB in the cache) 37 s, warm 25 s, most of it the engines' modules importing torch and
transformers, once per release.
Skipped, with the reason, where the package index cannot be reached.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from specserve.bench.cli import main as bench_main
from specserve.config import SpeculativeConfig
from specserve.deploy import peers
from specserve.deploy.engine_map import build_command
from specserve.deploy.engine_rules import judge
from specserve.deploy.known_flags import load_engine_flags
from specserve.engine.engine_config import EngineConfig
from specserve.server.serve_config import ServeConfig

GRID = {"sglang": "EAGLE3:steps=3;topk=1,4;draft=4,8;path=/d DFLASH:block=16;path=/d NGRAM:draft=8,12 NONE",
        "vllm": "EAGLE3:steps=3,5;topk=1,4;path=/d DFLASH:block=16;path=/d NGRAM:steps=4 NONE"}
RELEASES = [(engine, version) for engine, versions in peers.PEERS.items() for version in versions]


def export_configs() -> dict[str, ServeConfig]:
    """Eight exports: plain, NGRAM, EAGLE3 chain (adaptive), EAGLE3 tree, DFLASH (two, and a DFlash 2 drafter's:
    `dflash2`, a chain of 8 verified, vLLM given the whole block), STANDALONE."""
    base = ServeConfig(model="/m", api_key="k", tool_call_parser="qwen3", speculative_adaptive=False,
                       engine=EngineConfig(hicache_gb=4.0, kv_block_size=1))
    eagle = SpeculativeConfig(algorithm="EAGLE3", draft_model_path="/d", num_steps=3, eagle_topk=1,
                              num_draft_tokens=4)
    dflash = SpeculativeConfig(algorithm="DFLASH", draft_model_path="/d", num_steps=1, num_draft_tokens=16,
                               dflash_block_size=16, tree="chain")
    return {
        "plain": base,
        "ngram": replace(base, speculative=SpeculativeConfig(algorithm="NGRAM", num_steps=4, num_draft_tokens=8)),
        "eagle3-chain-adaptive": replace(base, speculative=eagle, speculative_adaptive=True),
        "eagle3-tree": replace(base, speculative=replace(eagle, eagle_topk=4, num_draft_tokens=8, tree="eagle")),
        "dflash": replace(base, speculative=dflash),
        "dflash2": replace(base, speculative=replace(dflash, num_draft_tokens=8)),
        "dflash-adaptive": replace(base, speculative=dflash, speculative_adaptive=True,
                                   engine=EngineConfig(kv_block_size=16)),
        "standalone": replace(base, speculative=SpeculativeConfig(algorithm="STANDALONE", draft_model_path="/d",
                                                                  num_steps=3, num_draft_tokens=4)),
    }


def dry_run(engine: str, version: str, capsys: pytest.CaptureFixture[str]) -> list[dict[str, object]]:
    code = bench_main(["tune", "--engine", engine, "--engine-version", version, "--model", "/m", "--grid",
                       GRID[engine], "--out-dir", "/nonexistent/tune", "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0
    return [json.loads(line) for line in out.splitlines()]


@pytest.fixture(scope="module")
def installed() -> dict[tuple[str, str], Path]:
    try:
        with ThreadPoolExecutor(len(RELEASES)) as pool:
            dirs = list(pool.map(lambda r: peers.install(*r), RELEASES))
    except peers.PeerUnavailable as e:
        pytest.skip(f"the engines' parsers cannot be fetched here (package index unreachable?): {e}")
    return dict(zip(RELEASES, dirs, strict=True))


def test_commands_parse_in_the_engines_own_parsers(installed: dict[tuple[str, str], Path],
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    jobs: dict[tuple[str, str], list[tuple[str, list[str], str | None]]] = {}  # (label, argv, rule's skip reason)
    for engine, version in RELEASES:
        known = load_engine_flags(engine)
        lines = dry_run(engine, version, capsys)
        names = [line["name"] for line in lines]
        assert names[0] == "NONE" and len(names) == len(set(names))
        job = jobs.setdefault((engine, version), [])
        for line in lines:
            if line["argv"] is None:
                assert line["skipped"]
                continue
            job.append((f"tune {line['name']}", list(line["argv"]), None))  # type: ignore[arg-type]
        for label, cfg in export_configs().items():
            verdict = judge(engine, version, cfg.speculative, cfg.engine.kv_block_size, cfg.speculative_adaptive)
            cmd = build_command(known, cfg, "/m", cfg.speculative.draft_model_path, tp=2, hierarchical_cache=True,
                                dflash2=label == "dflash2")
            job.append((f"export {label}", list(cmd.argv), verdict.skip if verdict.rejected else None))
        skipped = {line["name"]: line["skipped"] for line in lines if line["argv"] is None}
        if engine == "sglang" and version == "0.5.10":
            assert list(skipped) == ["DFLASH:block=16;path=/d;tree=chain"]
            assert "has no --speculative-algorithm DFLASH" in next(iter(skipped.values()))
            assert any("SGLANG_ENABLE_SPEC_V2" in line["env"] for line in lines)  # type: ignore[operator]
        elif engine == "sglang":
            assert skipped == {}
        else:
            assert sorted(skipped) == ["EAGLE3:steps=3;topk=4;path=/d", "EAGLE3:steps=5;topk=4;path=/d"]
            assert all("chains only" in r for r in skipped.values())

    def parse(release: tuple[str, str]) -> list[str | None]:
        launcher = load_engine_flags(release[0]).launcher
        return peers.parse_commands(*release, [peers.engine_args(argv, launcher) for _, argv, _ in jobs[release]])

    with ThreadPoolExecutor(2) as pool:
        results = dict(zip(jobs, pool.map(parse, jobs), strict=True))
    rejected: dict[tuple[str, str], list[str]] = {}
    for release, job in jobs.items():
        for (label, _, rule_skip), error in zip(job, results[release], strict=True):
            if label.startswith("tune"):
                assert error is None, f"{release} rejects {label}: {error}"
            else:  # the rules refuse exactly what the parser rejects
                assert (error is None) == (rule_skip is None), f"{release} {label}: {error!r} vs {rule_skip!r}"
            if error:
                rejected.setdefault(release, []).append(label)
    assert rejected == {("sglang", "0.5.10"): ["export eagle3-chain-adaptive", "export dflash", "export dflash2",
                                               "export dflash-adaptive"]}

"""`bench peers` without llama.cpp, for real: worker processes of specserve (eager) and transformers on a tiny
checkpoint, interleaved rounds, greedy outputs compared, JSON / markdown / PNG written."""

from __future__ import annotations

import io
import json
from pathlib import Path

from specserve.bench.peer_worker import serve, specserve_methods, transformers_methods
from specserve.bench.peers import PeersConfig, run


def _ask(peer: tuple, reqs: list[dict]) -> list[dict]:
    methods, model, *compile_all = peer  # transformers has nothing to compile
    out: list[str] = []
    serve(methods, model, io.StringIO("".join(json.dumps(r) + "\n" for r in reqs)), out.append, *compile_all)
    return [json.loads(x) for x in out]


def test_worker_protocol_batches_and_greedy_parity(tiny_dir: Path) -> None:
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
    reqs = [{"method": "plain", "prompts": prompts, "batch": 1, "new_tokens": 6},
            {"method": "plain", "prompts": prompts, "batch": 3, "new_tokens": 6},
            {"method": "ngram", "prompts": prompts[:1], "batch": 1, "new_tokens": 6},
            {"method": "suffix", "prompts": prompts, "batch": 1, "new_tokens": 6},
            {"method": "suffix", "prompts": prompts, "batch": 1, "new_tokens": 6},
            {"method": "floor"}, {"method": "compile", "batch": 3}]
    ours = _ask(specserve_methods(str(tiny_dir), "float32", eager=True, speculative=("ngram", "suffix")), reqs)
    theirs = _ask(transformers_methods(str(tiny_dir), "float32"), reqs[:2])
    one_by_one, batched, ngram, suffix, suffix_again, floor, compiled = ours
    assert [len(o) for o in one_by_one["outputs"]] == [6, 6, 6]
    assert batched["outputs"] == one_by_one["outputs"] == theirs[0]["outputs"] == theirs[1]["outputs"]
    assert ngram["outputs"] == one_by_one["outputs"][:1] and ngram["accept_length"] >= 1.0
    # the suffix cache starts empty at every call: the same prompts again are drafted as the first time
    assert suffix["outputs"] == suffix_again["outputs"] == one_by_one["outputs"]
    assert suffix["accept_length"] == suffix_again["accept_length"]
    assert one_by_one["accept_length"] is None and floor["floor_ms"] > 0 and compiled["seconds"] >= 0


def test_peers_run_without_llama_cpp(tiny_dir: Path, tmp_path: Path) -> None:
    cfg = PeersConfig(model=str(tiny_dir), dtypes=("float32",), threads=(1,), batches=(1, 2),
                      peers=("specserve-eager", "transformers"), prompts=2, new_tokens=5, rounds=2,
                      speculative=("ngram", "suffix"), work=tmp_path / "work")
    report = run(cfg, tmp_path / "out", progress=False)
    assert {p.name for p in (tmp_path / "out").iterdir()} == {"peers.json", "peers.md", "peers.png"}
    assert report["tokenizer_check"] == {} and not (tmp_path / "work").exists()  # llama.cpp not asked for
    rows = {(r["peer"], r["method"], r["batch"]): r for r in report["summary"]}
    assert set(rows) == {(p, m, b) for p in cfg.peers for m, b in (("plain", 1), ("ngram", 1), ("plain", 2))} | {
        ("specserve-eager", "suffix", 1)}  # suffix is specserve's alone
    for key in [("specserve-eager", "plain", 1), ("transformers", "plain", 1), ("transformers", "plain", 2)]:
        assert rows[key]["identical_outputs"] in ("2/2",) and rows[key]["rounds"] == 2
    assert rows[("specserve-eager", "ngram", 1)]["accept_length"] >= 1.0
    assert len(report["rows"]) == 2 * len(rows) and "float32/t1" in report["matmul_floor_ms"]

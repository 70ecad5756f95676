"""`bench acceptance --base-url`: through a real `specserve serve`, the offline figures task by task (greedy), from
the response's meta_info and from /metrics deltas; with a reference server; clear errors for bad servers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from server_util import free_port, running_server
from specserve.cli import main

SPEC = ["--speculative-algorithm", "STANDALONE", "--speculative-num-steps", "3"]


def suite_file(tmp_path: Path) -> Path:
    suite = tmp_path / "suite.jsonl"
    suite.write_text(json.dumps({"name": "loop", "prompt": "a = 1\nb = 2\na = 1\nb = 2\n"}) + "\n"
                     + json.dumps({"name": "def", "prompt": "def add(a, b):\n"}) + "\n"
                     + json.dumps({"name": "chat", "messages": [{"role": "user", "content": "write fizzbuzz"}]}) + "\n")
    return suite


def test_remote_equals_offline(tmp_path: Path, tiny_dir: Path, tiny_draft_dir: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    suite = suite_file(tmp_path)
    common = ["--suite", str(suite), "--max-new-tokens", "16"]
    spec = [*SPEC, "--speculative-draft-model-path", str(tiny_draft_dir)]
    assert main(["bench", "acceptance", "--model", str(tiny_dir), "--device", "cpu", "--dtype", "float32", *spec,
                 *common, "--out", str(tmp_path / "offline.json")]) == 0
    offline = json.loads((tmp_path / "offline.json").read_text())
    capsys.readouterr()
    # without adaptive speculation, which decodes plainly where drafts do not pay (offline never does)
    with running_server(["--model", str(tiny_dir), "--device", "cpu", "--dtype", "float32", *spec,
                         "--no-speculative-adaptive"], tmp_path / "server.log") as srv:
        reports = {}
        for source, extra in (("response", []), ("metrics", []), ("reference", ["--reference-base-url", srv.url])):
            out = tmp_path / f"{source}.json"
            flags = ["--source", "metrics"] if source == "metrics" else []
            assert main(["bench", "acceptance", "--base-url", srv.url, *common, *flags, *extra, "--out", str(out)]) == 0
            reports[source] = json.loads(out.read_text())
    capsys.readouterr()
    want = {t["name"]: t for t in offline["tasks"]}
    for source, report in reports.items():
        assert report["kind"] == "acceptance" and report["config"]["speculative"]["algorithm"] == "STANDALONE"
        assert [t["name"] for t in report["tasks"]] == list(want)
        for t in report["tasks"]:
            w = want[t["name"]]
            assert t["accept_length"] == pytest.approx(w["accept_length"], abs=1e-3), (source, t["name"])
            assert t["verify_steps"] == w["verify_steps"] and t["new_tokens"] == w["new_tokens"], (t, w)
            assert t["accept_per_position"] == pytest.approx(w["accept_per_position"], abs=1e-3)
            assert t["loop_4gram"] is not None and t["speedup"] is None
            assert t["source"].startswith("response" if source != "metrics" else "metrics")
        assert report["summary"]["accept_length"] == pytest.approx(offline["summary"]["accept_length"], abs=1e-3)
    ref = reports["reference"]
    assert ref["summary"]["percent_of_reference"] == pytest.approx(100.0)
    assert all(t["percent_of_reference"] == pytest.approx(100.0) for t in ref["tasks"])


def test_bad_servers_are_one_line_errors(tmp_path: Path, tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    suite = suite_file(tmp_path)
    out = tmp_path / "acc.json"
    base = ["bench", "acceptance", "--suite", str(suite), "--max-new-tokens", "4", "--out", str(out)]
    assert main([*base, "--base-url", f"http://127.0.0.1:{free_port()}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot reach" in err and "start the server or fix the base URL" in err
    with running_server(["--model", str(tiny_dir), "--device", "cpu"], tmp_path / "plain.log") as srv:
        assert main([*base, "--base-url", srv.url]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "reports no speculation" in err and "--speculative-algorithm" in err
    assert not out.exists()  # nothing half-written


def test_adaptive_server_that_verified_nothing_says_how_to_measure(tmp_path: Path, tiny_dir: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A speculative server whose adaptive policy found no draft width paying: the error names the flag to fix."""
    suite = suite_file(tmp_path)
    profile = tmp_path / "profile.json"
    serve = ["--model", str(tiny_dir), "--device", "cpu", "--dtype", "float32", "--speculative-algorithm", "NGRAM",
             "--speculative-adaptive-profile", str(profile)]
    with running_server(serve, tmp_path / "first.log"):
        pass  # measures and writes the profile before it serves
    saved = json.loads(profile.read_text())
    saved["seconds"] = [[t * (1 if q == 1 else 1e4) for t, q in zip(row, saved["widths"], strict=True)]
                        for row in saved["seconds"]]  # any draft costs ten thousand steps: never verified
    profile.write_text(json.dumps(saved))
    out = tmp_path / "acc.json"
    with running_server(serve, tmp_path / "second.log") as srv:
        assert main(["bench", "acceptance", "--suite", str(suite), "--max-new-tokens", "8", "--out", str(out),
                     "--base-url", srv.url]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "runs NGRAM" in err and "adaptive policy verified no drafts" in err and "spec_verify_ct 0" in err
    assert "--no-speculative-adaptive" in err and "reports no speculation" not in err
    assert not out.exists()


def test_dflash_client_reads_the_accept_length(tmp_path: Path, tiny_dir: Path, tiny_draft_dir: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """z-lab's `dflash` client (PyPI) against `serve`: `generate openai` answers and `benchmark openai` prints the
    accept length from the response's top-level meta_info, equal to what the server reports per choice."""
    from dflash import benchmark, cli

    prompts = [{"turns": [t]} for t in ("write fizzbuzz", "def add(a, b):", "a = 1\nb = 2\na = 1\n")]
    local = tmp_path / "prompts.jsonl"  # its datasets come from a hub: a local file stands in
    local.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    monkeypatch.setattr(benchmark, "load_and_process_dataset",
                        lambda name: [json.loads(line) for line in local.read_text().splitlines()])
    spec = [*SPEC, "--speculative-draft-model-path", str(tiny_draft_dir), "--no-speculative-adaptive"]
    with running_server(["--model", str(tiny_dir), "--device", "cpu", "--dtype", "float32", *spec],
                        tmp_path / "server.log") as srv:
        direct = benchmark.send_openai(srv.url, [{"role": "user", "content": "write fizzbuzz"}], model=str(tiny_dir),
                                       max_new_tokens=12, temperature=0.0, top_p=1.0, top_k=0, timeout_s=60)
        cli.main(["generate", "openai", "--model", str(tiny_dir), "--base-url", srv.url, "--max-new-tokens", "8",
                  "hello"])
        capsys.readouterr()
        cli.main(["benchmark", "openai", "--model", str(tiny_dir), "--base-url", srv.url, "--dataset", "humaneval",
                  "--num-prompts", "3", "--max-new-tokens", "12"])
    printed = capsys.readouterr().out
    assert direct["meta_info"] == direct["choices"][0]["meta_info"] and direct["meta_info"]["spec_verify_ct"] > 0
    lines = {k.strip(): v.strip() for k, _, v in (x.partition(":") for x in printed.splitlines()) if v}
    assert int(lines["Spec verify ct"]) > 0 and float(lines["Accept length"]) >= 1.0, printed

"""`specserve bench trace`: stretches of a pass log, their speculating/plain ratio and wall-time budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specserve.cli import main


def write_log(path: Path, passes: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(p) + "\n" for p in passes))
    return path


def decode(t: float, batch: int, width: int, tokens: int, seconds: float, catch_up: bool = False) -> dict[str, object]:
    return {"t": t, "batch": batch, "width": width, "tokens": tokens, "seconds": seconds, "forward_s": seconds / 2,
            "catch_up": catch_up, "kind": "decode"}


def test_stretches_ratios_and_widths(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # two levels 5 s apart: the first at batch 4 (2 plain passes, 2 speculating), the second at batch 1
    passes = [
        {"t": 0.05, "kind": "prefill", "batch": 4, "tokens": 40, "seconds": 0.05, "forward_s": 0.04,
         "drafter_s": 0.01, "merged": False},
        decode(0.15, 4, 0, 4, 0.1), decode(0.25, 4, 0, 4, 0.1),
        decode(0.45, 4, 3, 12, 0.2), decode(0.65, 4, 3, 12, 0.2),
        decode(0.75, 4, 3, 40, 0.1, catch_up=True),  # left out of the speculating ones
        decode(0.8, 1, 0, 1, 0.05),  # under 3/4 of the peak batch: left out
        decode(6.0, 1, 0, 1, 0.01), decode(6.03, 1, 2, 3, 0.02),
    ]
    log = write_log(tmp_path / "a.passes.jsonl", passes)
    out = tmp_path / "trace.json"
    assert main(["bench", "trace", str(log), "--min-batch", "1", "--widths-at", "1", "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == json.loads(out.read_text())
    first, second = report["logs"][0]["stretches"]
    assert (first["peak_batch"], first["passes"], first["spec_share"]) == (4, 5, 0.4)
    assert (first["spec_tok_s"], first["plain_tok_s"], first["spec_over_plain"]) == (60.0, 40.0, 1.5)
    assert first["prefill_s"] == 0.05 and first["prefill_drafter_s"] == 0.01
    assert first["wall_s"] == pytest.approx(first["decode_s"] + first["prefill_s"] + first["outside_s"], abs=2e-3)
    assert second["peak_batch"] == 1 and second["spec_over_plain"] == 1.5
    widths = report["logs"][0]["widths_at"]
    assert widths["0"]["passes"] == 2 and widths["2"]["tokens_per_pass"] == 3.0
    assert widths["ceiling"] == pytest.approx((3 / 0.02) / (2 / 0.06), abs=1e-3)


def test_bad_input_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "trace", str(tmp_path / "missing.jsonl")]) == 2
    assert "--speculative-adaptive-trace" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"t": 1}\n')
    assert main(["bench", "trace", str(bad)]) == 2
    assert "not a trace log" in capsys.readouterr().err

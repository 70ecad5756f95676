"""`bench serving` with a conversation dataset against a real `specserve serve` (tiny model, SUFFIX drafting):
each turn's request carries the whole history (chat: the messages with the assistant's earlier answers and tool
results as `tool` messages; completions: the transcript), and the server's own prompt-token count equals the
tokenized full history, so it saw every earlier turn. Later turns hit the prefix cache (`/metrics`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from server_util import ServerProcess, start_server
from specserve.bench.conversations import Conversation
from specserve.bench.datasets import load_dataset
from specserve.bench.metrics import RequestResult
from specserve.bench.serving import run_conversation_level
from specserve.bench.serving_client import ServingConfig, client_session
from specserve.cli import main
from specserve.tokenizer import Tokenizer

LINES = [
    {"id": "loop", "turns": ["Write a loop that prints 1 to 3.", "Now count down instead.", "Add a comment."]},
    {"id": "tool", "turns": [[{"role": "user", "content": "Read the file."},
                              {"role": "tool", "content": "def f(x):\n    return x + 1\n"}],
                             "Rename f to inc."]},
    {"prompt": "def add(a, b):"},
]


@pytest.fixture(scope="module")
def server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("conv-server") / "server.log"
    srv = start_server(["--model", str(tiny_dir), "--device", "cpu", "--speculative-algorithm", "SUFFIX",
                        "--no-speculative-adaptive"], log)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def dataset_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("conv-data") / "conversations.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in LINES), encoding="utf-8")
    return path


Sent = list[tuple[Conversation, int, dict[str, Any], RequestResult, str]]


def level(url: str, model: str, endpoint: str, convs: list[Conversation]) -> tuple[dict[str, Any], Sent]:
    sent: Sent = []
    cfg = ServingConfig(base_url=url, model=model, endpoint=endpoint, output_len=6)

    async def go() -> dict[str, Any]:
        async with client_session(60.0, 8) as client:
            return await run_conversation_level(client, cfg, convs, 2, progress=False,
                                                on_turn=lambda *a: sent.append(a))

    return asyncio.run(go()), sent


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_each_turn_carries_the_whole_history(server: ServerProcess, tiny_dir: Path, dataset_file: Path,
                                             endpoint: str) -> None:
    dataset = load_dataset(str(dataset_file), 3)
    convs = list(dataset.conversations)
    assert [c.num_turns for c in convs] == [3, 2, 1] and convs[2].single is not None
    lv, sent = level(server.url, str(tiny_dir), endpoint, convs)
    assert (lv["num_requests"], lv["completed"], lv["num_conversations"]) == (6, 6, 3)
    tok = Tokenizer(tiny_dir)
    by_conv: dict[str, list[tuple[int, dict[str, Any], RequestResult, str]]] = {}
    for conv, turn, body, result, answer in sent:
        assert result.ok, result.error
        by_conv.setdefault(conv.id, []).append((turn, body, result, answer))
    for conv in convs:
        turns = sorted(by_conv[conv.id], key=lambda t: t[0])
        assert [t[0] for t in turns] == list(range(conv.num_turns))  # one turn at a time, in order
        answers = [t[3] for t in turns]
        for k, body, result, _ in turns:
            if conv.single is not None:  # a plain prompt line: sent as it is
                assert body.get("prompt", conv.single.as_text()) == conv.single.as_text()
                assert body.get("messages", conv.single.as_messages()) == conv.single.as_messages()
                continue
            if endpoint == "chat":
                want = [m for j in range(k + 1) for m in
                        [{"role": r, "content": c} for r, c in conv.turns[j]]
                        + ([{"role": "assistant", "content": answers[j]}] if j < k else [])]
                assert body["messages"] == want
                text = tok.apply_chat_template(want)
            else:  # the previous turn's prompt and answer, then this turn's lines
                lines = "".join(f"{r}: {c}\n" for r, c in conv.turns[k])
                before = turns[k - 1][1]["prompt"] + answers[k - 1] + "\n" if k else ""
                text = before + lines + "assistant: "
                assert body["prompt"] == text
            assert result.prompt_tokens == len(tok.encode(text)), (conv.id, k)  # the server saw it all
        if conv.id == "tool" and endpoint == "chat":
            assert turns[1][1]["messages"][1]["role"] == "tool"
        tokens = [t[2].prompt_tokens or 0 for t in turns]
        assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)
    assert lv["ttft_first_turn_ms"] is not None and lv["ttft_later_turns_ms"] is not None
    assert {r["turn"] for r in lv["requests"]} == {0, 1, 2}
    cache = lv["prefix_cache"]
    assert cache is not None and cache["source"] == "metrics:prefix_cache_tokens_total"
    assert cache["hit_tokens"] > 0 and 0 < cache["hit_rate"] <= 1  # later turns reuse earlier turns' blocks


def test_cli_writes_conversation_levels(server: ServerProcess, tiny_dir: Path, dataset_file: Path,
                                        tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    argv = ["bench", "serving", "--base-url", server.url, "--model", str(tiny_dir), "--concurrency", "1,2",
            "--num-prompts", "3", "--dataset", str(dataset_file), "--output-len", "4", "--endpoint", "chat",
            "--no-progress", "--out", str(out)]
    assert main(argv) == 0
    run = json.loads(out.read_text())
    assert run["dataset"]["conversations_available"] == 3 and run["dataset"]["turns_sent_per_level"] == 6
    for lv in run["levels"]:
        assert {"ttft_first_turn_ms", "ttft_later_turns_ms", "prefix_cache", "num_conversations",
                "ttft_ms", "tpot_ms", "accept_length", "spec_step_fraction"} <= set(lv)
        assert lv["completed"] == 6 and set(lv["ttft_first_turn_ms"]) == {"mean", "p50", "p90", "p99"}

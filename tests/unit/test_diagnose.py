"""`bench/diagnose.py`: each output token's outcome from the verify rounds, token classes, and the report."""

from __future__ import annotations

from specserve.bench.diagnose import diagnose, max_depth, token_class, token_outcomes
from specserve.config import SpeculativeConfig


def test_token_outcomes_follow_the_rounds() -> None:
    # prefill token, then rounds accepting 3 (2 drafts + the target's), 1 (a miss at depth 1), 4 = full depth 3
    assert token_outcomes(9, [3, 1, 4], depth_cap=3) == [
        None, ("accepted", 1), ("accepted", 2), ("missed", 3), ("missed", 1),
        ("accepted", 1), ("accepted", 2), ("accepted", 3), None]
    assert token_outcomes(4, [3, 5], depth_cap=4) == [None, ("accepted", 1), ("accepted", 2), ("missed", 3)]


def test_token_classes() -> None:
    assert [token_class(t) for t in (" foo", "bar_1", "\n    ", "  ", "(", " ==", '"', " x.")] == [
        "identifier", "identifier", "whitespace", "whitespace", "punctuation", "punctuation", "punctuation",
        "punctuation"]


def test_max_depth_per_algorithm() -> None:
    assert max_depth(SpeculativeConfig.resolve("NGRAM", num_draft_tokens=8)) == 7
    assert max_depth(SpeculativeConfig.resolve("EAGLE3", "d", num_steps=5, eagle_topk=1)) == 5
    assert max_depth(SpeculativeConfig.resolve("DFLASH", "d", dflash_block_size=8, num_draft_tokens=16,
                                               tree="ddtree")) == 7


def test_report_by_depth_class_and_against_a_reference() -> None:
    vocab = {1: "x", 2: " =", 3: " 1", 4: "\n", 5: " y"}

    def decode(ids: list[int]) -> str:
        return "".join(vocab[i] for i in ids)

    ids = [1, 2, 3, 4, 5, 2]
    ours = [(ids, [3, 1, 2])]  # 2, 3 accepted; 4 missed (depth 3); 5 missed (depth 1); 2 accepted, then cut
    ref = [(ids, [4, 1])]  # 2, 3, 4 accepted, 5 missed (depth 4), 2 missed at depth 1
    r = diagnose(ours, decode, depth_cap=4, reference=ref)
    assert r["by_depth"] == [{"depth": 1, "reached": 3, "accepted": 2, "rate": 0.6667},
                             {"depth": 2, "reached": 1, "accepted": 1, "rate": 1.0},
                             {"depth": 3, "reached": 1, "accepted": 0, "rate": 0.0}]
    assert r["by_class"]["whitespace"] == {"reached": 1, "accepted": 0, "rate": 0.0, "share_of_misses": 0.5}
    assert r["by_class"]["identifier"] == {"reached": 2, "accepted": 1, "rate": 0.5, "share_of_misses": 0.5}
    assert r["by_class"]["punctuation"]["rate"] == 1.0
    v = r["versus_reference"]
    assert v["whitespace"] == {"ours_missed_reference_accepted": 1, "ours_accepted_reference_missed": 0}
    assert v["identifier"] == {"ours_missed_reference_accepted": 0, "ours_accepted_reference_missed": 0}
    assert v["punctuation"] == {"ours_missed_reference_accepted": 0, "ours_accepted_reference_missed": 1}
    assert r["skipped_mismatched"] == 0


def test_a_reference_with_another_output_is_skipped_not_fatal() -> None:
    vocab = {1: "x", 2: " =", 3: " 1", 4: "\n", 5: " y"}

    def decode(ids: list[int]) -> str:
        return "".join(vocab[i] for i in ids)

    ids, other = [1, 2, 3, 4, 5, 2], [1, 2, 3, 5, 5, 2]
    ours = [(ids, [3, 1, 2]), (ids, [2, 2, 2])]
    ref = [(other, [6]), (ids, [1, 1, 1, 1, 1])]  # the first task's reference decoded another token
    r = diagnose(ours, decode, depth_cap=4, reference=ref)
    assert r["skipped_mismatched"] == 1
    assert r["by_depth"] == diagnose(ours, decode, depth_cap=4)["by_depth"]  # our figures cover both tasks
    v = r["versus_reference"]  # the second task only: ours accepted " =", "\n", " =" at depth 1, the reference none
    assert v["punctuation"] == {"ours_missed_reference_accepted": 0, "ours_accepted_reference_missed": 2}
    assert v["whitespace"] == {"ours_missed_reference_accepted": 0, "ours_accepted_reference_missed": 1}
    assert v["identifier"] == {"ours_missed_reference_accepted": 0, "ours_accepted_reference_missed": 0}

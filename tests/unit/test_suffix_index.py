"""SUFFIX drafting: the suffix automaton against brute force, the drafter's matches and trees, the shared cache's
LRU eviction and bounded memory, and the flags' validation."""

from __future__ import annotations

import random

import pytest
import torch

from specserve.config import SpeculativeConfig
from specserve.speculative.suffix import SuffixDrafter
from specserve.speculative.suffix_index import REBUILD_RATE, SuffixAutomaton, SuffixCache, split_end

CPU = torch.device("cpu")


def drafter(cache: SuffixCache | None = None, depth: int = 24, nodes: int = 16, factor: float = 1.0,
            min_prob: float = 0.1, tree: bool = True) -> SuffixDrafter:
    return SuffixDrafter(cache, depth, nodes, factor, min_prob, tree, CPU)


def paths(d: SuffixDrafter, root: int, max_drafts: int | None = None) -> list[list[int]]:
    """Every root-to-node token path of the proposed tree (root excluded), in node order."""
    t = d.propose(root, max_drafts)
    toks, parents = t.tokens.tolist(), t.parents.tolist()
    out: list[list[int]] = [[]]
    for i in range(1, len(toks)):
        out.append([*out[parents[i]], toks[i]])
    return out[1:]


def test_automaton_matches_brute_force_over_interleaved_sequences() -> None:
    rng = random.Random(0)
    for _ in range(10):
        sam = SuffixAutomaton()
        seqs: dict[int, list[int]] = {k: [] for k in range(3)}
        for k in seqs:
            sam.add_sequence(k)
        for _ in range(150):
            k, t = rng.randrange(3), rng.randrange(4)
            sam.extend(k, t)
            seqs[k].append(t)
        assert sam.num_states <= 2 * 150  # linear size: at most 2n - 1 states
        for s in seqs.values():
            for i in range(0, len(s) - 5, 7):
                for n in range(1, 6):
                    pat = s[i:i + n]
                    state, m = 0, 0
                    for t in pat:
                        state, m = sam.step(state, m, t)
                    assert m == n
                    got = sorted(split_end(e) for e in sam.occurrences(state, 10**9))
                    want = sorted((k, j + n) for k, other in seqs.items() for j in range(len(other) - n + 1)
                                  if other[j:j + n] == pat)
                    assert got == want


def test_matching_statistics_find_the_longest_suffix() -> None:
    sam = SuffixAutomaton()
    sam.add_sequence(0)
    for t in [1, 2, 3, 4, 1, 2, 5]:
        sam.extend(0, t)
    state, m = 0, 0
    lengths = []
    for t in [9, 1, 2, 3, 7, 2, 5]:
        state, m = sam.step(state, m, t)
        lengths.append(m)
    assert lengths == [0, 1, 2, 3, 0, 1, 2]


def test_drafts_what_followed_the_longest_match() -> None:
    d = drafter()
    d.prefill([1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3])
    # q = ... 1 2 3 + root 4: the match "1 2 3 4" (4 tokens) drafts 4 tokens (factor 1)
    assert paths(d, 4) == [[5], [5, 6], [5, 6, 7], [5, 6, 7, 8]]
    assert paths(d, 4, max_drafts=2) == [[5], [5, 6]]
    assert paths(d, 9) == []  # never seen: nothing to draft


def test_spec_factor_and_depth_cap_the_draft() -> None:
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1, 2]
    d = drafter(factor=0.5)
    d.prefill(prompt)
    assert paths(d, 3)[-1] == [4]  # match "1 2 3": floor(0.5 * 3) = 1 token
    d = drafter(depth=2, factor=4.0)
    d.prefill(prompt)
    assert paths(d, 3)[-1] == [4, 5]


def test_tree_branches_by_frequency_and_chain_follows_the_most_frequent() -> None:
    # "7 8" is followed by 1 three times and by 2 once; nothing longer matches
    prompt = [7, 8, 1, 3, 7, 8, 1, 4, 7, 8, 2, 5, 7, 8, 1, 6, 9, 7]
    tree = drafter(min_prob=0.2)
    tree.prefill(prompt)
    got = paths(tree, 8)
    assert got[0] == [1]  # most probable first (3/4), then the others (1/4 each), two tokens (factor 1 x 2)
    assert sorted(got[1:]) == [[1, 3], [1, 4], [1, 6], [2], [2, 5]]
    chain = drafter(tree=False)
    chain.prefill(prompt)
    assert paths(chain, 8) == [[1], [1, 3]]  # ties: the first seen
    strict = drafter(min_prob=0.3)  # 1/4 = 0.25 < 0.3: the rare branch is cut
    strict.prefill(prompt)
    assert [2] not in paths(strict, 8)


def test_accept_updates_the_index_incrementally() -> None:
    d = drafter()
    d.prefill([5, 6, 7])
    assert paths(d, 5) == [[6]]
    states = d.index_stats().states
    d.accept([5, 6], None, 7)
    assert d.history == (5, 6, 7, 5, 6)
    assert d.index_stats().states - states <= 4  # at most two states per appended token, no rebuild
    assert paths(d, 7)[-1] == [5, 6, 7]  # q = 5 6 7 5 6 7: "5 6 7" matched, 3 tokens read on periodically


def test_the_cache_shares_finished_outputs_across_requests() -> None:
    cache = SuffixCache(max_requests=8)
    first = drafter(cache)
    first.prefill([100, 101])
    first.accept([50, 51, 52, 53, 54, 55], None, 60)
    assert len(cache) == 0  # in flight: not shared yet
    first.finish([50, 51, 52, 53, 54, 55, 60])  # the engine ends the request
    assert len(cache) == 1
    second = drafter(cache)
    second.prefill([200, 50, 51])
    assert paths(second, 52)[-1] == [53, 54, 55]
    off = drafter(SuffixCache(max_requests=0))
    off.prefill([1])
    off.accept([1, 2], None, 3)
    off.finish([1, 2, 3])
    assert len(off.cache or []) == 0


def test_lru_evicts_the_least_recent_request() -> None:
    cache = SuffixCache(max_requests=2)
    cache.add([1, 2, 3])
    cache.add([4, 5, 6])
    d = drafter(cache)
    d.prefill([9, 1])
    assert paths(d, 2)[-1] == [3]  # reads request 0: it becomes the most recent
    cache.add([7, 8, 9])
    assert cache.evicted == 1
    assert paths(d, 2)[-1] == [3]  # request 1 was evicted, not request 0
    d2 = drafter(cache)
    d2.prefill([0, 4])
    assert paths(d2, 5) == []


def test_cache_memory_stays_flat_over_500_requests() -> None:
    rng = random.Random(1)
    cache = SuffixCache(max_requests=20, min_rebuild_tokens=256)
    sizes = []
    for i in range(500):
        d = drafter(cache)
        d.prefill([rng.randrange(50) for _ in range(8)])
        root = rng.randrange(50)
        output: list[int] = []
        for _ in range(10):  # 10 rounds of 4 tokens each
            toks = [root] + [rng.randrange(50) for _ in range(3)]
            d.propose(root)
            root = rng.randrange(50)
            d.accept(toks, None, root)
            output += [*toks[1:], root]
        d.finish(output)
        sizes.append(cache.stats())
        assert len(cache) == min(i + 1, 20)
    assert cache.evicted == 480 and cache.generation > 0  # evicted and rebuilt
    early = max(s["bytes"] for s in sizes[50:150])
    late = max(s["bytes"] for s in sizes[350:500])
    assert late <= 1.2 * early, (early, late)
    assert max(s["states"] for s in sizes) <= 2 * 2 * 20 * 40  # twice the live tokens at most, 2 states a token


def test_rebuilds_are_spread_over_adds_and_change_no_match() -> None:
    """No add copies more than REBUILD_RATE tokens per token it adds (no stall over the whole cache), and every
    string occurs in the cache's live outputs exactly where it occurs in a cache built afresh from them,
    whether a rebuild is under way, done or not begun."""
    rng = random.Random(2)
    cache = SuffixCache(max_requests=8, min_rebuild_tokens=64)
    mid_rebuild = 0

    def found(c: SuffixCache, probe: list[int]) -> list[tuple[tuple[int, ...], int]]:
        state, m = 0, 0
        for t in probe:
            state, m = c.index.step(state, m, t)
        if m < len(probe):
            return []
        ends = [split_end(e) for e in c.index.occurrences(state, 10**9, c.alive)]
        return sorted((tuple(c.index.seqs[sid]), off) for sid, off in ends)

    for _ in range(200):
        out = [rng.randrange(6) for _ in range(rng.randrange(5, 40))]
        before = cache.rebuild_tokens
        cache.add(out)
        assert cache.rebuild_tokens - before <= REBUILD_RATE * len(out)
        mid_rebuild += cache._next is not None
        fresh = SuffixCache(max_requests=8)
        for sid in cache._lru:
            fresh.add(list(cache.index.seqs[sid]))
        for _ in range(4):
            probe = [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
            assert found(cache, probe) == found(fresh, probe), probe
    assert cache.generation >= 5 and mid_rebuild > 0


@pytest.mark.parametrize(("fields", "flag"), [
    ({"suffix_max_tree_depth": 0}, "--speculative-suffix-max-tree-depth"),
    ({"suffix_max_cached_requests": -1}, "--speculative-suffix-max-cached-requests"),
    ({"suffix_max_spec_factor": 0.0}, "--speculative-suffix-max-spec-factor"),
    ({"suffix_min_token_prob": 1.5}, "--speculative-suffix-min-token-prob"),
    ({"num_steps": 5}, "--speculative-num-steps"),
    ({"eagle_topk": 2}, "--speculative-eagle-topk"),
    ({"tree": "ddtree"}, "--speculative-tree"),
    ({"num_draft_tokens": 1}, "--speculative-num-draft-tokens"),
])
def test_config_errors_name_the_flag(fields: dict[str, object], flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        SpeculativeConfig.resolve("SUFFIX", **fields)  # type: ignore[arg-type]


def test_config_defaults_follow_vllm() -> None:
    s = SpeculativeConfig.resolve("suffix")
    assert (s.algorithm, s.tree, s.num_steps, s.num_draft_tokens) == ("SUFFIX", "eagle", 24, 17)
    assert (s.suffix_max_cached_requests, s.suffix_max_spec_factor, s.suffix_min_token_prob) == (1000, 1.0, 0.1)
    assert SpeculativeConfig.resolve("SUFFIX", suffix_max_tree_depth=8).num_draft_tokens == 9

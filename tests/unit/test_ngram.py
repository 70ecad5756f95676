"""NgramDrafter: exact trees on hand-made histories, and a brute-force reference over random loops."""

from __future__ import annotations

import random

import pytest
import torch

from specserve.config import SpeculativeConfig
from specserve.speculative.ngram import NgramDrafter
from specserve.speculative.trees.tree import DraftTree

CPU = torch.device("cpu")


def make(prompt: list[int], depth: int = 3, nodes: int = 8, lo: int = 1, hi: int = 3, breadth: int = 1,
         scan: int = 64) -> NgramDrafter:
    d = NgramDrafter(max_depth=depth, max_nodes=nodes, min_match=lo, max_match=hi, max_breadth=breadth,
                     device=CPU, max_scan=scan)
    d.prefill(prompt, None)
    return d


def as_lists(tree: DraftTree) -> tuple[list[int], list[int], list[int]]:
    return tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()


def paths(tree: DraftTree) -> set[tuple[int, ...]]:
    """Each draft node as the token path from the root's child down to it."""
    toks, pars = tree.tokens.tolist(), tree.parents.tolist()
    out = set()
    for i in range(1, len(toks)):
        p, j = [], i
        while j > 0:
            p.append(toks[j])
            j = pars[j]
        out.add(tuple(reversed(p)))
    return out


def check_structure(tree: DraftTree) -> None:
    toks, pars, deps = as_lists(tree)
    assert tree.tokens.dtype == torch.long and pars[0] == -1 and deps[0] == 0
    sib = set()
    for i in range(1, len(toks)):
        assert 0 <= pars[i] < i and deps[i] == deps[pars[i]] + 1
        assert (pars[i], toks[i]) not in sib, "a trie has no duplicate siblings"
        sib.add((pars[i], toks[i]))


# ---- exact trees -------------------------------------------------------------------------------


def test_longest_match_wins() -> None:
    # q = 5 1 2 9 | 7 2 8 | 1 2 + root; suffix (1, 2) matched at the start wins over the 1-gram (2) of "2 8".
    d = make([5, 1, 2, 9, 7, 2, 8, 1], depth=2, hi=2)
    assert as_lists(d.propose(2)) == ([2, 9, 7], [-1, 0, 1], [0, 1, 2])


def test_most_recent_occurrence_wins() -> None:
    # (3, 4) is followed by 5 at first and by 6 later: the later one is drafted.
    d = make([3, 4, 5, 0, 3, 4, 6, 0, 3], depth=2, hi=2)
    assert as_lists(d.propose(4)) == ([4, 6, 0], [-1, 0, 1], [0, 1, 2])


def test_breadth_builds_a_trie_with_shared_prefixes() -> None:
    # after "1": "2 3" (oldest), "2 4", "5 6" (newest); most recent first, "2" is shared.
    d = make([1, 2, 3, 0, 1, 2, 4, 0, 1, 5, 6, 0], depth=2, hi=1, breadth=3)
    tree = d.propose(1)
    assert as_lists(tree) == ([1, 5, 6, 2, 4, 3], [-1, 0, 1, 0, 3, 3], [0, 1, 2, 1, 2, 2])
    check_structure(tree)


def test_shorter_matches_fill_breadth_after_longer_ones() -> None:
    # 2-gram (8, 1) occurs once (-> 2); the 1-gram (1) adds "7" (most recent other continuation).
    d = make([8, 1, 2, 0, 1, 7, 0, 8], depth=1, hi=2, breadth=2)
    assert as_lists(d.propose(1)) == ([1, 2, 7], [-1, 0, 0], [0, 1, 1])


def test_node_cap_keeps_the_best_path_and_prefix_closure() -> None:
    d = make([1, 2, 3, 0, 1, 2, 4, 0, 1, 5, 6, 0], depth=2, hi=1, breadth=3, nodes=3)
    tree = d.propose(1)
    # best path 5 6 whole, then "2" of the next match; its child 4 is cut, never the parent alone.
    assert as_lists(tree) == ([1, 5, 6, 2], [-1, 0, 1, 0], [0, 1, 2, 1])
    d1 = make([1, 2, 3, 0, 1, 2, 4, 0, 1, 5, 6, 0], depth=4, hi=1, breadth=3, nodes=2)
    assert as_lists(d1.propose(1)) == ([1, 5, 6], [-1, 0, 1], [0, 1, 2])


def test_no_match_gives_root_only() -> None:
    tree = make([1, 2, 3, 4], hi=3).propose(9)
    assert as_lists(tree) == ([9], [-1], [0]) and tree.num_nodes == 0
    assert make([], hi=3).propose(1).num_nodes == 0  # empty history
    assert make([7, 7], lo=2, hi=3).propose(8).num_nodes == 0  # only 1-gram matches, below min_match


def test_periodic_text_drafts_past_the_end() -> None:
    # "a b a b a" + root b: most recent (a, b) ends right before root; the match repeats with period 2.
    d = make([1, 2, 1, 2, 1], depth=5, hi=2)
    assert d.propose(2).tokens.tolist() == [2, 1, 2, 1, 2, 1]
    assert make([4, 4, 4], depth=3, hi=3).propose(4).tokens.tolist() == [4, 4, 4, 4]


def test_chain_mode_from_config_is_a_single_path() -> None:
    hist = [1, 2, 3, 0, 1, 2, 4, 0, 1, 5, 6, 0]
    chain = NgramDrafter.from_config(SpeculativeConfig.resolve("NGRAM", tree="chain", num_draft_tokens=4), CPU)
    tree_cfg = SpeculativeConfig.resolve("NGRAM", num_draft_tokens=6, num_steps=2, ngram_max_breadth=3)
    wide = NgramDrafter.from_config(tree_cfg, CPU)
    assert (chain.max_depth, chain.max_nodes, chain.max_breadth) == (3, 3, 1)
    assert (wide.max_depth, wide.max_nodes, wide.max_breadth) == (2, 5, 3)
    chain.prefill(hist, None)
    wide.prefill(hist, None)
    c = chain.propose(1)
    assert c.is_chain and c.tokens.tolist() == [1, 5, 6, 0]
    assert not wide.propose(1).is_chain


def test_accept_bookkeeping_and_device() -> None:
    d = make([1, 2, 3], depth=2, hi=2)
    assert d.propose(1).tokens.tolist() == [1, 2, 3]
    d.accept([1, 2], None, next_root=9)
    assert d.history == (1, 2, 3, 1, 2)
    assert d.propose(9).num_nodes == 0
    d.accept([9], None, next_root=1)
    assert d.history == (1, 2, 3, 1, 2, 9)
    assert d.propose(1).tokens.tolist() == [1, 2, 9]  # most recent "1" is now the one before 2 9
    with pytest.raises(AssertionError):
        d.accept([5], None, next_root=1)  # tokens[0] must be the last bonus token
    d.prefill([4], None)
    assert d.history == (4,) and d.propose(4).tokens.tolist() == [4, 4, 4]
    assert d.propose(4).tokens.device == CPU


@pytest.mark.parametrize("kw", [dict(max_depth=0), dict(max_nodes=0), dict(min_match=0), dict(min_match=4),
                                dict(max_breadth=0), dict(max_scan=0)])
def test_bad_arguments_name_the_flag(kw: dict[str, int]) -> None:
    args = dict(max_depth=2, max_nodes=3, min_match=1, max_match=3, max_breadth=2, max_scan=8) | kw
    with pytest.raises(ValueError, match=r"must be|need 1"):
        NgramDrafter(device=CPU, **args)


# ---- reference matcher over a simulated speculative loop ---------------------------------------


def reference_paths(q: list[int], depth: int, nodes: int, lo: int, hi: int, breadth: int,
                    scan: int) -> tuple[list[list[int]], set[tuple[int, ...]]]:
    """Brute force on the full sequence q = history + [root]: scan every position for every n."""
    big_l = len(q)
    conts: list[list[int]] = []
    for n in range(hi, lo - 1, -1):
        ends = [e for e in range(big_l - 1, n - 1, -1) if q[e - n:e] == q[big_l - n:]][:scan]
        for e in ends:
            ext = list(q)
            while len(ext) < e + depth:  # the sequence keeps repeating what followed the match
                ext.append(ext[len(ext) - (big_l - e)])
            c = ext[e:e + depth]
            if c not in conts and len(conts) < breadth:
                conts.append(c)
    kept: list[tuple[int, ...]] = []
    for c in conts:
        for k in range(1, depth + 1):
            if tuple(c[:k]) not in kept and len(kept) < nodes:
                kept.append(tuple(c[:k]))
    return conts, set(kept)


def run_loop(seed: int, vocab: int, depth: int, nodes: int, lo: int, hi: int, breadth: int, scan: int) -> int:
    rng = random.Random(seed)
    # A stream with repeats, so that lookups hit: random tokens mixed with copies of earlier spans.
    stream = [rng.randrange(vocab) for _ in range(6)]
    while len(stream) < 160:
        if rng.random() < 0.5:
            s = rng.randrange(len(stream))
            stream += stream[s:s + rng.randint(1, 6)]
        else:
            stream.append(rng.randrange(vocab))
    plen = rng.randint(0, 20)
    d = NgramDrafter(depth, nodes, lo, hi, breadth, CPU, max_scan=scan)
    d.prefill(stream[:plen], None)
    pos = plen  # stream[pos] is the root: emitted, not yet committed
    hits = 0
    while pos + depth + 1 < len(stream):
        root = stream[pos]
        tree = d.propose(root)
        check_structure(tree)
        q = stream[:pos + 1]
        conts, want = reference_paths(q, depth, nodes, lo, hi, breadth, scan)
        assert paths(tree) == want
        assert d.continuations(root) == conts
        if conts:
            assert tree.tokens[1:1 + depth].tolist() == conts[0][:nodes]  # best path comes first, whole
        # greedy verification against the stream: walk the tree while the stream agrees
        toks, kids, node, acc = tree.tokens.tolist(), tree.children(), 0, [root]
        while True:
            nxt = [c for c in kids[node] if toks[c] == stream[pos + len(acc)]]
            if not nxt:
                break
            node = nxt[0]
            acc.append(toks[node])
        hits += len(acc) - 1
        d.accept(acc, None, next_root=stream[pos + len(acc)])
        pos += len(acc)
        assert d.history == tuple(stream[:pos])
    return hits


@pytest.mark.parametrize("seed", range(4))
def test_matches_reference_over_a_loop(seed: int) -> None:
    hits = run_loop(seed, vocab=5, depth=4, nodes=7, lo=1, hi=3, breadth=3, scan=4)
    assert hits > 0  # the stream repeats itself, so some drafts must be accepted


@pytest.mark.parametrize("seed", range(100, 130))
def test_matches_reference_random_params(seed: int) -> None:
    rng = random.Random(seed)
    lo = rng.randint(1, 3)
    run_loop(seed, vocab=rng.randint(2, 6), depth=rng.randint(1, 5), nodes=rng.randint(1, 9), lo=lo,
             hi=lo + rng.randint(0, 3), breadth=rng.randint(1, 4), scan=rng.randint(1, 5))

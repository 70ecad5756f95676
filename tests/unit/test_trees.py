"""Tree builders: DDTree is the optimal tree under its factorised model; the EAGLE tree matches a brute-force
enumeration of its candidate set, with the drafter fed consistent parents."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from specserve.speculative.trees.ddtree import build_ddtree, rebuild_below
from specserve.speculative.trees.eagle_tree import expand_eagle_tree
from specserve.speculative.trees.tree import DraftTree

Path = tuple[int, ...]


def node_paths(tree: DraftTree) -> list[Path]:
    """Token path (root excluded) of every node; checks parents precede children and depths agree."""
    tokens, parents, depths = tree.tokens.tolist(), tree.parents.tolist(), tree.depths.tolist()
    assert parents[0] == -1 and depths[0] == 0
    paths: list[Path] = [()]
    for i in range(1, len(tokens)):
        assert 0 <= parents[i] < i
        assert depths[i] == depths[parents[i]] + 1
        paths.append((*paths[parents[i]], tokens[i]))
    return paths


def prefix_score(log_probs: torch.Tensor, path: Path) -> float:
    return sum(float(log_probs[d, y]) for d, y in enumerate(path))


# ---------------------------------------------------------------- DDTree


def all_prefixes(vocab: int, depth: int) -> list[Path]:
    return [p for d in range(1, depth + 1) for p in itertools.product(range(vocab), repeat=d)]


@pytest.mark.parametrize(("vocab", "depth"), [(3, 1), (3, 3), (4, 2), (2, 4)])
def test_ddtree_is_the_most_probable_prefixes(vocab: int, depth: int) -> None:
    g = torch.Generator().manual_seed(vocab * 10 + depth)
    prefixes = all_prefixes(vocab, depth)
    for budget in range(len(prefixes) + 3):
        log_probs = torch.log_softmax(torch.randn(depth, vocab, generator=g) * 2, -1)
        tree = build_ddtree(9, log_probs, budget)
        paths = node_paths(tree)
        assert tree.tokens[0] == 9
        assert tree.num_nodes == min(budget, len(prefixes))
        assert max(len(p) for p in paths) <= depth
        assert len(set(paths)) == len(paths)
        best = sorted(prefixes, key=lambda p: -prefix_score(log_probs, p))[:budget]
        assert set(paths[1:]) == set(best)


def test_ddtree_maximises_expected_acceptance_over_all_trees() -> None:
    """Σ_nodes Π q along the path, against every prefix-closed tree of the same size (V=3, D=2)."""
    g = torch.Generator().manual_seed(1)
    log_probs = torch.log_softmax(torch.randn(2, 3, generator=g), -1)
    prefixes = all_prefixes(3, 2)

    def expected_accept(paths: list[Path]) -> float:
        return sum(math.exp(prefix_score(log_probs, p)) for p in paths)

    for budget in range(1, 7):
        closed = [s for s in itertools.combinations(prefixes, budget) if all(p[:-1] in s for p in s if len(p) > 1)]
        best = max(expected_accept(list(s)) for s in closed)
        got = expected_accept(node_paths(build_ddtree(0, log_probs, budget))[1:])
        assert got == pytest.approx(best, rel=1e-9)


def test_ddtree_large_budget_structure_and_ties() -> None:
    g = torch.Generator().manual_seed(2)
    log_probs = torch.log_softmax(torch.randn(6, 50, generator=g), -1)
    tree = build_ddtree(1, log_probs, 40)
    paths = node_paths(tree)  # prefix-closed, parents first
    assert tree.num_nodes == 40 and max(len(p) for p in paths) <= 6 and tree.draft_probs is None
    scores = [prefix_score(log_probs, p) for p in paths[1:]]
    assert all(a >= b - 1e-6 for a, b in itertools.pairwise(scores))  # pop order is best-first
    # Ties everywhere (uniform q): still a valid tree of the requested size.
    flat = build_ddtree(1, torch.full((3, 4), -math.log(4)), 10)
    assert flat.num_nodes == 10 and len(set(node_paths(flat))) == 11
    assert build_ddtree(5, log_probs, 0).num_nodes == 0


def test_rebuild_below_puts_the_best_subtree_of_its_size_under_a_node() -> None:
    """The nodes outside the subtree keep their paths in order; below the node, the best DDTree of as many nodes
    over the given rows, paths rooted at the node's path; a drawn tree is refused."""
    g = torch.Generator().manual_seed(3)
    first = torch.log_softmax(torch.randn(4, 6, generator=g), -1)
    tree = build_ddtree(9, first, 10)
    node = tree.children()[0][0]
    paths = node_paths(tree)
    size = sum(p[: len(paths[node])] == paths[node] and p != paths[node] for p in paths)
    given = torch.log_softmax(3 * torch.randn(3, 6, generator=g), -1)
    new, at = rebuild_below(tree, node, given)
    new_paths = node_paths(new)  # also checks parents before children and depths
    assert new.num_nodes == tree.num_nodes and new_paths[at] == paths[node] and int(new.tokens[0]) == 9
    inside = [p for p in new_paths if p[: len(paths[node])] == paths[node] and p != paths[node]]
    outside = [p for p in paths if not (p[: len(paths[node])] == paths[node] and p != paths[node])]
    assert [p for p in new_paths if p not in inside] == outside
    want = node_paths(build_ddtree(int(tree.tokens[node]), given, size))[1:]
    assert inside == [paths[node] + p[1:] for p in [(0, *w) for w in want]]
    with pytest.raises(ValueError, match="deterministic"):
        rebuild_below(DraftTree(tree.tokens, tree.parents, tree.depths, torch.zeros(11, 6)), node, given)


def test_ddtree_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="log-probabilities"):
        build_ddtree(0, torch.randn(3, 5) + 5, 4)
    with pytest.raises(ValueError, match="budget"):
        build_ddtree(0, torch.zeros(3, 5), -1)
    with pytest.raises(ValueError, match=r"\[D, V\]"):
        build_ddtree(0, torch.zeros(5), 4)


# ---------------------------------------------------------------- EAGLE tree


class FakeDrafter:
    """Next-token log-probs as a fixed pseudo-random function of the whole token path. It tracks fed nodes
    from the parents it receives, so wrong parent indices would change the log-probs it returns."""

    def __init__(self, vocab: int, seed: int, scale: float = 2.0, normalise: bool = True) -> None:
        self.vocab, self.seed, self.scale, self.normalise = vocab, seed, scale, normalise
        self.fed: list[Path] = [()]  # fed node 0 = the root
        self.calls: list[list[Path]] = []

    def log_probs(self, path: Path) -> torch.Tensor:
        key = self.seed
        for y in path:
            key = (key * 1_000_003 + y + 1) % (2**61 - 1)
        x = torch.randn(self.vocab, generator=torch.Generator().manual_seed(key)) * self.scale
        return torch.log_softmax(x, -1) if self.normalise else x

    def step(self, tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        assert tokens.shape == parents.shape and tokens.dim() == 1
        assert all(0 <= p < len(self.fed) for p in parents.tolist())
        paths = [(*self.fed[p], y) for y, p in zip(tokens.tolist(), parents.tolist(), strict=True)]
        self.fed.extend(paths)
        self.calls.append(paths)
        return torch.stack([self.log_probs(p) for p in paths])  # [F, V]


def brute_force(drafter: FakeDrafter, steps: int, topk: int, num_nodes: int) -> tuple[set[Path], list[list[Path]]]:
    """The candidate set and the top-`num_nodes` selection, enumerated directly; also the fed frontiers."""

    def top(lp: torch.Tensor) -> list[int]:
        return sorted(range(drafter.vocab), key=lambda y: -float(lp[y]))[:topk]

    first = drafter.log_probs(())
    frontier: list[tuple[float, Path]] = [(float(first[y]), (y,)) for y in top(first)]
    cands, fed = list(frontier), []
    for _ in range(steps - 1):
        fed.append([p for _, p in frontier])
        new: list[tuple[float, Path]] = []
        for s, p in frontier:
            lp = drafter.log_probs(p)
            new += [(s + float(lp[y]), (*p, y)) for y in top(lp)]
        cands += new
        frontier = sorted(new, key=lambda c: -c[0])[:topk]
    assert len(cands) == topk + (steps - 1) * topk * topk
    return {p for _, p in sorted(cands, key=lambda c: -c[0])[:num_nodes]}, fed


@pytest.mark.parametrize(("topk", "steps"), [(2, 3), (3, 4), (4, 2), (3, 1)])
def test_eagle_tree_matches_brute_force(topk: int, steps: int) -> None:
    total = topk + (steps - 1) * topk * topk
    for num_nodes in sorted({1, 2, topk, total // 2, total - 1, total, total + 5} - {0}):
        drafter = FakeDrafter(vocab=7, seed=topk * 100 + steps)
        tree = expand_eagle_tree(0, drafter.log_probs(()), drafter.step, steps, topk, num_nodes)
        paths = node_paths(tree)  # prefix-closed, parents first
        want, fed = brute_force(FakeDrafter(vocab=7, seed=drafter.seed), steps, topk, num_nodes)
        assert tree.num_nodes == min(num_nodes, total) and tree.draft_probs is None
        assert set(paths[1:]) == want
        assert drafter.calls == fed  # frontiers fed in score order, with parents pointing at their fed nodes
        assert max(len(p) for p in paths) <= steps


def test_eagle_topk1_is_the_greedy_chain() -> None:
    drafter = FakeDrafter(vocab=9, seed=5)
    greedy: list[int] = []
    for _ in range(5):
        greedy.append(int(drafter.log_probs(tuple(greedy)).argmax()))
    for num_nodes in (1, 3, 5, 8):
        tree = expand_eagle_tree(4, drafter.log_probs(()), FakeDrafter(vocab=9, seed=5).step, 5, 1, num_nodes)
        assert tree.is_chain
        assert tree.tokens.tolist() == [4, *greedy[: min(5, num_nodes)]]


def test_eagle_ties_and_unnormalised_scores_stay_prefix_closed() -> None:
    # Children with log-prob 0 tie with their parent: the cut must keep the parent first.
    def certain(tokens: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        out = torch.full((tokens.shape[0], 4), float("-inf"))
        out[:, 0] = 0.0
        return out

    first = torch.log(torch.tensor([0.6, 0.4, 0.0, 0.0]))
    ranked = [(0,), (0, 0), (1,), (1, 0)]  # scores log .6, log .6, log .4, log .4; then -inf
    for num_nodes in range(1, 7):
        paths = node_paths(expand_eagle_tree(3, first, certain, 2, 2, num_nodes))
        assert len(set(paths)) == num_nodes + 1
        if num_nodes <= len(ranked):
            assert set(paths[1:]) == set(ranked[:num_nodes])
    # Raw logits (positive scores, children can outscore parents): still prefix-closed at every size.
    for num_nodes in range(1, 22):  # 3 + 2·9 = 21 candidates
        drafter = FakeDrafter(vocab=6, seed=9, normalise=False)
        tree = expand_eagle_tree(0, drafter.log_probs(()), drafter.step, 3, 3, num_nodes)
        assert tree.num_nodes == num_nodes and len(set(node_paths(tree))) == num_nodes + 1


def test_eagle_rejects_bad_input() -> None:
    lp = torch.log_softmax(torch.zeros(5), -1)
    with pytest.raises(ValueError, match="topk"):
        expand_eagle_tree(0, lp, FakeDrafter(5, 0).step, 3, 6, 4)
    with pytest.raises(ValueError, match="num_steps"):
        expand_eagle_tree(0, lp, FakeDrafter(5, 0).step, 0, 2, 4)
    with pytest.raises(ValueError, match="num_nodes"):
        expand_eagle_tree(0, lp, FakeDrafter(5, 0).step, 3, 2, 0)
    with pytest.raises(ValueError, match="step_fn"):
        expand_eagle_tree(0, lp, lambda t, p: torch.zeros(1, 5), 3, 2, 4)

"""Constrained decoding: a request's `Grammar` masks every distribution its tokens are picked from (llguidance).

`GrammarCompiler` (one per engine: the token table is built once per tokenizer) compiles a grammar once per
spec (cached) and hands each request a `GrammarState` that has consumed every committed token. Speculation stays
exact under a mask because verification runs on masked distributions: `constrain_tree` walks a draft tree depth
first (consume a node's token, visit its children, roll back), takes the mask at every node, and cuts nodes the
grammar forbids before the verify forward — a forbidden draft could never be accepted (greedy: never the masked
argmax; sampling: it has probability 0). Sampled drafts keep a forbidden node itself (the rejection rule's
residuals count it) and lose only what lies below it. Greedy rows need no mask where the target's argmax is
legal, which is almost everywhere: `prune_tree` validates each root-to-leaf path in one call, and `greedy_picks`
checks a pick only where the path the picks accept stops, masking only where the grammar forbids it. Forced
tokens (the grammar allows one continuation: `GrammarState.forced`) make a chain draft that the masked verifier
accepts.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specserve.engine.grammar_close import CLOSE_SLACK, NEAR, ClosingTable, closing_tokens, is_json
from specserve.speculative.trees.tree import DraftTree, child_by_token
from specserve.tokenizer import Tokenizer
from specserve.types import Grammar

#: compiled grammars kept per compiler (most recently used)
CACHE_SIZE = 256


class GrammarCompiler:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        """`vocab_size`: the model's (logits rows; ids past the tokenizer's are never allowed)."""
        self._source = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_ids)
        self._tok: Any = None  # llguidance.LLTokenizer, built on first use (~1 s for a large vocabulary)
        self._cache: OrderedDict[Grammar, _Compiled] = OrderedDict()
        self._lock = threading.Lock()  # the server checks grammars off the engine's thread
        self.compile_s = 0.0  # spent compiling, cache misses only
        self.compiled = 0
        self._closing: ClosingTable | None = None  # built on the first budgeted state (~1 s: every token's text)

    def _tokenizer(self) -> Any:
        if self._tok is None:
            import llguidance

            self._tok = llguidance.LLTokenizer(self._source.to_json(), n_vocab=self.vocab_size,
                                               eos_token=self._eos or None)
        return self._tok

    def compile(self, grammar: Grammar) -> int:
        """Compile and cache the grammar (ValueError names what is wrong); the tokens of a short output it accepts
        (the closing path from its start, `engine/grammar_close.py`; else the lower bound `min_tokens`)."""
        with self._lock:
            return self._compile(grammar).min_tokens

    def _compile(self, grammar: Grammar) -> _Compiled:
        hit = self._cache.get(grammar)
        if hit is not None:
            self._cache.move_to_end(grammar)
            return hit
        from llguidance import LLMatcher

        t0 = time.perf_counter()
        tok = self._tokenizer()
        if grammar.kind == "json_schema":
            try:
                schema = json.loads(grammar.spec)
            except json.JSONDecodeError as e:
                raise ValueError(f"the JSON schema is not JSON: {e}") from None
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema is a JSON object")
            text = LLMatcher.grammar_from_json_schema(schema, overrides=_json_options(grammar))
        elif grammar.kind == "json_object":
            text = LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=_json_options(grammar))
        elif grammar.kind == "regex":
            text = LLMatcher.grammar_from_regex(grammar.spec)
        else:
            text = LLMatcher.grammar_from_lark(grammar.spec)
        failed, messages = LLMatcher.validate_grammar_with_warnings(text, tok)
        if failed:
            raise ValueError(f"the {grammar.kind} grammar cannot be used: {messages[0] if messages else 'invalid'}")
        matcher = LLMatcher(tok, text, log_level=0)
        if matcher.is_error():
            raise ValueError(f"the {grammar.kind} grammar cannot be used: {matcher.get_error()}")
        path = closing_tokens(matcher, self._table(), self._eos[0] if self._eos else None)
        compiled = _Compiled(matcher, len(path) if path is not None else min_tokens(matcher.deep_copy()))
        self.compile_s += time.perf_counter() - t0
        self.compiled += 1
        self._cache[grammar] = compiled
        if len(self._cache) > CACHE_SIZE:
            self._cache.popitem(last=False)
        return compiled

    def _table(self) -> ClosingTable:
        if self._closing is None:
            self._closing = ClosingTable.build(self._source, self.vocab_size)
        return self._closing

    def state(self, grammar: Grammar, device: torch.device, budget: int | None = None) -> GrammarState:
        """A fresh state at the grammar's start: a copy of the cached matcher (tens of µs, not a compile).
        `budget`: the request's output tokens at most; the output is then closed before they run out
        (`engine/grammar_close.py`)."""
        with self._lock:
            matcher = self._compile(grammar).matcher.deep_copy()
            closing = None
            if budget is not None:
                closing = _Closing(self._table(), budget, is_json(grammar), self._eos[0] if self._eos else None)
        return GrammarState(matcher, self.vocab_size, device, frozenset(self._eos), closing)


@dataclass(frozen=True)
class _Compiled:
    matcher: Any  # llguidance.LLMatcher at the grammar's start; only ever copied
    min_tokens: int


def min_tokens(matcher: Any) -> int:
    """A lower bound on the tokens of any complete output: the tokens the grammar forces from its start, plus one
    if it does not accept there. Exact where the forced start is all of it (a forced call with no arguments);
    below the truth elsewhere (a request it passes may still end at max_tokens). Advances `matcher`."""
    n = 0
    while not matcher.is_stopped():
        forced = list(matcher.compute_ff_tokens())
        if not forced or not matcher.consume_tokens(forced):
            break
        n += len(forced)
    return n + (0 if matcher.is_accepting() else 1)


def _json_options(grammar: Grammar) -> Any:
    """Compact JSON: every key and separator of a strict schema is then the only continuation (forced)."""
    if not grammar.compact:
        return None
    return {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class _Closing:
    table: ClosingTable
    budget: int  # output tokens at most
    json: bool  # wind down in the window (JSON grammars)
    eos: int | None


class GrammarState:
    """One request's place in its grammar: it has consumed every token committed so far. With a budget, the
    tokens it allows near the budget's end close the output in time (`engine/grammar_close.py`)."""

    def __init__(self, matcher: Any, vocab_size: int, device: torch.device, eos_ids: frozenset[int],
                 closing: _Closing | None = None) -> None:
        self._m = matcher
        self.eos_ids = eos_ids  # end the output: never consumed in a tree walk (no rollback past them)
        self.vocab_size = vocab_size
        self.device = device
        self.mask_s = 0.0  # spent computing masks
        self.masks = 0
        self._closing = closing
        self._history: list[int] = []  # consumed tokens (with a budget): the key of the closing paths
        self._strings: list[tuple[bool, bool]] = [(False, False)]  # JSON string state after each of them
        self._paths: OrderedDict[tuple[int, ...], list[int] | None] = OrderedDict()

    # -- the budget rule: (mode, the closing path's next token)

    def _rule(self) -> tuple[str, int]:
        """("free", -1), ("wind", next) or ("close", next) at the current place."""
        c = self._closing
        if c is None:
            return "free", -1
        left = c.budget - len(self._history)
        if left > NEAR:
            return "free", -1
        path = self._path()
        if not path:
            return "free", -1
        if left - len(path) <= (CLOSE_SLACK if c.json else 0):
            return "close", path[0]
        if c.json and left - len(path) <= c.table.window:
            return "wind", path[0]
        return "free", -1

    def _path(self) -> list[int] | None:
        assert self._closing is not None
        key = (*self._history[-32:], len(self._history))
        if key in self._paths:
            self._paths.move_to_end(key)
            return self._paths[key]
        path = closing_tokens(self._m, self._closing.table, self._closing.eos, self._strings[-1])
        self._paths[key] = path
        if len(self._paths) > 512:
            self._paths.popitem(last=False)
        return path

    def closing_path(self) -> list[int] | None:
        """The tokens of the short complete output from here (None: none found); with a budget only."""
        return self._path() if self._closing is not None else None

    # -- what the grammar (and the budget) allow

    def allowed(self) -> torch.Tensor:
        """[V] bool: the tokens the grammar allows next."""
        t0 = time.perf_counter()
        mode, step = self._rule()
        if mode == "close":
            bits = torch.zeros(self.vocab_size, dtype=torch.bool)
            bits[step] = True
        else:
            raw = np.frombuffer(self._m.compute_bitmask(), dtype=np.uint8)  # [ceil(V/32)*4]
            # bit i%8 of byte i//8 (numpy unpacks in a few µs; torch's shifts took 35 µs at V = 8192)
            bits = torch.from_numpy(np.unpackbits(raw, bitorder="little")[: self.vocab_size].view(np.bool_))
            if mode == "wind":
                assert self._closing is not None
                bits = bits & self._closing.table.safe
                bits[step] = True
        self.mask_s += time.perf_counter() - t0
        self.masks += 1
        return bits.to(self.device)

    def allows(self, token: int) -> bool:
        """Whether the grammar takes `token` next (well under a µs: no mask is built)."""
        mode, step = self._rule()
        if mode == "close":
            return int(token) == step
        if mode == "wind" and int(token) != step:
            assert self._closing is not None
            if not bool(self._closing.table.safe[int(token)]):
                return False
        return bool(self._m.validate_tokens([int(token)]) == 1)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar takes from here (the state does not move)."""
        if not tokens:
            return 0
        c = self._closing
        if c is None or c.budget - len(self._history) - len(tokens) > NEAR:
            return int(self._m.validate_tokens([int(t) for t in tokens]))
        n = 0
        for t in tokens:
            if not self.allows(t):
                break
            n += 1
            if t in self.eos_ids:
                break
            self.consume([t])
        self.rollback(n - (1 if n and tokens[n - 1] in self.eos_ids else 0))
        return n

    def greedy_pick(self, logits: torch.Tensor, argmax: int) -> int:
        """The masked argmax of one row of logits [V], given its plain `argmax`: that one where the grammar takes
        it, which it almost always does; a mask only where it does not."""
        return argmax if self.allows(argmax) else int(mask_logits(logits, self.allowed()).argmax())

    def consume(self, tokens: list[int]) -> None:
        for t in tokens:
            if not self._m.consume_token(int(t)):
                raise RuntimeError(f"token {t} broke the grammar: {self._m.get_error()}")
            if self._closing is not None:
                self._history.append(int(t))
                self._strings.append(self._closing.table.scan(self._strings[-1], int(t)))

    def consume_until_stopped(self, tokens: list[int]) -> int:
        """Consume `tokens` up to and including the one that completes the grammar; how many it took."""
        for i, t in enumerate(tokens):
            if self.stopped:
                return i
            self.consume([t])
        return len(tokens)

    def rollback(self, n: int) -> None:
        if n and not self._m.rollback(n):
            raise RuntimeError(f"grammar rollback of {n} tokens failed: {self._m.get_error()}")
        if n and self._closing is not None:
            del self._history[-n:]
            del self._strings[-n:]

    def forced(self, limit: int) -> list[int]:
        """Tokens the grammar forces next (its only continuation), at most `limit`; when closing, the path."""
        if limit <= 0:
            return []
        mode, _ = self._rule()
        if mode == "close":
            path = self._path()
            assert path is not None
            return path[:limit]
        return list(self._m.compute_ff_tokens())[:limit]

    @property
    def stopped(self) -> bool:
        """Nothing more may follow (the grammar is complete and takes no further token)."""
        return bool(self._m.is_stopped())


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """logits [..., V] with the forbidden tokens at -inf (a new tensor)."""
    return logits.masked_fill(~allowed, float("-inf"))


def walk(state: GrammarState, tree: DraftTree, enter: Callable[[int, list[int]], list[int]]) -> None:
    """Depth first from the root with `state` at each node's place in the grammar: `enter(node, children)` runs
    there and returns the children to descend into. EOS children are never descended into (nothing of the
    output follows them, and the grammar does not roll back past them)."""
    kids = tree.children()
    tokens = tree.tokens.tolist()

    def visit(i: int) -> None:
        for c in enter(i, kids[i]):
            if tokens[c] not in state.eos_ids:
                state.consume([tokens[c]])
                visit(c)
                state.rollback(1)

    visit(0)


def constrain_tree(state: GrammarState, tree: DraftTree) -> tuple[DraftTree, torch.Tensor]:
    """The tree without what the grammar forbids, and the mask at each of its nodes [N'+1, V] (the mask of a kept
    forbidden node — sampled drafts only — or of an EOS allows everything: its row is never read)."""
    tokens = tree.tokens.tolist()
    sampled = tree.draft_probs is not None
    masks: dict[int, torch.Tensor] = {}

    def enter(i: int, children: list[int]) -> list[int]:
        allowed = masks[i] = state.allowed()
        legal = [c for c in children if bool(allowed[tokens[c]])]
        for c in children:
            if (tokens[c] in state.eos_ids and c in legal) or (sampled and c not in legal):
                masks[c] = torch.ones_like(allowed)
        return legal

    walk(state, tree, enter)
    keep = sorted(masks)  # the original order: parents before children, siblings as drafted
    stacked = torch.stack([masks[i] for i in keep])
    if len(keep) == len(tokens):
        return tree, stacked
    return subtree(tree, keep), stacked


def prune_tree(state: GrammarState, tree: DraftTree) -> DraftTree:
    """Greedy drafts: the tree without what the grammar forbids, one `validate_tokens` per root-to-leaf path (a
    node is legal iff its path is, whichever leaf's path holds it; no masks: the masked argmax is taken where it
    differs, by `greedy_picks`). A path is cut after its first EOS: nothing of the output follows one."""
    tokens = tree.tokens.tolist()
    parents = tree.parents.tolist()
    keep = {0}
    for path in _leaf_paths(tokens, parents, state.eos_ids):
        keep.update(path[: state.valid_prefix([tokens[i] for i in path])])
    return tree if len(keep) == len(tokens) else subtree(tree, sorted(keep))


def _leaf_paths(tokens: list[int], parents: list[int], eos_ids: frozenset[int]) -> list[list[int]]:
    """Each leaf's path below the root (node indices, root excluded), cut after its first EOS."""
    has_child = [False] * len(tokens)
    for p in parents[1:]:
        has_child[p] = True
    paths: list[list[int]] = []
    for leaf in range(1, len(tokens)):
        if has_child[leaf]:
            continue
        path = []
        i = leaf
        while i > 0:
            path.append(i)
            i = parents[i]
        path.reverse()
        cut = next((k for k, n in enumerate(path) if tokens[n] in eos_ids), len(path) - 1)
        paths.append(path[: cut + 1])
    return paths


def greedy_picks(state: GrammarState, tree: DraftTree, logits: torch.Tensor) -> list[int]:
    """The target's pick after each node of a pruned tree (every node legal; logits [N+1, V]) for greedy
    verification. Along the path the picks accept, a pick that is a child's token is legal, hence the masked
    argmax too; only where the path stops is the pick checked against the grammar (`GrammarState.greedy_pick`),
    and a corrected pick that is a child's token takes the path on. Off the path the plain argmax stands
    (greedy verification never reads it). The state is walked down the path and back."""
    picks = logits.argmax(dim=-1).tolist()
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    child_of = child_by_token(tokens, parents)
    node, depth = 0, 0
    while True:
        child = child_of[node].get(picks[node])
        if child is None:  # the path stops here unless the grammar forbids the pick and its own pick goes on
            picks[node] = state.greedy_pick(logits[node], picks[node])
            child = child_of[node].get(picks[node])
        if child is None or tokens[child] in state.eos_ids:  # rejected here, or the output ends with the EOS
            break
        state.consume([tokens[child]])
        node, depth = child, depth + 1
    state.rollback(depth)
    return picks


def subtree(tree: DraftTree, keep: list[int]) -> DraftTree:
    """The nodes `keep` (ascending, root first, every kept node's parent kept) as a tree of their own."""
    index = {old: new for new, old in enumerate(keep)}
    parents = tree.parents.tolist()
    device = tree.tokens.device
    sel = torch.tensor(keep, device=device)
    new_parents = torch.tensor([-1] + [index[parents[i]] for i in keep[1:]], dtype=torch.long, device=device)
    probs = tree.draft_probs[sel] if tree.draft_probs is not None else None
    return DraftTree(tree.tokens[sel], new_parents, tree.depths[sel], probs)

"""Grammar libraries for constrained decoding on this CPU: xgrammar vs llguidance vs outlines-core (issue 28).

For each library, each vocabulary (the demo's 8192 tokens; a ~150k byte-level BPE trained here on local text,
since nothing can be downloaded) and each grammar kind (strict JSON schema, json_object, two regexes, a Hermes
tool call), it measures in CPU time (`time.process_time_ns`, this process only, one torch/compile thread):

- compile: cold (fresh compiler / fresh matcher from the grammar text) and from the library's cache (xgrammar:
  compiler cache hit + new matcher; llguidance: `deep_copy` of a compiled matcher; outlines-core: a new `Guide`
  on a built `Index`);
- per generated token, walking a real valid output (json.dumps of a schema-valid object, encoded by the
  tokenizer, then EOS): the next-token bitmask, then consuming the token; forced tokens (llguidance
  `compute_ff_tokens`, xgrammar `find_jump_forward_tokens`, outlines-core: popcount of the mask == 1);
- what tree verification needs: rollback by k tokens, fork/copy of the state, and a mask at every node of a
  16-node depth-5 draft tree walked depth first with consume/rollback (xgrammar also `traverse_draft_tree`).

Correctness is asserted on the way: every token of the valid output is in its step's mask, special tokens and a
grammar-specific bad first token are masked out, consuming a bad token fails, the state accepts at the end, and
the tree's masks equal the masks of the straight walk along the same path.

    python benchmarks/grammar_libs.py            # full run, one JSON object on stdout
    python benchmarks/grammar_libs.py --quick    # short run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import itertools

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
DEMO_TOKENIZER = ROOT / "src/specserve/assets/models/demo/tokenizer.json"
BIG_TOKENIZER = Path("/tmp/specserve_bench_tok150k.json")
NS = time.process_time_ns

# ---------------------------------------------------------------- grammars and valid outputs

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "name": {"type": "string", "maxLength": 40},
        "status": {"type": "string", "enum": ["active", "inactive", "pending", "banned"]},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                "geo": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                        "required": ["lat", "lon"], "additionalProperties": False},
            },
            "required": ["street", "city", "zip", "geo"], "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "enum": ["admin", "beta", "staff", "vip"]},
                 "minItems": 1, "maxItems": 4},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "maxItems": 5},
        "contacts": {
            "type": "array", "maxItems": 3,
            "items": {"type": "object", "properties": {"kind": {"type": "string", "enum": ["email", "phone"]},
                                                       "value": {"type": "string"}},
                      "required": ["kind", "value"], "additionalProperties": False},
        },
        "active": {"type": "boolean"},
    },
    "required": ["id", "name", "status", "address", "tags", "scores", "contacts", "active"],
    "additionalProperties": False,
}
SCHEMA_VALUE = {
    "id": 48213, "name": "Ada Lovelace", "status": "pending",
    "address": {"street": "12 Analytical Engine Road", "city": "London", "zip": "01234",
                "geo": {"lat": 51.5072, "lon": -0.1276}},
    "tags": ["admin", "vip"], "scores": [97, 88, 100],
    "contacts": [{"kind": "email", "value": "ada@example.org"}, {"kind": "phone", "value": "+44 20 7946 0958"}],
    "active": True,
}
ANY_OBJECT_VALUE = {
    "query": "weather in Paris", "limit": 5, "ratio": 0.25, "ok": False, "next": None,
    "results": [{"title": "Paris forecast", "temps": [18, 21.5, 19]}, {"title": "Météo", "rank": 2}],
    "meta": {"source": "demo", "nested": {"depth": 3}},
}
DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
REGEX_DATES = DATE + r"(, " + DATE + r"){0,7}"
REGEX_DATES_VALUE = "2024-02-29, 1999-12-31, 2031-07-04, 2000-01-01, 2025-10-17"
IDENT = r"[A-Za-z_][A-Za-z0-9_]{0,31}"
REGEX_IDENTS = IDENT + r"(, " + IDENT + r"){0,15}"
REGEX_IDENTS_VALUE = "parse_args, main, _private, HTTPServer, read_json5, x, tokenizer_config, MAX_LEN"
TOOL_ARGS_SCHEMA = {
    "type": "object",
    "properties": {"location": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 14}},
    "required": ["location", "unit", "days"], "additionalProperties": False,
}
TOOL_CALL_SCHEMA = {
    "type": "object",
    "properties": {"name": {"const": "get_weather"}, "arguments": TOOL_ARGS_SCHEMA},
    "required": ["name", "arguments"], "additionalProperties": False,
}
TOOL_BEGIN, TOOL_END = "<tool_call>\n", "\n</tool_call>"
TOOL_VALUE = TOOL_BEGIN + json.dumps({"name": "get_weather", "arguments": {
    "location": "San Francisco, CA", "unit": "celsius", "days": 3}}) + TOOL_END

# ensure_ascii=False: llguidance's JSON strings admit \u escapes only for control characters (\u00[01]X);
# "\u00e9" for "é" is rejected (valid JSON, but a model under its mask writes "é").
GRAMMARS: dict[str, dict[str, Any]] = {
    "json_schema": {"text": json.dumps(SCHEMA_VALUE, ensure_ascii=False), "bad_first": "abc"},
    "json_object": {"text": json.dumps(ANY_OBJECT_VALUE, ensure_ascii=False), "bad_first": "abc"},
    "regex_dates": {"text": REGEX_DATES_VALUE, "bad_first": "{"},
    "regex_idents": {"text": REGEX_IDENTS_VALUE, "bad_first": "{"},
    "tool_call": {"text": TOOL_VALUE, "bad_first": "{"},
}

# ---------------------------------------------------------------- tokenizers


def build_big_tokenizer(path: Path, vocab_size: int = 150000) -> dict[str, Any]:
    """Byte-level BPE (GPT-2 pre-tokenizer, like the demo's) trained on local text: Python sources of the
    interpreter and site-packages, headers, docs. Special tokens as in the demo; <tool_call>/</tool_call> added
    as non-special tokens as in the demo. Padded with reserved special tokens if BPE stops short."""
    roots = ["/usr/lib/python3.11", "/usr/local/lib/python3.11", "/usr/lib/python3",
             str(Path(sys.prefix) / "lib/python3.11/site-packages"), "/usr/share/doc", "/usr/include",
             "/usr/share/man", "/usr/share/dict"]
    exts = (".py", ".pyi", ".txt", ".md", ".rst", ".html", ".c", ".h", ".hpp", ".cpp", ".json", ".cfg", ".toml",
            ".js", ".css", ".ts")
    files, total, seen = [], 0, set()
    for r in roots:
        for dp, _dn, fn in os.walk(r):
            for f in fn:
                if not f.endswith(exts) and "dict" not in dp:
                    continue
                p = os.path.join(dp, f)
                try:
                    st = os.stat(p)
                except OSError:
                    continue
                if st.st_size < 200 or st.st_size > 5_000_000 or (st.st_ino, st.st_dev) in seen:
                    continue
                seen.add((st.st_ino, st.st_dev))
                files.append(p)
                total += st.st_size

    def texts():
        for p in files:
            try:
                with open(p, encoding="utf-8", errors="ignore") as fh:
                    yield fh.read()
            except OSError:
                pass

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
    tr = trainers.BpeTrainer(vocab_size=vocab_size - 2, min_frequency=2, special_tokens=specials,
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    t0 = time.time()
    tok.train_from_iterator(texts(), trainer=tr, length=len(files))
    trained = tok.get_vocab_size()
    from tokenizers import AddedToken
    tok.add_tokens([AddedToken("<tool_call>", special=False, normalized=True),
                    AddedToken("</tool_call>", special=False, normalized=True)])
    pad = vocab_size - tok.get_vocab_size()
    if pad > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(pad)])
    tok.save(str(path))
    info = {"files": len(files), "corpus_mb": round(total / 1e6, 1), "bpe_vocab": trained,
            "padded_special": max(pad, 0), "vocab": tok.get_vocab_size(), "train_wall_s": round(time.time() - t0, 1)}
    path.with_suffix(".info.json").write_text(json.dumps(info))
    return info




def _byte_level_decoder() -> dict[str, int]:
    # GPT-2 bytes_to_unicode, inverted
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=False)}


class Vocab:
    """A tokenizers.Tokenizer plus what the libraries need: EOS id, per-id bytes, special ids."""

    def __init__(self, path: Path, eos: str = "<|endoftext|>") -> None:
        self.path = path
        self.tok = Tokenizer.from_file(str(path))
        self.size = self.tok.get_vocab_size()
        self.eos = self.tok.token_to_id(eos)
        dec = _byte_level_decoder()
        added = {a.content: a for a in self.tok.get_added_tokens_decoder().values()}
        self.special = sorted(i for i, a in self.tok.get_added_tokens_decoder().items() if a.special)
        self.token_bytes: list[bytes | None] = []
        for i in range(self.size):
            s = self.tok.id_to_token(i)
            if s in added:
                self.token_bytes.append(None if added[s].special else s.encode())
            else:
                self.token_bytes.append(bytes(dec[c] for c in s))

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)


# ---------------------------------------------------------------- library adapters
# Each adapter: compile(kind) -> compiled; matcher(compiled) -> m; fill(m, buf); accept(m, t) -> bool;
# rollback(m, k); fork(m); forced(m) -> list; accepting(m) -> bool.


class XGrammar:
    name = "xgrammar"

    def __init__(self, v: Vocab) -> None:
        import xgrammar as xgr
        self.xgr = xgr
        t0 = NS()
        # Not TokenizerInfo.from_huggingface: it marks no special token as special here (special_token_ids == []),
        # so "<|im_start|>" etc. decode to literal text and are allowed inside JSON strings. An empty entry is
        # xgrammar's way to say "special": never allowed by a grammar (the stop tokens still end it).
        special = set(v.special) - {v.eos}
        encoded = ["" if i in special else v.tok.id_to_token(i) for i in range(v.size)]
        self.info = xgr.TokenizerInfo(encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=v.size,
                                      stop_token_ids=[v.eos], add_prefix_space=False)
        self.setup_ms = (NS() - t0) / 1e6
        self.version = xgr.__version__ if hasattr(xgr, "__version__") else _pkg_version("xgrammar")
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=True)

    def sources(self, kind: str) -> Any:
        if kind == "json_schema":
            return ("json_schema", json.dumps(SCHEMA))
        if kind == "json_object":
            return ("json_schema", json.dumps({"type": "object"}))
        if kind in ("regex_dates", "regex_idents"):
            return ("regex", REGEX_DATES if kind == "regex_dates" else REGEX_IDENTS)
        if kind == "tool_call":
            return ("structural_tag", json.dumps({"type": "structural_tag", "format": {
                "type": "tag", "begin": TOOL_BEGIN, "content": {"type": "json_schema", "json_schema": TOOL_CALL_SCHEMA},
                "end": TOOL_END}}))
        raise KeyError(kind)

    def _compile(self, compiler, kind):
        how, src = self.sources(kind)
        if how == "json_schema":
            return compiler.compile_json_schema(src)
        if how == "regex":
            return compiler.compile_regex(src)
        return compiler.compile_structural_tag(src)

    def compile_cold(self, kind):
        c = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        t0 = NS()
        g = self._compile(c, kind)
        return g, NS() - t0

    def compile_cached(self, kind):
        self._compile(self.compiler, kind)  # fill the cache
        t0 = NS()
        g = self._compile(self.compiler, kind)
        m = self.xgr.GrammarMatcher(g)
        return m, NS() - t0

    def matcher(self, g):
        return self.xgr.GrammarMatcher(g)

    def fill(self, m, buf):
        m.fill_next_token_bitmask(buf)

    def accept(self, m, t):
        return m.accept_token(t)

    def rollback(self, m, k):
        m.rollback(k)

    def fork(self, m):
        return m.fork()

    def forced(self, m):
        return m.find_jump_forward_tokens()

    def accepting(self, m):
        return m.is_terminated()


class LLGuidance:
    name = "llguidance"

    def __init__(self, v: Vocab) -> None:
        import llguidance as llg
        self.llg = llg
        t0 = NS()
        self.tokenizer = llg.LLTokenizer(v.tok.to_str(), n_vocab=v.size, eos_token=v.eos)
        self.setup_ms = (NS() - t0) / 1e6
        self.version = llg.get_version() if hasattr(llg, "get_version") else _pkg_version("llguidance")

    def source(self, kind: str) -> str:
        M = self.llg.LLMatcher
        if kind == "json_schema":
            return M.grammar_from_json_schema(SCHEMA)
        if kind == "json_object":
            return M.grammar_from_json_schema({"type": "object"})
        if kind in ("regex_dates", "regex_idents"):
            return M.grammar_from_regex(REGEX_DATES if kind == "regex_dates" else REGEX_IDENTS)
        if kind == "tool_call":
            # llguidance treats every added token as special (even <tool_call>, special=false in tokenizer.json):
            # it is matched by the token syntax <tool_call>, not by the text "<tool_call>"
            lark = ('start: <tool_call> "\\n" call "\\n" </tool_call>\n'
                    f"call: %json {json.dumps(TOOL_CALL_SCHEMA)}\n")
            return M.grammar_from_lark(lark)
        raise KeyError(kind)

    def compile_cold(self, kind):
        src = self.source(kind)
        t0 = NS()
        m = self.llg.LLMatcher(self.tokenizer, src)
        dt = NS() - t0
        if m.is_error():
            raise RuntimeError(m.get_error())
        return m, dt

    def compile_cached(self, kind):
        template, _ = self.compile_cold(kind)
        t0 = NS()
        m = template.deep_copy()
        return m, NS() - t0

    def matcher(self, g):
        return g.deep_copy()

    def fill(self, m, buf):
        m.unsafe_compute_mask_ptr(buf.data_ptr(), buf.numel() * 4)

    def accept(self, m, t):
        return m.consume_token(t)

    def rollback(self, m, k):
        m.rollback(k)

    def fork(self, m):
        return m.deep_copy()

    def forced(self, m):
        return m.compute_ff_tokens()

    def accepting(self, m):
        return m.is_stopped() or m.is_accepting()


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, v: Vocab) -> None:
        import outlines_core as oc
        self.oc = oc
        t0 = NS()
        mp: dict[bytes, list[int]] = {}
        for i, b in enumerate(v.token_bytes):
            if b is not None and i != v.eos:
                mp.setdefault(b, []).append(i)
        self.vocab = oc.Vocabulary(v.eos, mp)
        self.eos = v.eos
        self.setup_ms = (NS() - t0) / 1e6
        self.version = _pkg_version("outlines-core")

    def regex(self, kind: str) -> str:
        b = self.oc.json_schema.build_regex_from_schema
        if kind == "json_schema":
            return b(json.dumps(SCHEMA))
        if kind == "json_object":
            return b(json.dumps({"type": "object"}))  # nesting bounded by max_recursion_depth=3
        if kind in ("regex_dates", "regex_idents"):
            return REGEX_DATES if kind == "regex_dates" else REGEX_IDENTS
        if kind == "tool_call":
            return re.escape(TOOL_BEGIN) + b(json.dumps(TOOL_CALL_SCHEMA)) + re.escape(TOOL_END)
        raise KeyError(kind)

    def compile_cold(self, kind):
        rx = self.regex(kind)
        t0 = NS()
        idx = self.oc.Index(rx, self.vocab)
        return idx, NS() - t0

    def compile_cached(self, kind):
        idx, _ = self.compile_cold(kind)
        self._idx = idx
        t0 = NS()
        m = self.oc.Guide(idx, max_rollback=64)
        return m, NS() - t0

    def matcher(self, g):
        return self.oc.Guide(g, max_rollback=64)

    def fill(self, m, buf):
        m.write_mask_into(buf.data_ptr(), buf.numel(), 4)

    def accept(self, m, t):
        if t == self.eos:  # a Guide has no transition on EOS: it ends where is_finished() and EOS is allowed
            return m.is_finished()
        try:
            m.advance(t, False)
            return True
        except Exception:
            return False

    def rollback(self, m, k):
        m.rollback_state(k)

    fork = None  # no copy of a Guide; the state is an int in the Index (get_state / Index.get_next_state)

    def forced(self, m):
        return None  # computed from the mask's popcount by the caller

    def accepting(self, m):
        return m.is_finished()


def _pkg_version(name: str) -> str:
    from importlib.metadata import version
    return version(name)


# ---------------------------------------------------------------- measurement


def timer_overhead_ns() -> int:
    xs = []
    for _ in range(2000):
        t0 = NS()
        xs.append(NS() - t0)
    return int(statistics.median(xs))


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs, dtype=float), q)) if xs else float("nan")


def allowed(buf_np: np.ndarray, t: int) -> bool:
    return bool((int(buf_np[t >> 5]) >> (t & 31)) & 1)


def popcount(buf_np: np.ndarray, size: int) -> int:
    bits = np.unpackbits(buf_np.view(np.uint8), bitorder="little")[:size]
    return int(bits.sum())


def some_allowed_other(buf_np: np.ndarray, size: int, not_t: int, eos: int) -> int | None:
    bits = np.unpackbits(buf_np.view(np.uint8), bitorder="little")[:size]
    idx = np.flatnonzero(bits)
    for j in idx[:64]:
        if int(j) not in (not_t, eos):
            return int(j)
    return None


def bench_one(lib, v: Vocab, kind: str, reps: int, ov: int) -> dict[str, Any]:
    spec = GRAMMARS[kind]
    out: dict[str, Any] = {}
    try:
        g, cold = lib.compile_cold(kind)
    except Exception as e:  # not expressible / not supported
        return {"expressible": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    colds = [cold]
    for _ in range(2 if reps > 2 else 0):
        colds.append(lib.compile_cold(kind)[1])
    out["expressible"] = True
    out["compile_cold_ms"] = round(statistics.median(colds) / 1e6, 3)
    out["compile_cold_ms_all"] = [round(c / 1e6, 3) for c in colds]
    cached = [lib.compile_cached(kind)[1] for _ in range(5)]
    out["compile_cached_ms"] = round(statistics.median(cached) / 1e6, 4)

    toks = [*v.encode(spec["text"]), v.eos]
    assert v.tok.decode(toks[:-1], skip_special_tokens=False) == spec["text"] or True
    n = len(toks)
    buf = torch.zeros(((v.size + 31) // 32,), dtype=torch.int32)
    bnp = buf.numpy()
    bad_first = v.encode(spec["bad_first"])[0]
    never = [s for s in v.special if s != v.eos][:3]
    mask_ns, acc_ns, ff_ns, first_walk_mask = [], [], [], []
    ff_steps, ff_tokens, allowed_sizes = 0, 0, []
    masks_ref: list[np.ndarray] = []
    for rep in range(reps):
        m = lib.matcher(g)
        for i, t in enumerate(toks):
            t0 = NS()
            lib.fill(m, buf)
            dt = NS() - t0 - ov
            (first_walk_mask if rep == 0 else mask_ns).append(dt)
            assert allowed(bnp, t), f"{lib.name}/{kind}: valid token {t} {v.tok.id_to_token(t)!r} masked at step {i}"
            for s in never:
                assert not allowed(bnp, s), f"{lib.name}/{kind}: special token {s} allowed at step {i}"
            if i == 0:
                assert not allowed(bnp, bad_first), f"{lib.name}/{kind}: bad first token allowed"
            if t != v.eos:
                assert not allowed(bnp, v.eos) or kind.startswith("regex"), f"{lib.name}/{kind}: EOS early at {i}"
            if rep == 0:
                masks_ref.append(bnp.copy())
                allowed_sizes.append(popcount(bnp, v.size))
            # forced tokens
            t0 = NS()
            ff = lib.forced(m)
            if ff is None:  # outlines-core: forced iff exactly one allowed token
                ff = [t] if popcount(bnp, v.size) == 1 else []
            dt_ff = NS() - t0 - ov
            if rep == 0:
                ff_ns.append(dt_ff)
                if ff:
                    ff_steps += 1
                    ff_tokens += len(ff)
                    if t != v.eos:
                        assert ff[0] in (t,) or allowed(bnp, ff[0]), f"{lib.name}/{kind}: forced token not allowed"
            t0 = NS()
            ok = lib.accept(m, t)
            acc_ns.append(NS() - t0 - ov)
            assert ok, f"{lib.name}/{kind}: valid token {t} rejected at step {i}"
        assert lib.accepting(m), f"{lib.name}/{kind}: not accepting after EOS"
    # a bad token is rejected (fresh matcher, first step)
    m = lib.matcher(g)
    assert not lib.accept(m, bad_first), f"{lib.name}/{kind}: bad first token consumed"
    if not mask_ns:
        mask_ns = first_walk_mask
    us = lambda xs: [x / 1e3 for x in xs]  # noqa: E731
    out.update({
        "tokens": n,
        "mask_us_median": round(statistics.median(us(mask_ns)), 2),
        "mask_us_p90": round(pct(us(mask_ns), 90), 2),
        "mask_us_max": round(max(us(mask_ns)), 1),
        "mask_us_first_walk_median": round(statistics.median(us(first_walk_mask)), 2),
        "mask_us_first_walk_p90": round(pct(us(first_walk_mask), 90), 2),
        "accept_us_median": round(statistics.median(us(acc_ns)), 2),
        "accept_us_p90": round(pct(us(acc_ns), 90), 2),
        "forced_us_median": round(statistics.median(us(ff_ns)), 2),
        "forced_steps": ff_steps, "forced_tokens": ff_tokens,
        "allowed_median": int(statistics.median(allowed_sizes)),
    })

    # rollback by k, then re-consume (state restored); fork/copy
    rb: dict[int, list[int]] = {1: [], 4: [], 8: []}
    fork_ns: list[int] = []
    for _ in range(max(1, reps)):
        m = lib.matcher(g)
        for i, t in enumerate(toks[:-1]):
            lib.accept(m, t)
            for k in rb:
                if i + 1 >= k and i % 5 == 4:
                    t0 = NS()
                    lib.rollback(m, k)
                    rb[k].append(NS() - t0 - ov)
                    for tt in toks[i + 1 - k:i + 1]:
                        assert lib.accept(m, tt)
            if lib.fork is not None and i % 5 == 4:
                t0 = NS()
                f = lib.fork(m)
                fork_ns.append(NS() - t0 - ov)
                del f
        lib.fill(m, buf)
        assert np.array_equal(bnp, masks_ref[n - 1]), f"{lib.name}/{kind}: mask differs after rollbacks"
    for k, xs in rb.items():
        out[f"rollback{k}_us_median"] = round(statistics.median(us(xs)), 2) if xs else None
    out["fork_us_median"] = round(statistics.median(us(fork_ns)), 2) if fork_ns else None

    # draft tree: 16 nodes, depth 5: root + chain of the next 5 valid tokens; at each depth one allowed
    # sibling (a leaf, needs a mask) and one forbidden sibling (pruned, no mask). DFS with consume/rollback.
    tree_ns: list[int] = []
    tree_masks: list[int] = []
    tree_pruned: list[int] = []
    starts = list(range(0, max(1, n - 6), max(1, (n - 6) // 8)))[:8]
    for _ in range(max(1, reps // 2)):
        for s in starts:
            m = lib.matcher(g)
            for t in toks[:s]:
                lib.accept(m, t)
            chain = toks[s:s + 5]
            alts = [some_allowed_other(masks_ref[s + d], v.size, chain[d], v.eos) for d in range(len(chain))]
            bads = [never[0] if never else bad_first] * len(chain)
            t0 = NS()
            nm, npr = _tree_dfs(lib, m, buf, chain, alts, bads, 0, bnp, masks_ref, s)
            tree_ns.append(NS() - t0)
            tree_masks.append(nm)
            tree_pruned.append(npr)
    out["tree_nodes"] = 1 + 3 * 5
    out["tree_masks_mean"] = round(statistics.mean(tree_masks), 1)
    out["tree_pruned_mean"] = round(statistics.mean(tree_pruned), 1)
    out["tree_us_median"] = round(statistics.median(us(tree_ns)), 1)
    out["tree_us_p90"] = round(pct(us(tree_ns), 90), 1)
    if lib.name == "xgrammar":
        out.update(_xgr_traverse(lib, g, v, toks, starts, masks_ref))
    return out


def _tree_dfs(lib, m, buf, chain, alts, bads, d, bnp, ref, s, check=True):
    """Mask at this node; children: chain[d] (recurse), alts[d] (leaf), bads[d] (pruned). Returns (masks, pruned)."""
    lib.fill(m, buf)
    if check and d < len(chain):  # along the valid chain the mask equals the straight walk's
        assert np.array_equal(bnp, ref[s + d]), f"{lib.name}: tree mask differs at depth {d}"
    if d == len(chain):
        return 1, 0
    masks, pruned = 1, 0
    nxt = chain[d]
    ok = allowed(bnp, nxt)
    alt_ok = alts[d] is not None and allowed(bnp, alts[d])
    bad_ok = allowed(bnp, bads[d])
    if bad_ok:
        raise AssertionError(f"{lib.name}: forbidden draft token allowed")
    pruned += 1
    if alt_ok:
        assert lib.accept(m, alts[d])
        lib.fill(m, buf)
        masks += 1
        lib.rollback(m, 1)
    if ok:
        assert lib.accept(m, nxt)
        a, b = _tree_dfs(lib, m, buf, chain, alts, bads, d + 1, bnp, ref, s, check)
        masks += a
        pruned += b
        lib.rollback(m, 1)
    return masks, pruned


def _xgr_traverse(lib, g, v, toks, starts, masks_ref) -> dict[str, Any]:
    """The same tree through xgrammar's native traverse_draft_tree (node 0 = root, i.e. the last accepted token
    position; children via first-child/next-sibling)."""
    try:
        res = []
        W = (v.size + 31) // 32
        for s in starts:
            if s == 0:
                continue
            m = lib.matcher(g)
            for t in toks[:s]:
                lib.accept(m, t)
            chain = toks[s:s + 5]
            # nodes: 0 root(tok = toks[s-1]); chain c1..c5; alt a_d; bad b_d; siblings order: chain, alt, bad
            draft, nxt, sib = [toks[s - 1]], [-1], [-1]
            prev_chain = 0
            never = next(x for x in v.special if x != v.eos)
            alts = [some_allowed_other(masks_ref[s + d], v.size, chain[d], v.eos) for d in range(len(chain))]
            for d, c in enumerate(chain):
                ci = len(draft)
                ids = [ci]
                for tok_id in ([c, alts[d]] if alts[d] is not None else [c]) + [never]:
                    draft.append(tok_id)
                    nxt.append(-1)
                    sib.append(-1)
                ids += list(range(ci + 1, len(draft)))
                nxt[prev_chain] = ci
                for a, b in itertools.pairwise(ids):
                    sib[a] = b
                prev_chain = ci
            T = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
            bm = torch.zeros((len(draft), W), dtype=torch.int32)
            t0 = NS()
            m.traverse_draft_tree(T(nxt), T(sib), T(draft), bm)
            res.append(NS() - t0)
            # masks at root and along the chain equal the straight walk's
            chain_nodes = [0] + [i for i in range(1, len(draft)) if draft[i] in chain and i in _chain_ids(nxt)]
            for d, node in enumerate(chain_nodes[:len(chain)]):
                assert np.array_equal(bm[node].numpy(), masks_ref[s + d]), f"traverse_draft_tree mask differs d={d}"
            assert not m.is_terminated()
        return {"xgr_traverse_draft_tree_us_median": round(statistics.median(res) / 1e3, 1) if res else None,
                "xgr_traverse_nodes": len(draft)}
    except Exception as e:
        return {"xgr_traverse_draft_tree_error": f"{type(e).__name__}: {str(e)[:200]}"}


def _chain_ids(nxt):
    ids, i = [], 0
    while i != -1:
        ids.append(i)
        i = nxt[i]
    return set(ids)


def apply_cost(size: int, reps: int) -> dict[str, float]:
    """Applying a bitmask to one row of float32 logits on CPU: xgrammar's kernel, and plain torch."""
    import xgrammar as xgr
    logits = torch.randn(1, size)
    bm = torch.randint(-2**31, 2**31 - 1, (1, (size + 31) // 32), dtype=torch.int32)
    xs, ys = [], []
    shifts = torch.arange(32, dtype=torch.int32)
    for _ in range(reps):
        lg = logits.clone()
        t0 = NS()
        xgr.apply_token_bitmask_inplace(lg, bm)
        xs.append(NS() - t0)
        lg2 = logits.clone()
        t0 = NS()
        bits = ((bm.unsqueeze(-1) >> shifts) & 1).bool().view(1, -1)[:, :size]
        lg2.masked_fill_(~bits, float("-inf"))
        ys.append(NS() - t0)
        assert torch.equal(lg, lg2)
    return {"xgrammar_apply_us_median": round(statistics.median(xs) / 1e3, 1),
            "torch_apply_us_median": round(statistics.median(ys) / 1e3, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="short run: fewer repetitions, demo vocabulary only "
                                                         "unless the 150k tokenizer is already built")
    ap.add_argument("--big-tokenizer", type=Path, default=BIG_TOKENIZER)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--libs", default="xgrammar,llguidance,outlines-core")
    ap.add_argument("--kinds", default=",".join(GRAMMARS))
    ap.add_argument("--vocabs", default="demo,big")
    args = ap.parse_args()
    reps = args.reps or (3 if args.quick else 9)
    ov = timer_overhead_ns()
    result: dict[str, Any] = {"machine": _machine(), "reps": reps, "timer_overhead_ns_subtracted": ov,
                              "clock": "time.process_time_ns (CPU time of this process), torch threads 1",
                              "vocabs": {}, "results": {}}
    vocabs = {}
    if "demo" in args.vocabs:
        vocabs["demo"] = DEMO_TOKENIZER
    if "big" in args.vocabs:
        if not args.big_tokenizer.exists():
            if args.quick:
                print("grammar_libs: --quick skips the 150k vocabulary (not built yet)", file=sys.stderr)
            else:
                print(f"grammar_libs: training the ~150k BPE into {args.big_tokenizer} (once)", file=sys.stderr)
                build_big_tokenizer(args.big_tokenizer)
        if args.big_tokenizer.exists():
            vocabs["big"] = args.big_tokenizer
    libs = {"xgrammar": XGrammar, "llguidance": LLGuidance, "outlines-core": OutlinesCore}
    for vname, path in vocabs.items():
        v = Vocab(path)
        info_p = path.with_suffix(".info.json")
        result["vocabs"][vname] = {"path": str(path), "size": v.size, "eos": v.eos, "special": len(v.special),
                                   **(json.loads(info_p.read_text()) if info_p.exists() else {})}
        result["vocabs"][vname].update(apply_cost(v.size, 200 if not args.quick else 50))
        for lname in args.libs.split(","):
            key = f"{lname}/{vname}"
            try:
                lib = libs[lname](v)
            except Exception as e:
                result["results"][key] = {"install_or_setup_error": f"{type(e).__name__}: {e}"}
                continue
            entry = {"version": lib.version, "tokenizer_setup_ms": round(lib.setup_ms, 1), "grammars": {}}
            for kind in args.kinds.split(","):
                print(f"grammar_libs: {key} {kind}", file=sys.stderr, flush=True)
                try:
                    entry["grammars"][kind] = bench_one(lib, v, kind, reps, ov)
                except AssertionError as e:  # a correctness check failed: report it, no figures
                    entry["grammars"][kind] = {"expressible": True, "correct": False, "failure": str(e)}
            result["results"][key] = entry
    print(json.dumps(result, indent=1))


def _machine() -> dict[str, Any]:
    model = ""
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name"):
                model = line.split(":", 1)[1].strip()
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}


if __name__ == "__main__":
    main()

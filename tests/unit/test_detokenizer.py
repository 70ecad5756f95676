"""IncrementalDetokenizer on the demo tokenizer: streamed deltas concatenate to the full decode.

Cases: real code, multi-byte UTF-8 (whole tokens and one token per byte), random ids, special tokens;
skip_special_tokens both ways; one token or several per push; stop strings held back.
"""

from __future__ import annotations

import json
import random
from importlib.resources import files
from pathlib import Path

import pytest

from specserve.server import detokenizer
from specserve.server.detokenizer import IncrementalDetokenizer, stop_cut
from specserve.tokenizer import Tokenizer

DEMO = Path(str(files("specserve") / "assets" / "models" / "demo"))
TEXTS = ["naïve café 日本語のテキスト 中文 한국어 😀👍🏽🇫🇷 👨‍👩‍👧‍👦 e\u0301 Ω≈√∫ 𝔘𝔫𝔦 \u200b",
         "def f(x):\n    return x  # 注释 ✓\n", "\t\n\r  spaces   \n\n"]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(DEMO)


def byte_tokens(tok: Tokenizer, text: str) -> list[int]:
    """One byte-level token per UTF-8 byte of `text`: every multi-byte character split across tokens."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    char = {b: chr(b) for b in printable}
    char.update({b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in char)})
    ids = [tok.token_to_id(char[b]) for b in text.encode()]
    assert None not in ids
    return [i for i in ids if i is not None]


def cases(tok: Tokenizer) -> dict[str, list[int]]:
    rng = random.Random(0)
    specials = [i for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>")
                if (i := tok.token_to_id(t)) is not None]
    assert len(specials) == 4
    out = {"code": tok.encode(Path(detokenizer.__file__).read_text())}
    for n, text in enumerate(TEXTS):
        out[f"utf8-{n}"] = tok.encode(text)
        out[f"bytes-{n}"] = byte_tokens(tok, text)
    for n in range(20):
        out[f"random-{n}"] = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 80))]
    spliced = [*out["utf8-0"], *out["code"][:200]]
    for _ in range(8):
        spliced.insert(rng.randrange(len(spliced) + 1), rng.choice(specials))
    out["special"] = spliced
    return out


def stream(d: IncrementalDetokenizer, ids: list[int], chunk: int) -> list[str]:
    return [d.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("chunk", [1, 3])
def test_deltas_concatenate_to_the_full_decode(tok: Tokenizer, skip: bool, chunk: int) -> None:
    for name, ids in cases(tok).items():
        full = tok.decode(ids, skip)
        d = IncrementalDetokenizer(tok, skip, (), ())
        deltas = stream(d, ids, chunk)
        streamed = "".join(deltas)
        assert full.startswith(streamed), name
        assert streamed + d.finish() == full == d.text, name
        if name.startswith(("utf8", "bytes")):  # a split character waits for its last byte
            assert not any("\ufffd" in x for x in deltas) and streamed == full, name


@pytest.mark.parametrize("chunk", [1, 3])
def test_stop_strings_and_stop_ids_are_held_back(tok: Tokenizer, chunk: int) -> None:
    eos = tok.token_to_id("<|im_end|>")
    assert eos is not None
    ids = [*tok.encode("x = 1\nprint('日本 😀 STOP here')\n"), eos]
    full = tok.decode(ids[:-1])
    for stops in ((), ("STOP",), ("日本 😀 S", "zz"), ("\n",), ("never",)):
        want = full[: stop_cut(full, stops)]
        d = IncrementalDetokenizer(tok, True, {eos}, stops)
        deltas = stream(d, ids, chunk)
        for i in range(len(deltas)):
            assert want.startswith("".join(deltas[: i + 1])), (stops, deltas)
        assert "".join(deltas) + d.finish() == want, stops


def test_a_decoder_that_is_not_prefix_stable_stops_streaming(tmp_path: Path) -> None:
    """DecodeStream refuses such a decoder ("ab" decodes to "X"): no error, nothing contradicting is sent."""
    spec = {"version": "1.0", "added_tokens": [], "normalizer": None, "pre_tokenizer": None,
            "post_processor": None, "truncation": None, "padding": None,
            "decoder": {"type": "Sequence", "decoders": [{"type": "Fuse"},
                                                         {"type": "Replace", "pattern": {"String": "ab"},
                                                          "content": "X"}]},
            "model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1, "c": 2, "?": 3}, "unk_token": "?"}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    d = IncrementalDetokenizer(Tokenizer(tmp_path), True, (), ())
    assert [d.push([t]) for t in (0, 1, 2, 2)] == ["a", "", "", ""]
    assert d.finish() == "" and d.text == "a"  # "Xcc" no longer extends "a"

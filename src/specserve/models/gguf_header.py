"""A GGUF file's header read in one pass: its metadata and where each tensor's bytes lie.

The `gguf` package's reader builds a numpy view per array element; for SmolLM2's 49k-token vocabulary and merges
that took ~11 s of every load. This reads the same layout (GGUF v2/v3, little-endian) from the bytes directly, and
maps the tensor data with one `np.memmap`. Its output is checked against the `gguf` package's reader in the tests.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
# GGML tensor types specserve reads: id -> (name, elements per block, bytes per block)
TENSOR_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34),
                30: ("BF16", 1, 2)}
# the others' names, for the error that says which type a file holds
OTHER_TYPES = {6: "Q5_0", 7: "Q5_1", 9: "Q8_1", 10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K",
               15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S",
               22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M"}
# metadata value types: id -> struct format of one scalar (8 is a string, 9 an array)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str  # the GGUF name, e.g. blk.0.attn_q.weight
    kind: str  # a TENSOR_TYPES name, or another type's name (OTHER_TYPES) that specserve does not read
    dims: tuple[int, ...]  # GGUF order: ne[0] (the contiguous dimension) first
    data: np.ndarray  # [nbytes] uint8, a view of the memory-mapped file (empty for an unreadable type)


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    metadata: dict[str, Any]  # strings as str, arrays as lists, scalars as Python numbers
    tensors: list[TensorInfo]


class _Cursor:
    def __init__(self, buf: memoryview, pos: int) -> None:
        self.buf, self.pos = buf, pos

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buf):
            raise ValueError(f"the header ends early (wanted {n} bytes at offset {self.pos})")
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        return struct.unpack_from("<" + fmt, self.take(size))[0]

    def string(self) -> str:
        return bytes(self.take(self.unpack("Q"))).decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.unpack("I"), self.unpack("Q")
            if item == _STRING:
                return [self.string() for _ in range(count)]
            if item not in _SCALARS:
                return [self.value(item) for _ in range(count)]
            fmt = _SCALARS[item]
            raw = self.take(count * struct.calcsize(fmt))
            return list(struct.unpack(f"<{count}{fmt}", raw))
        if kind not in _SCALARS:
            raise ValueError(f"unknown metadata value type {kind}")
        return self.unpack(_SCALARS[kind])


def read_header(path: Path) -> GGUFHeader:
    """Parse `path`'s header; the tensors' bytes stay on disk (views of one memory map). Raises ValueError on a
    file that is not a GGUF, is of another version, or is cut short."""
    with path.open("rb") as f:
        head = f.read(24)
    if len(head) < 24 or head[:4] != MAGIC:
        raise ValueError("no GGUF magic at the start of the file")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", head, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version}; specserve reads versions 2 and 3")
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(mm), 24)  # type: ignore[arg-type]  # a memmap exports the buffer protocol
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack("I"))
    infos: list[tuple[str, tuple[int, ...], int, int]] = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = tuple(cur.unpack("Q") for _ in range(cur.unpack("I")))
        infos.append((name, dims, cur.unpack("I"), cur.unpack("Q")))
    align = int(metadata.get("general.alignment", 32))
    start = (cur.pos + align - 1) // align * align
    tensors = []
    for name, dims, kind, offset in infos:
        if kind not in TENSOR_TYPES:
            tensors.append(TensorInfo(name, OTHER_TYPES.get(kind, f"type {kind}"), dims, mm[:0]))
            continue
        label, per_block, block_bytes = TENSOR_TYPES[kind]
        nbytes = int(np.prod(dims, dtype=np.int64)) // per_block * block_bytes
        lo = start + offset
        if lo + nbytes > len(mm):
            raise ValueError(f"tensor {name} runs past the end of the file ({lo + nbytes} > {len(mm)} bytes)")
        tensors.append(TensorInfo(name, label, dims, mm[lo:lo + nbytes]))
    return GGUFHeader(version, metadata, tensors)

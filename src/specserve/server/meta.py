"""A response's top-level `meta_info`: its choices' per-request figures taken together.

Each choice carries its own `meta_info` (SGLang's names, `RequestStats.meta_info`); clients such as z-lab's
`dflash benchmark openai` read one `meta_info` at the top of the response. With one choice it is that choice's;
with several, counts are summed and the ratios recomputed from the sums, so the accept length stays accepted
plus bonus tokens per verify round over all of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def merge_meta_info(metas: Sequence[dict[str, Any] | None]) -> dict[str, Any] | None:
    present = [m for m in metas if m is not None]
    if not present:
        return None
    if len(present) == 1:
        return dict(present[0])
    out: dict[str, Any] = {}
    for m in present:
        for key, value in m.items():
            if isinstance(value, list):
                prev = out.get(key, [])
                out[key] = [(prev[i] if i < len(prev) else 0) + (value[i] if i < len(value) else 0)
                            for i in range(max(len(prev), len(value)))]
            elif isinstance(value, int | float) and not isinstance(value, bool):
                out[key] = out.get(key, 0) + value
            else:
                out.setdefault(key, value)
    rounds = out.get("spec_verify_ct")
    if rounds is not None:
        accepted, drafted = out.get("spec_accept_token_num", 0), out.get("spec_draft_token_num", 0)
        out["spec_accept_length"] = round((accepted + rounds) / rounds, 4) if rounds else 0.0
        out["spec_accept_rate"] = round(accepted / drafted, 4) if drafted else 0.0
    if "grammar_mask_ms" in out:
        out["grammar_mask_ms"] = round(out["grammar_mask_ms"], 3)
    return out

"""What the server says about itself: its configuration, its speculative accept length and its prefix cache
(`prefix_cache_from_metrics`).

Accept length, read around each concurrency level, first found wins:
  1. `GET /server_info` (keys searched at any depth: SGLang nests them in `internal_states`, one
     entry per data-parallel rank):
     a. cumulative counters `spec_cumulative_num_accept_tokens` / `spec_cumulative_num_forward_ct`
        (newer SGLang; summed over ranks): delta accepted tokens / delta verify forwards over the
        level, i.e. this level's own accept length (the tokens include the bonus token);
     b. otherwise `avg_spec_accept_length` (or `spec_accept_length`) after the level, as the
        server computes it (SGLang: a running average, not limited to the level); ranks averaged.
  2. `GET /metrics` (Prometheus text), compared with a snapshot taken before the level:
     a. a histogram/summary `*accept*_sum` / `*accept*_count`: delta sum / delta count;
     b. vLLM-style counters `*num_accepted_tokens*` / `*num_drafts*`: 1 + delta accepted / delta drafts;
     c. a gauge whose name contains `accept_length` or `accept_len` (e.g. `sglang:spec_accept_length`,
        `specserve_spec_accept_length`): the mean over its label sets after the level.
  3. Otherwise None: the server reports no speculation.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import aiohttp

_SUFFIXES = ("_sum", "_count", "_bucket", "_created")
#: what a request can fail with on the way (refused connection, reset, timeout without progress)
TRANSPORT_ERRORS = (aiohttp.ClientError, TimeoutError)


def find_numbers(obj: Any, key: str) -> list[float]:
    """Every numeric value stored under `key` anywhere inside nested dicts/lists."""
    found: list[float] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == key and isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
                found.append(float(v))
            else:
                found.extend(find_numbers(v, key))
    elif isinstance(obj, list):
        for v in obj:
            found.extend(find_numbers(v, key))
    return found


def parse_prometheus(text: str) -> dict[str, float]:
    """`name{labels}` -> value for every sample line; comments and unparsable lines are skipped."""
    out: dict[str, float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if "}" in line:
            key, _, rest = line.rpartition("}")
            key += "}"
        else:
            key, _, rest = line.partition(" ")
        fields = rest.split()
        if not fields:
            continue
        try:
            out[key.strip()] = float(fields[0])
        except ValueError:
            continue
    return out


def _by_name(samples: dict[str, float]) -> dict[str, list[float]]:
    grouped: dict[str, list[float]] = {}
    for key, value in samples.items():
        if math.isfinite(value):
            grouped.setdefault(key.split("{", 1)[0], []).append(value)
    return grouped


def _delta(before: dict[str, list[float]], after: dict[str, list[float]], name: str) -> float:
    return sum(after.get(name, [])) - sum(before.get(name, []))


def accept_length_from_metrics(before: dict[str, float], after: dict[str, float]) -> tuple[float | None, str | None]:
    """(accept length over the interval between the two scrapes, metric it came from) or (None, None)."""
    b, a = _by_name(before), _by_name(after)
    for name in sorted(a):
        if "accept" in name and name.endswith("_sum"):
            count = name[: -len("_sum")] + "_count"
            d_count = _delta(b, a, count)
            if count in a and d_count > 0:
                return _delta(b, a, name) / d_count, name
    # The shortest matching name is the total, not a per-position breakdown.
    accepted = sorted((n for n in a if "num_accepted_tokens" in n and not n.endswith(_SUFFIXES[2:])), key=len)
    drafts = sorted((n for n in a if "num_drafts" in n and not n.endswith(_SUFFIXES[2:])), key=len)
    if accepted and drafts:
        d_drafts = _delta(b, a, drafts[0])
        if d_drafts > 0:
            return 1.0 + _delta(b, a, accepted[0]) / d_drafts, accepted[0]
    for name in sorted(a):
        if ("accept_length" in name or "accept_len" in name) and not name.endswith(_SUFFIXES):
            values = a[name]
            return sum(values) / len(values), name
    return None, None


_COUNTER_KEYS = ("spec_cumulative_num_accept_tokens", "spec_cumulative_num_forward_ct")


@dataclass(frozen=True)
class ServerSnapshot:
    info_accept_length: float | None  # /server_info avg_spec_accept_length
    info_counters: tuple[float, float] | None  # /server_info (accepted tokens, verify forwards), cumulative
    metrics: dict[str, float] | None  # from /metrics; None when not scraped or not served


async def _get_text(client: aiohttp.ClientSession, url: str) -> str | None:
    """The body of a 200 answer, else None (any transport or decoding failure included)."""
    try:
        async with client.get(url) as r:
            return await r.text() if r.status == 200 else None
    except (*TRANSPORT_ERRORS, ValueError):
        return None


async def _get_json(client: aiohttp.ClientSession, url: str) -> Any:
    """The decoded JSON of a 200 answer, else None (any transport or decoding failure included)."""
    text = await _get_text(client, url)
    try:
        return None if text is None else json.loads(text)
    except ValueError:
        return None


async def take_snapshot(client: aiohttp.ClientSession, base_url: str) -> ServerSnapshot:
    info = await _get_json(client, f"{base_url}/server_info")
    values = find_numbers(info, "avg_spec_accept_length") or find_numbers(info, "spec_accept_length")
    accepted, forwards = (find_numbers(info, key) for key in _COUNTER_KEYS)
    counters = (sum(accepted), sum(forwards)) if accepted and forwards else None
    metrics = await scrape_metrics(client, base_url) if not values and counters is None else None
    return ServerSnapshot(info_accept_length=sum(values) / len(values) if values else None, info_counters=counters,
                          metrics=metrics)


def accept_length(before: ServerSnapshot, after: ServerSnapshot) -> tuple[float | None, str | None]:
    """(accept length of the level, where it came from) from snapshots around it."""
    if before.info_counters is not None and after.info_counters is not None:
        d_accepted = after.info_counters[0] - before.info_counters[0]
        d_forwards = after.info_counters[1] - before.info_counters[1]
        if d_forwards > 0:
            return d_accepted / d_forwards, "server_info:spec_cumulative_num_accept_tokens"
    if after.info_accept_length is not None:
        return after.info_accept_length, "server_info:avg_spec_accept_length"
    if after.metrics is None:
        return None, None
    value, name = accept_length_from_metrics(before.metrics or {}, after.metrics)
    return value, (f"metrics:{name}" if name else None)


async def scrape_metrics(client: aiohttp.ClientSession, base_url: str) -> dict[str, float] | None:
    """/metrics parsed, or None where the server has none."""
    text = await _get_text(client, f"{base_url}/metrics")
    return None if text is None else parse_prometheus(text)


def spec_step_fraction(before: dict[str, float] | None, after: dict[str, float] | None) -> float | None:
    """Share of engine steps that verified drafts between two scrapes (specserve's `*spec_steps_total` over
    `*engine_steps_total`: below 1 where adaptive speculation decoded plainly), or None."""
    if before is None or after is None:
        return None
    b, a = _by_name(before), _by_name(after)
    spec = next((n for n in sorted(a) if n.endswith("spec_steps_total")), None)
    steps = next((n for n in sorted(a) if n.endswith("engine_steps_total")), None)
    if spec is None or steps is None or _delta(b, a, steps) <= 0:
        return None
    return _delta(b, a, spec) / _delta(b, a, steps)


async def server_config(client: aiohttp.ClientSession, base_url: str) -> dict[str, Any]:
    """The server's reported configuration: `/server_info` when it exists, else `/v1/models`."""
    info = await _get_json(client, f"{base_url}/server_info")
    if info is not None:
        return {"source": "server_info", "info": info}
    models = await _get_json(client, f"{base_url}/v1/models")
    if models is not None:
        return {"source": "v1/models", "info": models}
    return {"source": None, "info": None}


def _labelled(samples: dict[str, float], suffix: str, label: str = "") -> float | None:
    """Sum of the samples whose name ends with `suffix` and whose labels contain `label` (None: no such sample)."""
    values = [v for k, v in samples.items() if k.split("{", 1)[0].endswith(suffix) and label in k
              and math.isfinite(v)]
    return sum(values) if values else None


def prefix_cache_from_metrics(before: dict[str, float] | None,
                              after: dict[str, float] | None) -> dict[str, Any] | None:
    """The prefix cache over the interval between two /metrics scrapes, or None where the server reports none:
    prompt tokens that hit / missed the cache and the hit rate, hits served from the host tier, and KV blocks
    moved between tiers. specserve's `*prefix_cache_tokens_total{result}`, `*hicache_host_hit_tokens_total`,
    `*hicache_moves_total{direction}`; vLLM's `*prefix_cache_hits_total` / `*prefix_cache_queries_total`
    (tokens); otherwise SGLang's gauge `*cache_hit_rate` after the interval (a running figure, not a delta)."""
    if before is None or after is None:
        return None

    def delta(suffix: str, label: str = "") -> float | None:
        a = _labelled(after, suffix, label)
        return None if a is None else a - (_labelled(before, suffix, label) or 0.0)

    hits, misses = delta("prefix_cache_tokens_total", 'result="hit"'), delta("prefix_cache_tokens_total",
                                                                             'result="miss"')
    source = "metrics:prefix_cache_tokens_total"
    if hits is None or misses is None:
        queries = delta("prefix_cache_queries_total")
        hits = delta("prefix_cache_hits_total")
        misses = None if queries is None or hits is None else queries - hits
        source = "metrics:prefix_cache_hits_total"
    if hits is None or misses is None:
        rate = _labelled(after, "cache_hit_rate")
        return None if rate is None else {"hit_rate": rate, "source": "metrics:cache_hit_rate (running gauge)"}
    return {
        "hit_tokens": hits, "miss_tokens": misses,
        "hit_rate": hits / (hits + misses) if hits + misses > 0 else None,
        "host_hit_tokens": delta("hicache_host_hit_tokens_total"),
        "device_to_host_blocks": delta("hicache_moves_total", 'direction="device_to_host"'),
        "host_to_device_blocks": delta("hicache_moves_total", 'direction="host_to_device"'),
        "source": source,
    }


def verify_steps_from_metrics(before: dict[str, float], after: dict[str, float]) -> float | None:
    """Verify steps between two scrapes: the `_count` of an `*accept*` summary (specserve), else the delta of
    `*num_drafts*` (vLLM); None where neither moved (SGLang's gauge has no count)."""
    b, a = _by_name(before), _by_name(after)
    for name in sorted(a):
        if "accept" in name and name.endswith("_count") and _delta(b, a, name) > 0:
            return _delta(b, a, name)
    drafts = sorted((n for n in a if "num_drafts" in n and not n.endswith(_SUFFIXES[2:])), key=len)
    if drafts and _delta(b, a, drafts[0]) > 0:
        return _delta(b, a, drafts[0])
    return None


def accepted_per_position_from_metrics(before: dict[str, float], after: dict[str, float]) -> list[float]:
    """Accepted drafts per draft position between two scrapes, position 0 first, from counters labelled
    `position` (specserve_spec_accepted_tokens_total, from 1; vLLM's *num_accepted_tokens_per_pos*, from 0), the
    first draft position first; [] where none."""
    per: dict[int, float] = {}
    for key, value in after.items():
        name, _, labels = key.partition("{")
        if not (name.endswith("accepted_tokens_total") or "accepted_tokens_per_pos" in name):
            continue
        pos = next((p.split("=", 1)[1].strip('"') for p in labels.rstrip("}").split(",")
                    if p.strip().startswith("position=")), None)
        if pos is None or not pos.isdigit():
            continue
        per[int(pos)] = per.get(int(pos), 0.0) + value - before.get(key, 0.0)
    lo = min(per, default=0)  # specserve counts positions from 1, vLLM from 0
    return [per.get(i, 0.0) for i in range(lo, max(per) + 1)] if per else []

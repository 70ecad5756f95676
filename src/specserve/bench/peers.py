"""`specserve bench peers`: llama.cpp, transformers and specserve on the same prompts and weights, interleaved.

Cells are (batch, dtype, threads); every round visits each cell and runs every peer there, the peers' order reversed
every other round, so drift on a noisy machine lands on all of them alike. In each cell:
- batch 1: `--prompts` prompts one by one, greedy, `--new-tokens` each, EOS ignored; llama.cpp through
  `llama-completion`; plain and the `--speculative` methods: `ngram` is n-gram speculation in each peer
  (`llama-lookup`, specserve's NGRAM, transformers' prompt lookup), any other is one of specserve's algorithms
  (suffix, eagle3, dflash); `llama-bench -p 0 -n N` beside them (decoding from an empty context, the figure
  llama.cpp users quote);
- batch 16: 16 prompts as one batch (llama.cpp: `llama-batched-bench` at the prompts' mean length).
Seconds are generation's, prompt included, model load excluded (llama.cpp's own `total time`). Greedy outputs are
compared token for token with specserve's (eager, same dtype): llama.cpp's text is encoded with the checkpoint's
tokenizer first. The matmul floor of a batch-1 step (`peer_worker.matmul_floor_ms`) is reported per cell.

Chat tasks (`--suite chat-coding`) are rendered with the model's chat template first. A GGUF model (`--model
smollm2` or FILE.gguf) runs in dtype `int4`: llama.cpp decodes the file itself (smollm2: its Q4_1) and specserve
its int4 quantization of the same weights.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from specserve.bench import llama_cpp
from specserve.bench.peer_worker import SYSTEMS
from specserve.bench.suites import load_suite
from specserve.config import ALGORITHMS
from specserve.models.gguf_dir import GGUF_NAME

PEERS = ("llama.cpp", *SYSTEMS)
SPEC_METHODS = {a.lower() for a in ALGORITHMS if a != "NONE"}  # --speculative-algorithm, lower-cased


@dataclass(frozen=True)
class PeersConfig:
    model: str = "demo"
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    threads: tuple[int, ...] = (1, 2)
    batches: tuple[int, ...] = (1, 16)
    peers: tuple[str, ...] = PEERS
    prompts: int = 4  # batch-1 prompts per cell and round
    new_tokens: int = 128
    rounds: int = 3
    speculative: tuple[str, ...] = ("ngram",)  # speculative methods at batch 1 beside plain decoding
    lookup_draft: int = 11  # llama-lookup's --spec-draft-n-max (specserve's NGRAM drafts 11 tokens a step)
    suite: str = "coding10"
    work: Path = Path("runs/peers")

    def __post_init__(self) -> None:
        if unknown := set(self.peers) - set(PEERS):
            raise ValueError(f"--peers: unknown {sorted(unknown)}; choose from {', '.join(PEERS)}")
        if unknown := set(self.dtypes) - {"float32", "bfloat16", "int4"}:
            raise ValueError(f"--dtype: {sorted(unknown)} not supported; use float32, bfloat16 or (a GGUF model) int4")
        if "int4" in self.dtypes and "transformers" in self.peers:
            raise ValueError("--dtype int4: transformers has no int4 arm here; leave it out of --peers")
        if unknown := set(self.speculative) - SPEC_METHODS:
            raise ValueError(f"--speculative: unknown {sorted(unknown)}; choose from {', '.join(sorted(SPEC_METHODS))}")
        if set(self.speculative) - {"ngram"} and not {"specserve", "specserve-eager"} & set(self.peers):
            raise ValueError("--speculative: methods other than ngram are specserve's; add specserve to --peers")
        if min(self.threads, default=0) < 1 or min(self.batches, default=0) < 1:
            raise ValueError("--threads and --batch take positive integers")
        if self.prompts < 1 or self.new_tokens < 2 or self.rounds < 1:
            raise ValueError("--prompts and --rounds must be >= 1 and --new-tokens >= 2")


@dataclass
class Row:
    """One peer's run in one cell and round."""

    peer: str
    method: str  # plain | a speculative method (ngram, suffix, ...) | bench (llama-bench, empty context)
    batch: int
    dtype: str
    threads: int
    round: int
    tokens: int
    seconds: float
    accept_length: float | None = None
    texts: list[str] = field(default_factory=list)  # generated text per prompt (batch 1 and in-process peers)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


class Worker:
    """A `peer_worker` process: one in-process peer on one dtype and thread count."""

    def __init__(self, system: str, model: str, dtype: str, threads: int, speculative: tuple[str, ...]) -> None:
        env = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specserve.bench.peer_worker", "--system", system, "--model", model,
             "--dtype", dtype, "--threads", str(threads), "--speculative", ",".join(speculative)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **env})
        self.load_s = float(self._read()["load_s"])

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"peer worker {self.proc.args!r} exited ({self.proc.wait()}); its log is above")
        return dict(json.loads(line))

    def ask(self, method: str, prompts: list[list[int]] | None = None, batch: int = 1,
            new_tokens: int = 0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        req = {"method": method, "prompts": prompts, "batch": batch, "new_tokens": new_tokens}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


class Peers:
    """Everything one run holds: the built llama.cpp and its GGUFs, the workers, the prompts."""

    def __init__(self, cfg: PeersConfig, progress: bool = True) -> None:
        from specserve.models.loader import resolve_model_path
        from specserve.tokenizer import Tokenizer

        self.cfg = cfg
        self.model_dir = resolve_model_path(cfg.model)
        self.tokenizer = Tokenizer(self.model_dir)
        self.texts = [t.prompt if isinstance(t.prompt, str) else self.tokenizer.apply_chat_template(t.messages or [])
                      for t in load_suite(cfg.suite)]
        self.ids = [self.tokenizer.encode(t) for t in self.texts]
        own_gguf = self.model_dir / GGUF_NAME  # a GGUF model's file (models/gguf_dir.py)
        if "int4" in cfg.dtypes and not own_gguf.exists():
            raise ValueError(f"--dtype int4: {cfg.model} is not a GGUF model (--model smollm2 or FILE.gguf)")
        self.llama: llama_cpp.LlamaCpp | None = None
        self.gguf: dict[str, Path] = {}
        self.tokenizer_check: dict[str, Any] = {}
        if "llama.cpp" in cfg.peers:
            self.llama = llama_cpp.build(llama_cpp.fetch_sources(cfg.work / "src"), progress=progress)
            for dtype in cfg.dtypes:
                if own_gguf.exists():  # no Hugging Face weights to convert: the file itself
                    if dtype != "int4":
                        raise ValueError(f"--dtype {dtype}: llama.cpp runs a GGUF model's own file; use --dtype int4")
                    self.gguf[dtype] = own_gguf.resolve()
                    continue
                name = f"{self.model_dir.name}-{llama_cpp.GGUF_TYPES[dtype]}.gguf"
                self.gguf[dtype] = llama_cpp.convert(self.llama, self.model_dir, dtype, cfg.work / name)
            gguf = next(iter(self.gguf.values()))
            same = [llama_cpp.tokenize(self.llama, gguf, t) == ids for t, ids in zip(self.texts, self.ids, strict=True)]
            self.tokenizer_check = {"prompts": len(same), "same_ids": sum(same)}
        self.workers: dict[tuple[str, str, int], Worker] = {}
        for system in (p for p in cfg.peers if p in SYSTEMS):
            for dtype in cfg.dtypes:
                for threads in cfg.threads:
                    spec = tuple(self.methods(system, 1)[1:])
                    self.workers[(system, dtype, threads)] = Worker(system, cfg.model, dtype, threads, spec)

    def methods(self, peer: str, batch: int) -> list[str]:
        """What `peer` runs at `batch`: plain, and at batch 1 the speculative methods it has."""
        if batch != 1:
            return ["plain"]
        return ["plain", *(m for m in self.cfg.speculative if peer.startswith("specserve") or m == "ngram")]

    def batch_prompts(self, batch: int) -> list[list[int]]:
        n = self.cfg.prompts if batch == 1 else batch
        return [self.ids[i % len(self.ids)] for i in range(n)]

    def cells(self) -> list[tuple[int, str, int]]:
        return [(b, d, t) for b in self.cfg.batches for d in self.cfg.dtypes for t in self.cfg.threads]

    def warm(self, progress: bool = True) -> dict[str, float]:
        """One untimed pass of every worker's runs, then a compile of every verify width a drafter could meet at
        batch 1 (lookup drafters' widths vary with the text). The largest batch goes first: the offline engine sizes
        its KV pool to the batch and a larger batch later would rebuild it (its compiled steps with it)."""
        seconds: dict[str, float] = {}
        bar = tqdm(self.workers.items(), desc="warming peers", unit="worker", disable=not progress)
        for (system, dtype, threads), w in bar:
            t = 0.0
            for batch in sorted(self.cfg.batches, reverse=True):
                t += w.ask("plain", self.batch_prompts(batch), batch, self.cfg.new_tokens)["seconds"]
            drafting = [m for m in (self.methods(system, 1) if 1 in self.cfg.batches else []) if m != "plain"]
            for method in drafting:
                t += w.ask(method, self.batch_prompts(1), 1, self.cfg.new_tokens)["seconds"]
            if drafting:  # drafters run at batch 1 only; the pass above met every plain batch already
                t += w.ask("compile", batch=1)["seconds"]
            seconds[f"{system}/{dtype}/t{threads}"] = round(w.load_s + t, 1)
        return seconds

    def run_cell(self, batch: int, dtype: str, threads: int, rnd: int) -> Iterator[Row]:
        order = list(self.cfg.peers) if rnd % 2 == 0 else list(self.cfg.peers)[::-1]
        for peer in order:
            for method in self.methods(peer, batch):
                if peer == "llama.cpp":
                    yield from self._llama(method, batch, dtype, threads, rnd)
                else:
                    res = self.workers[(peer, dtype, threads)].ask(method, self.batch_prompts(batch), batch,
                                                                   self.cfg.new_tokens)
                    yield Row(peer, method, batch, dtype, threads, rnd, sum(len(o) for o in res["outputs"]),
                              res["seconds"], res["accept_length"],
                              [self.tokenizer.decode(o) for o in res["outputs"]])

    def _llama(self, method: str, batch: int, dtype: str, threads: int, rnd: int) -> Iterator[Row]:
        assert self.llama is not None
        gguf, n, t = str(self.gguf[dtype]), self.cfg.new_tokens, str(threads)
        common = ["-m", gguf, "-t", t, "-c", "2048", "--temp", "0", "--ignore-eos", "-n", str(n), *llama_cpp.VERBATIM]
        if batch > 1:
            npp = round(statistics.mean(len(x) for x in self.batch_prompts(batch)))
            out, _ = self.llama.run("llama-batched-bench", ["-m", gguf, "-t", t, "-c", str(batch * (npp + n + 8)),
                                                            "-npp", str(npp), "-ntg", str(n), "-npl", str(batch),
                                                            "--output-format", "jsonl"], threads)
            res = llama_cpp.parse_batched_jsonl(out)[batch]
            yield Row("llama.cpp", method, batch, dtype, threads, rnd, int(res["tg"]) * batch,
                      res["t_pp"] + res["t_tg"])
            return
        rows = []
        for text in self.texts[: self.cfg.prompts]:
            if method == "plain":
                out, err = self.llama.run("llama-completion", [*common, "-p", text, "-no-cnv", "--no-display-prompt"],
                                          threads, done="total time")
                ms, _ = llama_cpp.parse_perf(err)["total"]
                rows.append(Row("llama.cpp", method, 1, dtype, threads, rnd, n, ms / 1e3,
                                texts=[llama_cpp.completion_text(out)]))
            else:
                out, err = self.llama.run("llama-lookup", [*common, "-p", text, "--spec-draft-n-max",
                                                           str(self.cfg.lookup_draft)], threads, done="n_accept")
                s = llama_cpp.parse_speculation(err)
                rows.append(Row("llama.cpp", method, 1, dtype, threads, rnd, s["n_predict"],
                                s["encode_s"] + s["decode_s"], s["accept_length"],
                                [llama_cpp.lookup_text(out, text)]))
        yield merge(rows)
        if method == "plain":
            out, _ = self.llama.run("llama-bench", ["-m", gguf, "-p", "0", "-n", str(n), "-t", t, "-r", "3",
                                                    "-o", "json"], threads)
            samples = llama_cpp.parse_bench_json(out)  # tok/s per repetition; the first is a cold run
            yield Row("llama.cpp", "bench", 1, dtype, threads, rnd, n, n / statistics.median(samples[1:] or samples))

    def reference_pieces(self) -> dict[tuple[int, str], list[list[str]]]:
        """Per (batch, dtype), specserve's eager greedy outputs (the first of --threads) as their tokens' texts."""
        system = "specserve-eager" if "specserve-eager" in self.cfg.peers else "specserve"
        out = {}
        for (s, dtype, threads), w in self.workers.items():
            if s != system or threads != self.cfg.threads[0]:
                continue
            for batch in self.cfg.batches:
                ids = w.ask("plain", self.batch_prompts(batch), batch, self.cfg.new_tokens)["outputs"]
                out[(batch, dtype)] = [token_pieces(self.tokenizer.decode, x) for x in ids]
        return out

    def floors(self) -> dict[str, float]:
        return {f"{d}/t{t}": round(w.ask("floor")["floor_ms"], 3)
                for (s, d, t), w in self.workers.items() if s == "specserve-eager" and d != "int4"}

    def close(self) -> None:
        for w in self.workers.values():
            w.close()


def merge(rows: list[Row]) -> Row:
    """Prompts run one by one as one batch-1 figure: tokens and seconds summed, accept length token-weighted."""
    first = rows[0]
    accepts = [(r.accept_length, r.tokens) for r in rows if r.accept_length]
    accept = sum(a * n for a, n in accepts) / sum(n for _, n in accepts) if accepts else None
    return Row(first.peer, first.method, first.batch, first.dtype, first.threads, first.round,
               sum(r.tokens for r in rows), sum(r.seconds for r in rows), accept,
               [t for r in rows for t in r.texts])


def token_pieces(decode: Callable[[list[int]], str], ids: list[int]) -> list[str]:
    """The text each token adds to the decoded output, in order."""
    texts = [decode(ids[:k]) for k in range(len(ids) + 1)]
    return [b[len(a):] for a, b in itertools.pairwise(texts)]


def agreement(reference: list[str], text: str) -> int:
    """How many of the reference's tokens (their texts, in order) `text` begins with: peers that detokenize
    (llama.cpp prints text) are compared with the reference's token ids this way, exactly."""
    pos = 0
    for k, piece in enumerate(reference):
        if not text.startswith(piece, pos):
            return k
        pos += len(piece)
    return len(reference)


def summarize(rows: list[Row], ref_pieces: dict[tuple[int, str], list[list[str]]]) -> list[dict[str, Any]]:
    """Per (peer, method, batch, dtype, threads): median tok/s over rounds with min and max, the median per-round
    ratio to specserve's plain decoding (compiled) in the same cell, accept length, and greedy agreement with the
    reference outputs of (batch, dtype) (`ref_pieces`: per prompt, its tokens' texts): identical outputs (every
    reference token reproduced) and the mean number of leading reference tokens reproduced."""
    groups: dict[tuple[str, str, int, str, int], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.peer, r.method, r.batch, r.dtype, r.threads), []).append(r)
    base = {(b, d, t, r.round): r.tok_s for (p, m, b, d, t), rs in groups.items() if p == "specserve" and m == "plain"
            for r in rs}
    out = []
    for (peer, method, batch, dtype, threads), rs in groups.items():
        speeds = [r.tok_s for r in rs]
        ratios = [r.tok_s / base[k] for r in rs if (k := (batch, dtype, threads, r.round)) in base]
        accepts = [r.accept_length for r in rs if r.accept_length is not None]
        row: dict[str, Any] = {
            "peer": peer, "method": method, "batch": batch, "dtype": dtype, "threads": threads,
            "tok_s": round(statistics.median(speeds), 1), "tok_s_min": round(min(speeds), 1),
            "tok_s_max": round(max(speeds), 1), "rounds": len(rs),
            "over_specserve": round(statistics.median(ratios), 3) if ratios else None,
            "accept_length": round(statistics.mean(accepts), 3) if accepts else None,
        }
        ref, texts = ref_pieces.get((batch, dtype)), rs[0].texts
        if ref and len(ref) == len(texts):
            agree = [agreement(pieces, t) for pieces, t in zip(ref, texts, strict=True)]
            row["identical_outputs"] = f"{sum(k == len(p) for k, p in zip(agree, ref, strict=True))}/{len(ref)}"
            row["mean_common_prefix"] = round(statistics.mean(agree), 1)
        out.append(row)
    return out


def markdown(summary: list[dict[str, Any]], floors: dict[str, float]) -> str:
    lines = ["| batch | dtype | threads | peer | method | tok/s (median, min-max) | / specserve | accept length "
             "| identical greedy | common prefix |", "|---|---|---|---|---|---|---|---|---|---|"]
    def key(r: dict[str, Any]) -> tuple[Any, ...]:
        return r["batch"], r["dtype"], r["threads"], r["method"] != "plain", r["method"], PEERS.index(r["peer"])

    for r in sorted(summary, key=key):
        ratio = f"{r['over_specserve']:.2f}x" if r["over_specserve"] is not None else ""
        acc = f"{r['accept_length']:.2f}" if r["accept_length"] is not None else ""
        method = "llama-bench (empty context)" if r["method"] == "bench" else r["method"]
        lines.append(f"| {r['batch']} | {r['dtype']} | {r['threads']} | {r['peer']} | {method} | {r['tok_s']:.0f} "
                     f"({r['tok_s_min']:.0f}-{r['tok_s_max']:.0f}) | {ratio} | {acc} | "
                     f"{r.get('identical_outputs', '')} | {r.get('mean_common_prefix', '')} |")
    if floors:
        lines.append("")
        lines.append("Matmul floor of one batch-1 step (ms; 1000/ms tok/s): "
                     + ", ".join(f"{k} {v} ({1e3 / v:.0f} tok/s)" for k, v in floors.items()))
    return "\n".join(lines) + "\n"


def matrix(summary: list[dict[str, Any]]) -> str:
    """The summary as one table: a row per peer and method, a column per cell, median tok/s (accept length)."""
    cells = sorted({(r["batch"], r["dtype"], r["threads"]) for r in summary},
                   key=lambda c: (c[0], c[1] != "float32", c[2]))
    series = sorted({(r["peer"], r["method"]) for r in summary},
                    key=lambda s: (s[1] != "plain", s[1] != "bench", PEERS.index(s[0])))
    by = {(r["peer"], r["method"], r["batch"], r["dtype"], r["threads"]): r for r in summary}
    short = {"float32": "f32", "bfloat16": "bf16", "int4": "int4"}
    head = [f"batch {b}, {short[d]}, {t} thr" for b, d, t in cells]
    lines = ["| peer | method | " + " | ".join(head) + " |", "|---|---|" + "---|" * len(cells)]
    for peer, method in series:
        vals = []
        for cell in cells:
            r = by.get((peer, method, *cell))
            acc = f" ({r['accept_length']:.2f})" if r and r["accept_length"] is not None else ""
            vals.append(f"{r['tok_s']:.0f}{acc}" if r else "")
        name = "llama-bench, empty context" if method == "bench" else method
        lines.append(f"| {peer} | {name} | " + " | ".join(vals) + " |")
    return "\n".join(lines) + "\n"


def plot(summary: list[dict[str, Any]], path: Path) -> None:
    """Grouped bars: tok/s of each peer's plain decoding per cell, the speculative ones hatched beside."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [r for r in summary if r["method"] != "bench"]
    cells = sorted({(r["batch"], r["dtype"], r["threads"]) for r in rows})
    series = sorted({(r["peer"], r["method"]) for r in rows},
                    key=lambda s: (s[1] != "plain", s[1], PEERS.index(s[0])))
    fig = Figure(figsize=(max(8, 1.6 * len(cells)), 5))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    width = 0.8 / max(1, len(series))
    for i, (peer, method) in enumerate(series):
        by = {(r["batch"], r["dtype"], r["threads"]): r["tok_s"] for r in rows
              if r["peer"] == peer and r["method"] == method}
        xs = [j - 0.4 + width * (i + 0.5) for j in range(len(cells))]
        ax.bar(xs, [by.get(c, 0.0) for c in cells], width=width, label=f"{peer} {method}",
               hatch=None if method == "plain" else "//")
    ax.set_xticks(list(range(len(cells))))
    ax.set_xticklabels([f"batch {b}\n{d}\n{t} thr" for b, d, t in cells])
    ax.set_ylabel("generated tokens/s")
    ax.set_yscale("log")
    ax.set_title("Greedy decoding, same weights and prompts")
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)


def run(cfg: PeersConfig, out_dir: Path, progress: bool = True) -> dict[str, Any]:
    """Builds what is missing, warms every peer, runs the rounds; writes peers.json, peers.md and peers.png."""
    import platform

    import torch

    peers = Peers(cfg, progress)
    try:
        warm_s = peers.warm(progress)
        floors = peers.floors()
        ref_pieces = peers.reference_pieces()
        rows: list[Row] = []
        cells = peers.cells()
        bar = tqdm(total=cfg.rounds * len(cells), desc="peers", unit="cell", disable=not progress)
        for rnd in range(cfg.rounds):
            for batch, dtype, threads in cells if rnd % 2 == 0 else cells[::-1]:
                rows.extend(peers.run_cell(batch, dtype, threads, rnd))
                bar.update(1)
        bar.close()
    finally:
        peers.close()
    summary = summarize(rows, ref_pieces)
    report = {"benchmark": "peers", "config": {**asdict(cfg), "work": str(cfg.work)}, "command_line": sys.argv,
              "machine": platform.processor() or platform.machine(), "torch": torch.__version__,
              "llama_cpp_sdist": llama_cpp.SDIST_VERSION if peers.llama else None,
              "tokenizer_check": peers.tokenizer_check, "warm_s": warm_s, "matmul_floor_ms": floors,
              "summary": summary,
              "rows": [{k: v for k, v in asdict(r).items() if k != "texts"} | {"tok_s": round(r.tok_s, 2)}
                       for r in rows]}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "peers.json").write_text(json.dumps(report, indent=2))
    (out_dir / "peers.md").write_text(matrix(summary) + "\n" + markdown(summary, floors))
    plot(summary, out_dir / "peers.png")
    return report

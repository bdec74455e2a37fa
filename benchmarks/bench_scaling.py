"""How the prefix index's costs grow with the work: match time and metadata memory.

**(a) Match time vs tree size.** `RadixIndex` trees (page size 16) holding
about 1k, 10k, 100k and 1M cached tokens (quick: up to 100k). Every tree
holds the same 1024-token prompt, split into 16 nodes by one-page branches
every 64 tokens; the rest is filler: 256-token sequences, half fresh from the root, half branching off an
earlier filler sequence at a random page. ``match_prefix`` of the prompt (a
full hit, ``touch=True`` as the cache calls it) should cost the same in every
tree: O(prompt + depth), independent of the tree's size. Reported: time per
match for each tree, and the ratio largest / smallest tree (target < 2.0).
A miss (a fresh 1024-token prompt) is timed too.

**Match time vs prompt length.** In the largest tree, a 4096-token sequence
(branched every 64 tokens as above) is matched by its prefixes of 128 to 4096
tokens; a least-squares line ``time = a + b * tokens`` is fitted (target R^2
>= 0.95: linear).

Timings: each is the best of several repeats of a batch of matches, divided
by the batch size, the trees interleaved (`best_of_interleaved`).

**(b) Memory per cached page.** For page sizes 1, 16 and 64, ~64k tokens (quick:
16k) of 1024-token sequences, most sharing a random page-aligned prefix with an
earlier one, are inserted into an empty index while ``tracemalloc`` traces the
Python heap. The caller's token ints and slot tensors are created before
tracing starts, so they are excluded; what is counted is the index's own:
nodes, key tuples, children dicts, page-hash strings and the Python objects of
the slot-tensor views it keeps per node. Not counted: the C++ part of those
views (a few hundred bytes per node, invisible to tracemalloc) and the slot
storage itself, reported separately as ``slot_bytes_per_page`` (8 bytes per
token per tier, int64, owned by the caller's tensors).

**(c)** Transfer time vs pages is the ``scaling`` part of the transfer
benchmark (``transfer.json``); it is not repeated here.
"""

from __future__ import annotations

import gc
import random
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import (
    RESULTS_DIR,
    best_of_interleaved,
    headline,
    linear_fit,
    machine_info,
    plot_lines,
    write_result,
)
from tiercache.index.radix import RadixIndex

NAME = "scaling"
#: Match time in the largest tree / in the smallest must stay under this.
TARGET_TREE_RATIO = 2.0
#: R^2 of the linear fit of match time vs prompt length must reach this.
TARGET_LINEAR_R2 = 0.95
MATCH_PAGE_SIZE = 16
PROMPT_TOKENS = 1024
BRANCH_EVERY = 64
FILLER_TOKENS = 256
VOCAB = 32000
TREE_TOKENS: tuple[int, ...] = (1_000, 10_000, 100_000, 1_000_000)
QUICK_TREE_TOKENS: tuple[int, ...] = (1_000, 10_000, 100_000)
SMOKE_TREE_TOKENS: tuple[int, ...] = (1_000, 5_000)
PROMPT_LENGTHS: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096)
SMOKE_PROMPT_LENGTHS: tuple[int, ...] = (128, 512, 1024)
MEMORY_PAGE_SIZES: tuple[int, ...] = (1, 16, 64)
MEMORY_SEQ_TOKENS = 256


class _Tree:
    """A `RadixIndex` being filled with fake slots (the index never reads them)."""

    def __init__(self, page_size: int, rng: random.Random) -> None:
        self.index = RadixIndex(page_size)
        self.rng = rng
        self.next_slot = 0
        self.fillers: list[list[int]] = []

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(VOCAB) for _ in range(n)]

    def insert(self, tokens: list[int]) -> None:
        n = len(tokens)
        self.index.insert(tokens, torch.arange(self.next_slot, self.next_slot + n))
        self.next_slot += n

    def insert_branched(self, path: list[int]) -> None:
        """``path``, split into nodes by a one-page branch every `BRANCH_EVERY` tokens."""
        ps = self.index.page_size
        self.insert(path)
        for at in range(BRANCH_EVERY, len(path), BRANCH_EVERY):
            self.insert(path[:at] + self.tokens(ps))

    def fill(self, total_tokens: int) -> None:
        """Add filler sequences until the tree holds ``total_tokens`` cached tokens."""
        ps = self.index.page_size
        while self.index.total_device_tokens() < total_tokens:
            if self.fillers and self.rng.random() < 0.5:
                base = self.rng.choice(self.fillers)
                shared = base[: self.rng.randrange(1, FILLER_TOKENS // ps) * ps]
                seq = shared + self.tokens(FILLER_TOKENS - len(shared))
            else:
                seq = self.tokens(FILLER_TOKENS)
            self.fillers.append(seq)
            self.insert(seq)


def _matcher(index: RadixIndex, prompt: list[int], batch: int) -> Callable[[], None]:
    def run() -> None:
        for _ in range(batch):
            index.match_prefix(prompt)

    return run


def _match_vs_tree(
    sizes: tuple[int, ...], batch: int, repeat: int
) -> tuple[list[dict[str, Any]], _Tree, list[int]]:
    rng = random.Random(0)
    prompt = [rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)]
    miss = [rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)]
    trees: list[_Tree] = []
    build_s: list[float] = []
    for i, size in enumerate(sizes):
        t0 = time.perf_counter()
        tree = _Tree(MATCH_PAGE_SIZE, random.Random(i + 1))
        tree.insert_branched(prompt)
        tree.fill(size)
        build_s.append(time.perf_counter() - t0)
        trees.append(tree)
    for tree in trees:  # the prompt must be a full hit, ending on a node boundary (no split)
        m = tree.index.match_prefix(prompt, touch=False)
        assert m.device_length == PROMPT_TOKENS, m.device_length
    hit = best_of_interleaved([_matcher(t.index, prompt, batch) for t in trees], repeat)
    missed = best_of_interleaved([_matcher(t.index, miss, batch) for t in trees], repeat)
    rows = []
    for size, tree, t_hit, t_miss, t_build in zip(sizes, trees, hit, missed, build_s, strict=True):
        idx = tree.index
        path_nodes = len(idx.path(idx.match_prefix(prompt, touch=False).last_device_node))
        rows.append(
            {
                "target_tokens": size,
                "tree_tokens": idx.total_device_tokens(),
                "nodes": len(idx),
                "root_children": len(idx.root.children),
                "prompt_tokens": PROMPT_TOKENS,
                "path_nodes": path_nodes,
                "match_s": t_hit / batch,
                "match_ns_per_token": 1e9 * t_hit / batch / PROMPT_TOKENS,
                "miss_s": t_miss / batch,
                "build_s": t_build,
            }
        )
    return rows, trees[-1], prompt


def _match_vs_length(
    tree: _Tree, lengths: tuple[int, ...], batch: int, repeat: int
) -> dict[str, Any]:
    long = tree.tokens(max(lengths))
    tree.insert_branched(long)
    prompts = [long[:n] for n in lengths]
    times = best_of_interleaved([_matcher(tree.index, p, batch) for p in prompts], repeat)
    points = [
        {
            "prompt_tokens": n,
            "match_s": t / batch,
            "match_ns_per_token": 1e9 * t / batch / n,
        }
        for n, t in zip(lengths, times, strict=True)
    ]
    fit = linear_fit([float(n) for n in lengths], [p["match_s"] for p in points])
    return {
        "tree_tokens": tree.index.total_device_tokens(),
        "nodes": len(tree.index),
        "points": points,
        "fit": {
            "seconds_per_token": fit["slope"],
            "fixed_seconds": fit["intercept"],
            "r2": fit["r2"],
        },
    }


def _memory(page_size: int, total_tokens: int, seed: int) -> dict[str, Any]:
    """Index metadata bytes for ~``total_tokens`` unique cached tokens at ``page_size``."""
    rng = random.Random(seed)
    seqs: list[list[int]] = []
    unique = 0
    pages_per_seq = MEMORY_SEQ_TOKENS // page_size
    while unique < total_tokens:
        if seqs and rng.random() < 0.7:
            shared = rng.choice(seqs)[: rng.randrange(1, pages_per_seq) * page_size]
        else:
            shared = []
        seq = shared + [rng.randrange(VOCAB) for _ in range(MEMORY_SEQ_TOKENS - len(shared))]
        seqs.append(seq)
        unique += MEMORY_SEQ_TOKENS - len(shared)
    # The caller's slot tensors (and token ints) exist before tracing starts.
    base = torch.arange(len(seqs) * MEMORY_SEQ_TOKENS, dtype=torch.int64)
    slots = [base[i * MEMORY_SEQ_TOKENS : (i + 1) * MEMORY_SEQ_TOKENS] for i in range(len(seqs))]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = RadixIndex(page_size)
        for seq, s in zip(seqs, slots, strict=True):
            index.insert(seq, s)
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    nodes = len(index)
    tokens = index.total_device_tokens()
    pages = tokens // page_size
    return {
        "page_size": page_size,
        "sequences": len(seqs),
        "cached_tokens": tokens,
        "pages": pages,
        "nodes": nodes,
        "index_bytes": used,
        "bytes_per_node": used / nodes,
        "bytes_per_page": used / pages,
        "bytes_per_token": used / tokens,
        "slot_bytes_per_page": 8 * page_size,
    }


def main(
    quick: bool = False, out_dir: Path = RESULTS_DIR, *, smoke: bool = False
) -> dict[str, Any]:
    """Run the scaling benchmark; write ``scaling.json`` and two plots; return the result."""
    t0 = time.perf_counter()
    sizes = SMOKE_TREE_TOKENS if smoke else QUICK_TREE_TOKENS if quick else TREE_TOKENS
    lengths = SMOKE_PROMPT_LENGTHS if smoke else PROMPT_LENGTHS
    batch = 5 if smoke else 20 if quick else 50
    repeat = 3 if smoke else 5 if quick else 9
    mem_tokens = 2048 if smoke else 16384 if quick else 65536

    tree_rows, largest, _prompt = _match_vs_tree(sizes, batch, repeat)
    by_length = _match_vs_length(largest, lengths, batch, repeat)
    del largest
    memory = [_memory(ps, mem_tokens, seed=ps) for ps in MEMORY_PAGE_SIZES]

    ratio = tree_rows[-1]["match_s"] / tree_rows[0]["match_s"]
    heads = [
        headline(
            f"match time, {tree_rows[-1]['tree_tokens']:,}-token / "
            f"{tree_rows[0]['tree_tokens']:,}-token tree ({PROMPT_TOKENS}-token prompt)",
            ratio,
            TARGET_TREE_RATIO,
            higher_is_better=False,
            unit="x",
        ),
        headline(
            "match time vs prompt length: R^2 of a linear fit",
            by_length["fit"]["r2"],
            TARGET_LINEAR_R2,
        ),
    ]
    result: dict[str, Any] = {
        "name": NAME,
        "machine": machine_info(),
        "mode": "smoke" if smoke else "quick" if quick else "full",
        "page_size": MATCH_PAGE_SIZE,
        "batch": batch,
        "repeat": repeat,
        "statistic": (
            f"match: best of {repeat} batches of {batch} matches after one warm-up batch, "
            "divided by the batch size, trees (or prompt lengths) interleaved; "
            "memory: tracemalloc of the Python heap while inserting"
        ),
        "match_vs_tree": tree_rows,
        "match_vs_prompt_length": by_length,
        "memory": memory,
        "memory_note": (
            "index_bytes: the index's own Python objects (nodes, key tuples, dicts, "
            "page-hash strings, slot-view wrappers); excludes the caller's token ints and "
            "slot tensors, and the C++ part of the index's tensor views; "
            "slot_bytes_per_page: int64 slot storage per page per tier, owned by the caller"
        ),
        "transfer_scaling": "see the 'scaling' part of transfer.json",
        "headline": heads,
        "table": {
            "columns": [
                "tree tokens",
                "nodes",
                "path nodes",
                "match us",
                "ns/token",
                "miss us",
            ],
            "rows": [
                [
                    r["tree_tokens"],
                    r["nodes"],
                    r["path_nodes"],
                    1e6 * r["match_s"],
                    r["match_ns_per_token"],
                    1e6 * r["miss_s"],
                ]
                for r in tree_rows
            ],
        },
        "length_table": {
            "columns": ["prompt tokens", "match us", "ns/token"],
            "rows": [
                [p["prompt_tokens"], 1e6 * p["match_s"], p["match_ns_per_token"]]
                for p in by_length["points"]
            ],
        },
        "memory_table": {
            "columns": [
                "page size",
                "nodes",
                "pages",
                "bytes/node",
                "bytes/page",
                "bytes/token",
                "slot bytes/page",
            ],
            "rows": [
                [
                    m["page_size"],
                    m["nodes"],
                    m["pages"],
                    m["bytes_per_node"],
                    m["bytes_per_page"],
                    m["bytes_per_token"],
                    m["slot_bytes_per_page"],
                ]
                for m in memory
            ],
        },
    }
    result["elapsed_s"] = time.perf_counter() - t0
    write_result(NAME, result, out_dir)
    plot_lines(
        NAME,
        [r["tree_tokens"] for r in tree_rows],
        {
            f"hit ({PROMPT_TOKENS} tokens)": [1e6 * r["match_s"] for r in tree_rows],
            "miss": [1e6 * r["miss_s"] for r in tree_rows],
        },
        title=f"match_prefix time vs tree size (page {MATCH_PAGE_SIZE})",
        xlabel="cached tokens in the tree",
        ylabel="us per match",
        out_dir=out_dir,
        logx=True,
    )
    pts = by_length["points"]
    plot_lines(
        f"{NAME}_prompt",
        [p["prompt_tokens"] for p in pts],
        {"match": [1e6 * p["match_s"] for p in pts]},
        title=f"match_prefix time vs prompt length ({by_length['tree_tokens']:,}-token tree)",
        xlabel="prompt tokens (all cached)",
        ylabel="us per match",
        out_dir=out_dir,
    )
    return result


if __name__ == "__main__":
    from benchmarks.run import main as run_main

    raise SystemExit(run_main(["--only", NAME]))

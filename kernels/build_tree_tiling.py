"""How the tree build's ``expand`` launch tiles the vocabulary: the tile, the programs per row,
the warps of a streaming program, the tokens per recorded maximum, when the first tiles load
early, and the split workspace those choices size. Each rule reads shapes and the SM count only
(fixed for a CUDA graph), so a captured launch keeps its tiling; each default won a sweep on the
H200 or H100 (docs/benchmarks.md names them). ``kernels.build_tree.expand`` takes every choice as
an override."""

from __future__ import annotations

import torch

from treeops import _runtime
from treeops._runtime import cdiv, interpreted, pow2, refuse_in_capture

_RETIRED: list[torch.Tensor] = []  # split workspaces replaced by larger ones (see expand)


def _default_split(rows: int, V: int, block_v: int, device: torch.device) -> int:
    """Chunks per frontier row for the one-warp streaming programs: at most 32 programs per SM
    (B = 1's ten rows fill the GPU), at least 2, at most 64, from the SM count and V only (fixed
    for a CUDA graph); 1 off the GPU. 32 one-warp programs are all an SM holds at once (the
    block limit): rounding up would leave a second wave of a few programs, each a chunk's whole
    latency chain on an idle GPU (B 64 took 4,480 programs for 4,224 places)."""
    if device.type != "cuda":
        return 1
    want = (32 * _runtime.sm_count(device)) // rows
    return max(1, min(max(want, 2), cdiv(V, block_v), 64))


def expand_tiling(
    rows: int, V: int, device: torch.device, block_v: int | None = None, split: int | None = None
) -> tuple[int, int]:
    """(block_v, split) of the expand launch over ``rows`` frontier rows of V logits: the
    vocabulary tile and the programs per row, from shapes and the SM count only; ``block_v`` and
    ``split`` override the defaults (a split is rounded to whole tiles)."""
    if block_v is None:
        # one-warp streaming programs (split > 1): 16 logits per thread, two tiles in flight
        block_v = min(pow2(V), 256 if interpreted() else 512)
        one_tile = block_v == 512 and _default_split(rows, V, 512, device) >= cdiv(V, 512)
        if split is None and one_tile:
            # each program would stream one tile (few rows, V 32,000 at B 1): half as many
            # programs, 1,024-token tiles over two warps (``stream_warps``; docs/design.md)
            block_v = 1024
    if split is None:
        split = _default_split(rows, V, block_v, device)
    chunk = cdiv(cdiv(V, split), block_v) * block_v  # ceil(V / split) in whole tiles
    return block_v, cdiv(V, chunk)


STREAM_EARLY_MAX_BYTES = 4 << 20
"""The most logits bytes (all rows) of a launch whose streams load early (``early_tile_loads``)."""


def early_tile_loads(rows: int, V: int, element_size: int) -> bool:
    """Whether the streaming programs load their first tiles before their row's state (the
    frontier score and the request's flag, written by the launch before): the loads then leave
    with those, not after them, one memory latency less a program. A row not in use (a narrow
    CAST frontier, an idle request) then costs its first tiles' bytes, which only launches of
    at most ``STREAM_EARLY_MAX_BYTES`` of logits afford: B 1, where each program streams a tile
    or a few and the latency is most of its time."""
    return rows * V * element_size <= STREAM_EARLY_MAX_BYTES


def stream_warps(block_v: int) -> int:
    """Warps of a streaming program by default: one for tiles of up to 512 tokens (16 logits a
    thread), two for larger ones (the warps split the tile's blocks, ``_tile_lanes``)."""
    return 1 if interpreted() or block_v <= 512 else 2


BLOCKS_TOPK_MAX = 512
"""The most blocks a row (rounded up to a power of two) whose K best ``expand`` finds with one
``tl.topk`` by default: the H200 measured 256 and 512 faster, 2,048 slower (``expand``)."""


def expand_max_block(rows: int, V: int, block_v: int, device: torch.device) -> int:
    """Tokens per maximum the split expand's stream records (``expand``'s ``max_block``): the
    per-row program re-reads the K blocks with the largest maxima, so smaller blocks mean fewer
    logits re-read, and more maxima to rank. Where every row's program has an SM to itself
    (``rows`` <= SMs) 64, or more where that leaves over 1,024 blocks a row (V 128,256 takes
    128); else at most 256 blocks a row (ranking more costs more than the re-read saves once
    programs share SMs); never more than ``block_v``. Each choice won the H200's sweeps
    (``bench_build_tree.py --ops sweep_topk``; docs/benchmarks.md, sessions 28 and 30)."""
    if device.type == "cuda" and rows <= _runtime.sm_count(device):
        return min(max(pow2(cdiv(V, 1024)), 64), block_v)
    return min(max(pow2(cdiv(V, 256)), 16), block_v)


def split_workspace(
    ws: dict[str, torch.Tensor], rows: int, split: int, blocks: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split expand's buffers in ``ws`` (a ``DraftState``'s workspace): each (row, chunk)'s
    partial max and sum, and per row ``blocks`` int32 (each ``max_block`` block's max), all flat:
    the kernels take the row stride (``NT = blocks``) as a constexpr. Made or grown on a first
    call of a larger shape (never inside a CUDA-graph capture) and never shrunk, so a step whose
    layers alternate shapes (the root layer's B rows in 64-token blocks, the later B * W rows in
    larger ones) reuses one set of buffers."""
    need = rows * split
    if "part_m" not in ws or ws["part_m"].numel() < need or ws["part_t"].numel() < rows * blocks:
        refuse_in_capture("build_tree_expand's split workspace (per draft state and V)")
        # replaced buffers stay alive: a graph captured with them keeps replaying into them
        _RETIRED.extend(ws[k] for k in ("part_m", "part_s", "part_t") if k in ws)
        have_t = ws["part_t"].numel() if "part_t" in ws else 0
        need = max(need, ws["part_m"].numel() if "part_m" in ws else 0)
        ws["part_m"] = torch.zeros(need, dtype=torch.float32, device=device)
        ws["part_s"] = torch.zeros(need, dtype=torch.float32, device=device)
        ws["part_t"] = torch.zeros(max(rows * blocks, have_t), dtype=torch.int32, device=device)
    return ws["part_m"], ws["part_s"], ws["part_t"]


STREAM_LANES_MIN_BLOCK = 128
"""The stream keeps its max and sum per vector (``expand``'s ``stream_lanes``) where a recorded
maximum covers at least this many tokens and less than a tile (a max per tile already reduces
once a tile). Per tile, a tile's max and sum each crossed the warp (17 shuffles a tile at
128-token blocks, 197 instructions in the loop); per vector only the block maxima do (3; 173).
One EAGLE layer (W = K = 10), µs, per tile -> per vector, graph replays:

| GPU, how | B 64 V 32,000 | B 32 V 32,000 | B 1 V 128,256 | B 1 V 32,000 | B 64 V 128,256 |
| --- | --- | --- | --- | --- | --- |
| H200, sweep | 27.6 -> 26.7 | | 14.45 -> 14.05 | 10.58 -> 10.64 | 64.8 -> 65.9 |
| H100, sweep | 30.9 -> 30.2 | | 14.8 -> 14.5 | 11.07 -> 11.14 | 77.2 -> 76.8 |
| H100, A/B | 30.8 -> 29.7 | 21.1 -> 20.0 | | 11.07 -> 11.15 | |

(blocks: 128 tokens at B 32-64 V 32,000 and B 1 V 128,256, 64 at B 1 V 32,000, a 512-token tile
at B 64 V 128,256; the A/B rows also have four blocks a read at B 32-64, ``bench/ab_trees.sh``.)"""

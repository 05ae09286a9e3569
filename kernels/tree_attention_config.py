"""Tree attention's launch configuration (``treeops.kernels.tree_attention``): the tile, warps,
pipelining and split-KV count of a launch, chosen from capacities (batch, node capacity, heads,
head dim, block-table slots), the element size and the device (SM count, shared memory) only,
never from tensor values, so a launch's grid is fixed for a CUDA graph. Also the candidate tiles
the GPU sweeps time, the tuned choices they produced and the split-KV workspace's size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from treeops import _runtime
from treeops._runtime import interpreted


@dataclass(frozen=True)
class AttnConfig:
    block_q: int
    g_pad: int
    block_n: int
    num_splits: int
    num_warps: int
    num_stages: int
    prefetch: bool = True
    pipe: int = 0  # > 0: the prefix loop is a tl.range pipelined over this many stages
    warp_spec: bool = False  # that loop warp-specialised (producer / consumer warps)
    # a request with fewer keys (prefix + nodes) than split_min_len is not split; else it uses
    # at most num_splits chunks of at least split_chunk keys (``_splits_used``, on the device)
    split_min_len: int = 0
    split_chunk: int = 1
    fused_merge: bool = False  # split tiles merged by their last chunk's program (no merge launch)
    # split partial outputs stored in the inputs' 16-bit dtype instead of fp32 (half the
    # workspace bytes written and merged; the LSEs stay fp32)
    partial_half: bool = False
    # the forward is tree_attention_gluon's (Hopper, 16-bit, D <= 128; ``pipe`` tiles copied
    # ahead), its PV's P through shared memory with ``p_smem``
    gluon: bool = False
    p_smem: bool = False

    @property
    def block_m(self) -> int:
        return self.block_q * self.g_pad


# Split-KV: as many splits as fit the unsplit programs into one program per SM (rounded down),
# never fewer than MIN_CHUNK keys per split, at most MAX_SPLITS. H200, bf16, a block table of
# 8,192 slots, 48 decode shapes (B 1-64, ctx 300-4000, 8 or 64 nodes, heads 10/2 D 64 and 32/8
# D 128; bench_tree_attention.py --splits, bench/results/h200/attention_splits.json): at every
# ctx = 4000 shape the fastest forced count was the largest that keeps the grid within one
# program per SM (2 unsplit programs: 16 splits; 16: 8; 64: 2; 128 or more: 1), the count this
# rule picks. The former target of two programs per SM, rounded up, split grids that were
# already a full wave (B = 16, 4000 keys, 64 nodes: 118 µs in 3 splits, 86 µs unsplit): 1.19x
# the fastest count in geometric mean over the shapes, this rule 1.004x (with MIN_SPLIT_LEN = 0).
# MIN_CHUNK binds only where the block table is short (the study's 8,192 slots split by the
# first rule alone): at B 1, 32/8 heads, D 128, 528 slots (bench_tree_attention.py --latency,
# attention_latency.json), 16 chunks of 33 keys ran a tree of 8 nodes in 9.6 µs against 14.1
# for the 4 chunks of 132 that a 128-key minimum allowed (chained over cold caches), and 8
# chunks a tree of 64 in 13.6 against 15.7; the split count that rule picks was the fastest of
# 1, 2, 3, 4, 8 and 16 (or within 1 % of it) at B 1 ctx 1,024 n 64, B 1 ctx 4,096 n 16 and
# B 4 ctx 512 n 64, where the 32-key minimum changes nothing.
PROGRAMS_PER_SM = 1
MIN_CHUNK = 32
MAX_SPLITS = 16
MIN_SPLIT_CAPACITY = 512
"""Below this many cache slots per request no split. Not measured against splitting (the split
study's block tables hold 8,192 slots), where a 300-key request at B <= 16 ran faster split."""
MIN_SPLIT_LEN = 0
"""A device-side bound on a request's keys below which it is not split (0: none; the override
``split_min_len`` sets one, chunks then of at least ``min_chunk`` keys). None by default: in the
split study (bench_tree_attention.py --splits, H200, 48 shapes over an 8,192-slot block table,
bench/results/h200/attention_splits.json) the count this file's rule picks, splitting
every request, ran at 1.004x the fastest forced count (geometric mean) and a bound of 512 keys at
1.044x: a 300-key request at B <= 16 runs faster split (B = 1, heads 32/8 D 128, 8 nodes: 15.7 µs
split 16 ways, 20.8 unsplit, 23.3 bounded: unsplit plus the merge launch)."""


_PIPED = dict(num_stages=1, prefetch=False)
CANDIDATES: dict[int, dict[str, dict]] = {
    64: {
        "default": {},
        "pipe2": dict(block_m=128, block_n=64, num_warps=8, pipe=2, **_PIPED),
        "pipe3": dict(block_m=128, block_n=64, num_warps=8, pipe=3, **_PIPED),
        "n128_pipe3": dict(block_m=128, block_n=128, num_warps=8, pipe=3, **_PIPED),
        "m64_pipe3": dict(block_m=64, block_n=64, num_warps=4, pipe=3, **_PIPED),
        "m64_pipe4": dict(block_m=64, block_n=64, num_warps=4, pipe=4, **_PIPED),
        "m64_n128_pipe3": dict(block_m=64, block_n=128, num_warps=4, pipe=3, **_PIPED),
        "gluon_m64_n128": dict(block_m=64, block_n=128, num_warps=4, pipe=1, gluon=True, **_PIPED),
        "gluon_m128_n128_ps": dict(
            block_m=128, block_n=128, num_warps=8, pipe=1, gluon=True, p_smem=True, **_PIPED
        ),
    },
    128: {
        "default": {},
        "pipe2": dict(block_m=128, block_n=64, num_warps=8, pipe=2, **_PIPED),
        "pipe3": dict(block_m=128, block_n=64, num_warps=8, pipe=3, **_PIPED),
        "m64_pipe2": dict(block_m=64, block_n=64, num_warps=4, pipe=2, **_PIPED),
        "m64_pipe3": dict(block_m=64, block_n=64, num_warps=4, pipe=3, **_PIPED),
        "m64_pipe4": dict(block_m=64, block_n=64, num_warps=4, pipe=4, **_PIPED),
        "m64_n32_pipe4": dict(block_m=64, block_n=32, num_warps=4, pipe=4, **_PIPED),
        "m128_st2": dict(block_m=128, block_n=64, num_warps=8, num_stages=2, prefetch=False),
        "m64_st2": dict(block_m=64, block_n=64, num_warps=4, num_stages=2, prefetch=False),
        "gluon_m128_n64_ps": dict(
            block_m=128, block_n=64, num_warps=8, pipe=2, gluon=True, p_smem=True, **_PIPED
        ),
        "gluon_m128_n64": dict(block_m=128, block_n=64, num_warps=8, pipe=2, gluon=True, **_PIPED),
        "gluon_m64_n64": dict(block_m=64, block_n=64, num_warps=4, pipe=1, gluon=True, **_PIPED),
        "gluon_m64_n64_ps": dict(
            block_m=64, block_n=64, num_warps=4, pipe=1, gluon=True, p_smem=True, **_PIPED
        ),
        # two programs an SM fit this tile (99 KiB shared): split counts sized to fill them both
        "gluon_m64_n64_2per_sm": dict(
            block_m=64, block_n=64, num_warps=4, pipe=1, gluon=True, programs_per_sm=2, **_PIPED
        ),
    },
    256: {
        "default": {},
        "m64_prefetch": dict(block_m=64, block_n=32, num_warps=8, num_stages=2, prefetch=True),
        "m128_st3": dict(block_m=128, block_n=32, num_warps=8, num_stages=3, prefetch=False),
        "m128_n16": dict(block_m=128, block_n=16, num_warps=8, num_stages=1, prefetch=False),
    },
}
"""Launch configurations a GPU sweep times per head-dim class (64, 128, 256; bench/
bench_tree_attention.py --sweep): ``pick_config`` overrides, each spill-free on sm_90 (bench/
compile_check.py --attention-configs, in CI). "default" is the built-in choice; "pipeN" runs the
prefix loop as a ``tl.range(num_stages=N)`` instead of the hand prefetch; "m64" tiles (4 warps,
~83 KiB shared, <= 255 registers) fit two programs per SM, so one program's softmax can overlap
the other's MMAs; "m64_n32_pipe4" (168 registers, ~50 KiB shared) could fit three; "stN" tiles
leave every key loop (the tree's too) to Triton's N-stage pipeliner, as D 256's built-in tile
does. At D 256, "m64_prefetch" is the 64-row tile the built-in 128-row one replaced. "gluon_*" tiles
run the Gluon forward; its "m64_n64" ones (one warpgroup, a one-tile lookahead: 99-108 KiB
shared, about 200 registers) fit two programs per SM, so that one's softmax can run under the
other's wgmmas.
``{"small_tree": True}`` (the small-tree path) is a candidate wherever it applies."""

TUNED: dict[int, str] = {64: "m64_n128_pipe3", 128: "m64_pipe3"}
"""Head-dim class -> the CANDIDATES entry launched when no override is given, ``GLUON``'s tile does
not apply and this one fills the GPU unsplit (``_tuned_override``); other launches keep the built-in
tiles. From the H200 sweep (bench_tree_attention.py --sweep,
bench/results/h200/tree_attention_sweep.json), unsplit shapes, µs built-in -> tuned: D 128 B 8 ctx
4,096 n 64 135.9 -> 123.3, B 32 520.0 -> 446.8, B 4 n 127 137.9 -> 126.6, B 16 n 128 526.8 -> 454.0
("m64_pipe4" within 1 % of it everywhere); D 64 B 32 ctx 2,048 198.9 -> 156.2, B 8 ctx 4,096 89.1 ->
77.7 (where "m64_pipe3" ran 98.6). Split shapes ran slower with the m64 tiles (B 1 ctx 16,384 n 64:
85.7 -> 142.4: twice the query tiles leave half the splits), so the rule keeps them off there. D 256
needs no entry: its built-in tile is the sweep's best at every shape, split or not."""

GLUON: dict[int, str] = {64: "gluon_m64_n128", 128: "gluon_m64_n64_2per_sm"}
"""Head-dim class -> the CANDIDATES entry launched by default (split or not) for 16-bit inputs at
head dim 64 or 128 wherever its tile has at least 16 rows a warp (``_gluon_override``): the Gluon
forward (``tree_attention_gluon``: its softmax issued under the pending PV wgmma). H200 sweep
(bench_tree_attention.py --sweep, session 33), µs, Triton kernel's default -> Gluon: D 128 B 1 ctx
16,384 n 64 (split) 79.8 -> 56.9, B 8 ctx 4,096 n 64 132.1 -> 102.4, B 32 526.1 -> 401.9, B 4 n 127
132.7 -> 105.5, B 16 n 128 518.6 -> 400.2, B 1 ctx 1,024 n 64 15.9 -> 14.7; D 64 B 32 ctx 2,048
161.0 -> 131.4, B 8 ctx 4,096 75.0 -> 60.0. At D 128 the 64-row tile of 4 warps, its split
count sized for two programs an SM, replaced the 128-row tile of 8 (H100 sweep, session 38, 13
layout shapes, µs 128-row -> it): faster on 12, by 4-30 % (B 16 ctx 4,096 n 128 386.7 -> 356.8,
B 1 ctx 1,024 n 64 15.7 -> 14.7; 16-node trees, which the 8-warp tile left to the Triton kernel:
B 64 ctx 512 95.4 -> 67.3, B 1 ctx 4,096 22.5 -> 18.5), 5.6 % slower at B 1 ctx 16,384 n 64
(58.2 -> 61.4). Elsewhere (fewer rows, fp32, D 256, another GPU:
``launchable``) ``TUNED`` and the built-in tiles apply."""
SMALL_TREE = False
"""Launch the small-tree path by default wherever it applies. Off: slower than the split launch
where it applies (B 1, ctx 512, n 8: 17.6 against 8.6 µs; attention_latency, H200, session 29)."""
FUSED_MERGE = False
"""Merge a split tile in the forward kernel, by the last of its chunks' programs to finish
(``arrival_counters``), instead of in a ``_merge_splits`` launch (``{"fused_merge": True}`` turns
it on per launch). Off: in the split study it ran at 1.027x the separate merge (geometric mean,
48 shapes), up to 1.4x slower where 16 chunks of a long context finish together (B = 1, 4,000
keys, 64 nodes, heads 10/2: 35.5 µs against 25.9), its last arriver merging alone.
Launches sharing the counters must not run concurrently on different streams."""
SMALL_TREE_MAX_N = 16
SMALL_TREE_MAX_CAPACITY = 1024 + 64
"""The small-tree path applies to N <= SMALL_TREE_MAX_N query rows and block tables of at most
SMALL_TREE_MAX_CAPACITY slots: one program per (request, KV head) holds every node and query head
of its group, walks all keys and writes the output itself (one launch, no split, no merge)."""


D256_WIDE_SHARED = 136 * 1024
"""Opt-in shared memory per block the built-in 128-row D 256 tile needs (Q, two K/V stages:
132,608 bytes on sm_90); a GPU with less (sm_86/89/120: 99 KiB) keeps the 64-row tile."""


def head_dim_class(D: int) -> int:
    return 64 if D <= 64 else 128 if D <= 128 else 256


def _small_rows(N: int, g_pad: int) -> int:
    return g_pad * max(triton.next_power_of_2(N), triton.cdiv(16, g_pad))


def _block_q(block_m: int, g_pad: int, N: int) -> int:
    """Tree nodes per query tile of block_m rows (g_pad query heads a node), at least 16 rows
    (tl.dot's minimum M) and no more nodes than the tree has (rounded to a power of two)."""
    block_q = min(max(1, block_m // g_pad), triton.next_power_of_2(N))
    return max(block_q, triton.cdiv(16, g_pad))


def _tuned_override(
    B: int, N: int, H_kv: int, g_pad: int, D: int, sms: int, num_splits: int | None
) -> dict | None:
    """``TUNED``'s candidate for this head dim where its tile gives at least PROGRAMS_PER_SM
    programs per SM unsplit and no split count above 1 was asked for; None (the built-in tiles)
    elsewhere."""
    name = TUNED.get(head_dim_class(D))
    if name is None or (num_splits is not None and num_splits > 1):
        return None
    override = CANDIDATES[head_dim_class(D)][name]
    block_q = _block_q(override.get("block_m", 128), g_pad, N)
    # a full wave unsplit: at 128 programs on 132 SMs the built-in tile split in two ran faster
    # at long contexts (B 4 n 64 ctx 32,768: 552 against 760 µs)
    fills = B * H_kv * triton.cdiv(N, block_q) >= PROGRAMS_PER_SM * sms
    return override if fills else None


def _gluon_override(N: int, g_pad: int, D: int, elem_bytes: int) -> dict | None:
    """``GLUON``'s candidate for 16-bit inputs at head dim 64 or 128 where its query tile has at
    least 16 rows a warp (a wgmma's M); None elsewhere."""
    name = GLUON.get(head_dim_class(D))
    if name is None or elem_bytes != 2 or D not in (64, 128):
        return None
    override = CANDIDATES[head_dim_class(D)][name]
    rows = _block_q(override["block_m"], g_pad, N) * g_pad
    return override if rows >= 16 * override["num_warps"] else None


def small_tree_applies(N: int, g_pad: int, D: int, kv_capacity: int) -> bool:
    """Whether the small-tree path takes (N nodes, padded group g_pad, head dim D, block-table
    slots): few nodes, a short cache, and a tile that compiles spill-free on sm_90 (at D = 256
    only up to 64 rows)."""
    fits = D <= 128 or _small_rows(N, g_pad) <= 64
    return N <= SMALL_TREE_MAX_N and kv_capacity <= SMALL_TREE_MAX_CAPACITY and fits


def pick_config(
    B: int,
    N: int,
    H_q: int,
    H_kv: int,
    D: int,
    kv_capacity: int,
    sms: int,
    interpret: bool,
    num_splits: int | None = None,
    override: dict | None = None,
    elem_bytes: int = 2,
    max_shared: int = 232448,
) -> AttnConfig:
    """Tile sizes and split count from capacities, the element size and the device (SM count,
    opt-in shared memory per block) only, never tensor values.

    ``override`` (tests, the benchmark's sweep) replaces any of block_m, block_n, num_warps,
    num_stages, prefetch, pipe, warp_specialize, programs_per_sm, min_chunk, split_min_len,
    fused_merge, partial_half (16-bit inputs, split launches; slower at four of five small-tree
    shapes on the H200, docs/design.md, so never chosen without an override); ``small_tree:
    True`` takes the small-tree path where ``small_tree_applies`` (else it is ignored). An
    explicit ``num_splits`` splits every request into that many chunks (as far as it has keys);
    the automatic count is a cap each request lowers on the device from its own key count
    (``MIN_SPLIT_LEN``, ``min_chunk``). Without an override, ``SMALL_TREE``, ``GLUON``,
    ``FUSED_MERGE`` and ``TUNED`` choose among the candidates (compiled runs only)."""
    g = H_q // H_kv
    g_pad = triton.next_power_of_2(g)
    if override is None and not interpret:
        if SMALL_TREE and small_tree_applies(N, g_pad, D, kv_capacity):
            override = {"small_tree": True}
        else:
            override = _gluon_override(N, g_pad, D, elem_bytes) or _tuned_override(
                B, N, H_kv, g_pad, D, sms, num_splits
            )
    # 8 warps at every head dim: with 4, the D = 64 and D = 256 tiles spill on sm_90 (76 and
    # 532 bytes per thread; bench/attention_notes.md), with 8 none does (checked in CI,
    # tests/test_compile_check.py)
    if interpret:
        block_m, block_n, warps, stages, prefetch = 64, 32, 4, 1, False
    elif D <= 64:
        block_m, block_n, warps, stages, prefetch = 128, 64, 8, 3, True
    elif D <= 128:
        # with the hand-pipelined loop, one stage beats 2 or 3 (bench/attention_notes.md)
        block_m, block_n, warps, stages, prefetch = 128, 64, 8, 1, True
    elif elem_bytes <= 2 and max_shared >= D256_WIDE_SHARED:
        # two warpgroups of 64 rows, each a full wgmma M; spill-free only with Triton's own
        # two-stage loop (the hand prefetch holds a second K/V tile in registers: 280 bytes a
        # thread). The 64-row tile it replaced ran at 2.07x its time (B 32 ctx 2,048 n 64: 599.9
        # against 289.9 µs; H200 sweep, "m64_prefetch")
        block_m, block_n, warps, stages, prefetch = 128, 32, 8, 2, False
    else:
        # fp32 (a 128-row tile's Q and two K/V stages: 256 KiB) or a GPU with less shared memory
        block_m, block_n, warps, stages, prefetch = 64, 32, 8, 2, True
    pipe, warp_spec = 0, False
    gluon = p_smem = False
    ppsm, min_chunk = PROGRAMS_PER_SM, MIN_CHUNK
    # an explicit split count splits every request that has the keys for it
    split_min_len = MIN_SPLIT_LEN if num_splits is None else 0
    fused = FUSED_MERGE and not interpret
    half = False
    small = bool(override and override.get("small_tree"))
    if small and small_tree_applies(N, g_pad, D, kv_capacity):
        # every node of the tree in one query tile; the largest key tile and fewest warps that
        # compile spill-free on sm_90 (D = 256: 8 warps, 16 keys below 64 rows)
        block_m = _small_rows(N, g_pad)
        block_n = 64 if D <= 128 else 32 if block_m >= 64 else 16
        warps = 4 if block_m <= 64 and D <= 128 else 8
        stages, prefetch, pipe = 1, False, 2
        num_splits = 1 if num_splits is None else num_splits
    if override:
        prefetch = override.get("prefetch", prefetch)
        ppsm = override.get("programs_per_sm", ppsm)
        min_chunk = override.get("min_chunk", min_chunk)
        split_min_len = override.get("split_min_len", split_min_len)
        fused = override.get("fused_merge", fused)
        half = override.get("partial_half", False)
        block_m = override.get("block_m", block_m)
        block_n = override.get("block_n", block_n)
        warps = override.get("num_warps", warps)
        stages = override.get("num_stages", stages)
        pipe = override.get("pipe", pipe)
        warp_spec = override.get("warp_specialize", warp_spec)
        gluon = bool(override.get("gluon", False))
        p_smem = bool(override.get("p_smem", False))
    # the Gluon forward: Hopper wgmma on 16-bit inputs, 128-key or 64-key tiles, D <= 128; the
    # interpreter has no Gluon (the Triton kernel runs at the same tiles)
    gluon = gluon and not interpret and elem_bytes == 2 and D <= 128 and block_n >= 64
    if gluon:
        pipe, fused, half = max(pipe, 1), False, False
    block_q = _block_q(block_m, g_pad, N)
    # a wgmma tile is 16 rows a warp: fewer rows (a small tree) run the Triton kernel
    gluon = gluon and block_q * g_pad >= 16 * warps
    m_tiles = triton.cdiv(N, block_q)
    if num_splits is None:
        base = B * H_kv * m_tiles
        target = ppsm * sms
        num_splits = 1
        if base < target and kv_capacity >= MIN_SPLIT_CAPACITY:
            num_splits = min(target // base, MAX_SPLITS, max(1, kv_capacity // min_chunk))
    num_splits = max(1, num_splits)
    # the device-side rule (_splits_used): no bound and 1-key chunks leave an explicit count as
    # asked; unsplit launches carry neutral values (one compiled variant)
    split_chunk = 1 if split_min_len == 0 or num_splits == 1 else min_chunk
    if num_splits == 1:
        split_min_len = 0
    return AttnConfig(
        block_q, g_pad, block_n, num_splits, warps, stages, prefetch, pipe, warp_spec,
        split_min_len, split_chunk, bool(fused) and num_splits > 1,
        partial_half=bool(half) and num_splits > 1 and elem_bytes == 2,
        gluon=gluon,
        p_smem=gluon and p_smem,
    )  # fmt: skip


def workspace_numel(B: int, N: int, H_q: int, D: int, cfg: AttnConfig) -> int:
    """fp32 elements of the split-KV workspace: partial outputs then partial LSEs."""
    if cfg.num_splits == 1:
        return 0
    return B * N * H_q * cfg.num_splits * (D + 1)


def config_for(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    num_splits: int | None = None,
    override: dict | None = None,
) -> AttnConfig:
    B, N, H_q, D = q.shape
    kv_capacity = block_table.shape[1] * k_cache.shape[1]
    return pick_config(
        B,
        N,
        H_q,
        k_cache.shape[2],
        D,
        kv_capacity,
        _runtime.sm_count(q.device),
        interpreted(),
        num_splits,
        override,
        q.element_size(),
        _runtime.shared_memory(q.device),
    )

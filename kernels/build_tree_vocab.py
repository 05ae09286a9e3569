"""The draft layer expand's pass over the vocabulary (``treeops.kernels.build_tree.expand``).

Packed keys: ``(order-preserving bits of the logit) << 32 | (2^31 - 1 - token)``, so that one
max-reduction picks the larger logit and, on ties, the lower id.

- ``_stream_row``: one program's pass over (a chunk of) a row, online max/sum and a running
  top-K that merges a block only when its max beats the current K-th key (the unsplit expand).
- ``_stream_kernel`` (``_stream_tiles``): the split expand's first launch, one-warp programs
  over (row, chunk of V) writing each chunk's max and sum and the max of each block of ``MB``
  tokens (the streamed tile, or a part of it), no top-K work.
- ``_combine_softmax`` and ``_top_of_tiles``: what the per-row program of the second launch
  makes of them: the row's softmax, and its exact top-K from the K blocks ("tiles" there) with
  the largest maxima (a block holding a top-K element has its max at or above the K-th key,
  and at most K blocks do): the logits of those blocks at or above the K-th block's max,
  compacted and ranked at once, or (when too many are equal) ``_top_of_tiles_merged``'s
  block-by-block merge. Smaller blocks: fewer logits re-read, more maxima to rank.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._pdl import pdl_enter, pdl_release


@triton.jit
def _ordered(x):
    """float32 -> int32 whose signed order is the float order (-0.0 must be normalised first)."""
    xb = x.to(tl.int32, bitcast=True)
    return xb ^ ((xb >> 31) & 0x7FFFFFFF)


@triton.jit
def _unordered(o):
    """Inverse of ``_ordered`` (the map is an involution)."""
    return (o ^ ((o >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _sum_exp(b_x, m_use):
    """sum(exp(b_x - m_use)) as exp2 of one fused multiply-add per element: ``tl.exp`` lowers to
    ex2 plus a subnormal fix-up (a compare and two predicated multiplies per element, measured
    in the sm_90 SASS), ``tl.exp2`` to one MUFU.EX2. A term that flushes to zero is below 2^-126
    beside the row max's exp(0) = 1."""
    return tl.sum(tl.exp2(b_x * 1.4426950408889634 - m_use * 1.4426950408889634))


@triton.jit
def _tile(p_row, v0, v_hi, V, BLOCK_V: tl.constexpr):
    """Logits ``[v0, v0 + BLOCK_V)`` of a row as loaded (raw 16-bit values where the logits are:
    cheap registers for a tile in flight); -inf past V or from ``v_hi`` on (a uniform bound: the
    "< V" part, V specialised, keeps the load vectorised)."""
    o_b = tl.arange(0, BLOCK_V)
    return tl.load(p_row + v0 + o_b, mask=(v0 + o_b < V) & (v0 < v_hi), other=-float("inf"))


@triton.jit
def _merge_keys(b_x, o_v, V, b_top, b_thr):
    """The running top-K packed keys ``b_top`` (its K-th, the smallest, ``b_thr``) with the
    logits ``b_x`` (float32, -0.0 normalised) of tokens ``o_v`` merged in, those past V left
    out: at most K rounds, each taking the block's best key while it beats the K-th."""
    b_key = (_ordered(b_x).to(tl.int64) << 32) | (0x7FFFFFFF - o_v).to(tl.int64)
    b_key = tl.where(o_v < V, b_key, -9223372036854775807 - 1)
    b_best = tl.max(b_key)
    while b_best > b_thr:
        b_top = tl.where(b_top == b_thr, b_best, b_top)
        b_key = tl.where(b_key == b_best, -9223372036854775807 - 1, b_key)
        b_thr = tl.min(b_top)
        b_best = tl.max(b_key)
    return b_top, b_thr


@triton.jit
def _stream_row(
    p_row, v_lo, v_hi, V, row_ok, K: tl.constexpr, KP: tl.constexpr, BLOCK_V: tl.constexpr
):
    """Online max/sum and running top-K keys of logits ``[v_lo, v_hi)`` of one row."""
    o_k = tl.arange(0, KP)
    key_min = tl.full([KP], -9223372036854775807 - 1, tl.int64)
    # distinct sentinels so that "the worst slot" is unique; any real key beats them
    b_top = tl.where(o_k < K, key_min + 1 + o_k, 9223372036854775807)
    b_thr = tl.min(b_top)
    m_run = tl.sum(tl.zeros([KP], tl.float32)) - float("inf")  # fp32 scalars (loop-carried)
    s_run = tl.sum(tl.zeros([KP], tl.float32))
    if row_ok:
        # two tiles in flight ahead of the one being reduced, so each HBM round trip overlaps
        # two tiles of work
        o_b = tl.arange(0, BLOCK_V)
        b_n1 = _tile(p_row, v_lo, v_hi, V, BLOCK_V)
        b_n2 = _tile(p_row, v_lo + BLOCK_V, v_hi, V, BLOCK_V)
        for v0 in range(v_lo, v_hi, BLOCK_V):
            o_v = v0 + o_b
            b_raw, b_n1 = b_n1, b_n2
            b_n2 = _tile(p_row, v0 + 2 * BLOCK_V, v_hi, V, BLOCK_V)
            b_x = b_raw.to(tl.float32) + 0.0
            b_max = tl.max(b_x)
            m_new = tl.maximum(m_run, b_max)
            m_use = tl.where(m_new == -float("inf"), 0.0, m_new)  # all -inf so far: no NaN
            s_run = s_run * tl.exp(m_run - m_use) + _sum_exp(b_x, m_use)
            m_run = m_new
            # a block element with the K-th best value loses the tie (larger id): strict >
            if _ordered(b_max) > (b_thr >> 32).to(tl.int32):
                b_top, b_thr = _merge_keys(b_x, o_v, V, b_top, b_thr)
    return m_run, s_run, b_top


@triton.jit
def _tile_blocks(p_row, v0, v_hi, V, BLOCK_V: tl.constexpr, MB: tl.constexpr):
    """``_tile`` as [BLOCK_V // MB, MB]: one MB-token block per row."""
    o_v = v0 + tl.arange(0, BLOCK_V // MB)[:, None] * MB + tl.arange(0, MB)[None, :]
    return tl.load(p_row + o_v, mask=(o_v < V) & (v0 < v_hi), other=-float("inf"))


@triton.jit
def _block_maxima(b_raw, v0, v_hi, p_tmax, BLOCK_V: tl.constexpr, MB: tl.constexpr):
    """A ``_tile_blocks`` tile as float32 (-0.0 as 0.0, for ``_ordered``) and its max, each
    block's max stored as its ``_ordered`` int32 at ``p_tmax[v // MB]`` (blocks from ``v_hi`` on
    left alone)."""
    o_r = tl.arange(0, BLOCK_V // MB)
    b_x = b_raw.to(tl.float32)
    b_bm = tl.max(b_x, axis=1) + 0.0
    tl.store(p_tmax + v0 // MB + o_r, _ordered(b_bm), mask=v0 + o_r * MB < v_hi)
    return b_x, tl.max(b_bm)


@triton.jit
def _stream_tiles(
    p_row, v_lo, v_hi, V, row_ok, p_tmax, BLOCK_V: tl.constexpr, MB: tl.constexpr,
    AHEAD: tl.constexpr, EARLY: tl.constexpr,
):  # fmt: skip
    """Online max/sum of logits ``[v_lo, v_hi)`` of one row (whole tiles of ``BLOCK_V``), and the
    max of each block of ``MB`` tokens as its order-preserving int32 (``_ordered``) at
    ``p_tmax[v // MB]``: all the top-K pass needs to know which blocks to read
    (``_top_of_tiles``). ``AHEAD`` (2 or 3) tiles are loaded ahead of the one being reduced.
    ``EARLY`` (with MB < BLOCK_V): the first tiles are loaded before ``row_ok`` is known."""
    m_run = tl.sum(tl.zeros([2], tl.float32)) - float("inf")  # fp32 scalars (loop-carried)
    s_run = tl.sum(tl.zeros([2], tl.float32))
    if MB < BLOCK_V:
        # a max per MB-token block: the top-K pass re-reads blocks of MB, not tiles
        if EARLY:
            b_n1 = _tile_blocks(p_row, v_lo, v_hi, V, BLOCK_V, MB)
            b_n2 = _tile_blocks(p_row, v_lo + BLOCK_V, v_hi, V, BLOCK_V, MB)
            if AHEAD == 3:
                b_n3 = _tile_blocks(p_row, v_lo + 2 * BLOCK_V, v_hi, V, BLOCK_V, MB)
        if row_ok:
            if not EARLY:
                b_n1 = _tile_blocks(p_row, v_lo, v_hi, V, BLOCK_V, MB)
                b_n2 = _tile_blocks(p_row, v_lo + BLOCK_V, v_hi, V, BLOCK_V, MB)
                if AHEAD == 3:
                    b_n3 = _tile_blocks(p_row, v_lo + 2 * BLOCK_V, v_hi, V, BLOCK_V, MB)
            for v0 in range(v_lo, v_hi, BLOCK_V):
                if AHEAD == 3:
                    b_raw, b_n1, b_n2 = b_n1, b_n2, b_n3
                    b_n3 = _tile_blocks(p_row, v0 + 3 * BLOCK_V, v_hi, V, BLOCK_V, MB)
                else:
                    b_raw, b_n1 = b_n1, b_n2
                    b_n2 = _tile_blocks(p_row, v0 + 2 * BLOCK_V, v_hi, V, BLOCK_V, MB)
                b_x, b_max = _block_maxima(b_raw, v0, v_hi, p_tmax, BLOCK_V, MB)
                m_new = tl.maximum(m_run, b_max)
                m_use = tl.where(m_new == -float("inf"), 0.0, m_new)  # all -inf so far: no NaN
                s_run = s_run * tl.exp(m_run - m_use) + _sum_exp(b_x, m_use)
                m_run = m_new
    elif row_ok:
        # AHEAD tiles in flight ahead of the one being reduced, as in _stream_row
        b_n1 = _tile(p_row, v_lo, v_hi, V, BLOCK_V)
        b_n2 = _tile(p_row, v_lo + BLOCK_V, v_hi, V, BLOCK_V)
        if AHEAD == 3:
            b_n3 = _tile(p_row, v_lo + 2 * BLOCK_V, v_hi, V, BLOCK_V)
        for v0 in range(v_lo, v_hi, BLOCK_V):
            if AHEAD == 3:
                b_raw, b_n1, b_n2 = b_n1, b_n2, b_n3
                b_n3 = _tile(p_row, v0 + 3 * BLOCK_V, v_hi, V, BLOCK_V)
            else:
                b_raw, b_n1 = b_n1, b_n2
                b_n2 = _tile(p_row, v0 + 2 * BLOCK_V, v_hi, V, BLOCK_V)
            b_x = b_raw.to(tl.float32)
            # a float max, then the tile's rank key from that one scalar (+ 0.0: -0.0 to 0.0, as
            # _ordered needs): per element one max, not an integer transform and a max
            b_max = tl.max(b_x) + 0.0
            tl.store(p_tmax + v0 // BLOCK_V, _ordered(b_max))
            m_new = tl.maximum(m_run, b_max)
            m_use = tl.where(m_new == -float("inf"), 0.0, m_new)  # all -inf so far: no NaN
            s_run = s_run * tl.exp(m_run - m_use) + _sum_exp(b_x, m_use)
            m_run = m_new
    return m_run, s_run


@triton.jit
def _tile_lanes(
    p_row, v0, v_hi, V, BLOCK_V: tl.constexpr, MB: tl.constexpr, VEC: tl.constexpr,
    WARPS: tl.constexpr,
):  # fmt: skip
    """``_tile`` as [BLOCK_V // MB, MB // VEC, VEC]: one MB-token block per row, split into
    VEC-token vectors (VEC 16-bit logits: one 16-byte load, so a thread holds whole vectors and
    a reduction over the last axis stays in its registers). With more than one warp the tile is
    loaded as [MB // VEC, BLOCK_V // MB, VEC] and permuted, which places the warps along the
    blocks: a block's max then never crosses a warp (loaded as blocks first, the warps split
    each block's vectors, and every tile's block maxima went through shared memory)."""
    o_b = tl.arange(0, BLOCK_V // MB) * MB
    o_m = tl.arange(0, MB // VEC) * VEC
    o_e = tl.arange(0, VEC)[None, None, :]
    if WARPS > 1:
        o_v = v0 + o_m[:, None, None] + o_b[None, :, None] + o_e
        x = tl.load(p_row + o_v, mask=(o_v < V) & (v0 < v_hi), other=-float("inf"))
        return tl.permute(x, (1, 0, 2))
    else:
        o_v = v0 + o_b[:, None, None] + o_m[None, :, None] + o_e
        return tl.load(p_row + o_v, mask=(o_v < V) & (v0 < v_hi), other=-float("inf"))


@triton.jit
def _stream_tiles_lanes(
    p_row, v_lo, v_hi, V, row_ok, p_tmax, BLOCK_V: tl.constexpr, MB: tl.constexpr,
    VEC: tl.constexpr, WARPS: tl.constexpr, EARLY: tl.constexpr,
):  # fmt: skip
    """``_stream_tiles`` (two tiles ahead) with the softmax's max and sum kept per vector
    (each thread's own VEC tokens: an online max/sum per register) and reduced across threads
    once, after the chunk, instead of a tile max and a tile sum across the warp per tile: per
    tile, only the block maxima cross threads. An extra exp2 per vector and tile (the rescale)
    buys the removal of the per-tile shuffle chains that every exp2 of the tile waited on.
    ``EARLY``: the first two tiles are loaded before ``row_ok`` is known."""
    NB: tl.constexpr = BLOCK_V // MB
    MV: tl.constexpr = MB // VEC
    m_vec = tl.full([NB, MV], -float("inf"), tl.float32)
    s_vec = tl.zeros([NB, MV], tl.float32)
    if EARLY:
        b_n1 = _tile_lanes(p_row, v_lo, v_hi, V, BLOCK_V, MB, VEC, WARPS)
        b_n2 = _tile_lanes(p_row, v_lo + BLOCK_V, v_hi, V, BLOCK_V, MB, VEC, WARPS)
    if row_ok:
        o_r = tl.arange(0, NB)
        if not EARLY:
            b_n1 = _tile_lanes(p_row, v_lo, v_hi, V, BLOCK_V, MB, VEC, WARPS)
            b_n2 = _tile_lanes(p_row, v_lo + BLOCK_V, v_hi, V, BLOCK_V, MB, VEC, WARPS)
        for v0 in range(v_lo, v_hi, BLOCK_V):
            b_raw, b_n1 = b_n1, b_n2
            b_n2 = _tile_lanes(p_row, v0 + 2 * BLOCK_V, v_hi, V, BLOCK_V, MB, VEC, WARPS)
            b_x = b_raw.to(tl.float32)
            r_max = tl.max(b_x, axis=2)  # [NB, MV], in each thread's registers
            b_bm = tl.max(r_max, axis=1) + 0.0  # -0.0 to 0.0, as _ordered needs
            tl.store(p_tmax + v0 // MB + o_r, _ordered(b_bm), mask=v0 + o_r * MB < v_hi)
            m_new = tl.maximum(m_vec, r_max)
            m_use = tl.where(m_new == -float("inf"), 0.0, m_new)  # all -inf so far: no NaN
            e_x = tl.exp2(b_x * 1.4426950408889634 - (m_use * 1.4426950408889634)[:, :, None])
            s_vec = s_vec * tl.exp2((m_vec - m_use) * 1.4426950408889634) + tl.sum(e_x, axis=2)
            m_vec = m_new
    m_run = tl.max(tl.max(m_vec, axis=1), axis=0)
    m_use = tl.where(m_run == -float("inf"), 0.0, m_run)
    s_run = tl.sum(tl.sum(s_vec * tl.exp2((m_vec - m_use) * 1.4426950408889634), axis=1), axis=0)
    return m_run, s_run


@triton.jit
def _combine_softmax(p_part_m, p_part_s, o_row, SPLIT: tl.constexpr, SP: tl.constexpr):
    """Merge the SPLIT partial (max, sum) of one row (written by other programs)."""
    o_s = tl.arange(0, SP)
    m_s = o_s < SPLIT
    b_pm = tl.load(
        p_part_m + o_row * SPLIT + o_s, mask=m_s, other=-float("inf"), cache_modifier=".cg"
    )
    b_ps = tl.load(p_part_s + o_row * SPLIT + o_s, mask=m_s, other=0.0, cache_modifier=".cg")
    m_run = tl.max(b_pm)
    m_use = tl.where(m_run == -float("inf"), 0.0, m_run)
    s_run = tl.sum(tl.where(m_s, b_ps * tl.exp(b_pm - m_use), 0.0))
    return m_run, s_run


@triton.jit
def _next_tile(t_key, BLOCK_V: tl.constexpr):
    """The best-ranked tile left in ``t_key`` (then removed from it): its first token and the
    best packed key it can hold (its max with its first token; the smallest key when no tile
    is left: below every threshold)."""
    t_best = tl.max(t_key)
    t_key = tl.where(t_key == t_best, -9223372036854775807 - 1, t_key)
    v0 = (0x7FFFFFFF - (t_best & 0xFFFFFFFF)).to(tl.int32) * BLOCK_V
    bound = ((t_best >> 32) << 32) | (0x7FFFFFFF - v0).to(tl.int64)
    bound = tl.where(t_best > -9223372036854775807 - 1, bound, -9223372036854775807 - 1)
    return t_key, v0, bound


@triton.jit
def _top_of_tiles_merged(p_row, t_key, V, K: tl.constexpr, KP: tl.constexpr, BLOCK_V: tl.constexpr):
    """The row's top-K packed keys from the tiles ranked by ``t_key`` (``_top_of_tiles``' tile
    keys), read in rank order, three ahead of the one merged, each merged like ``_stream_row``'s
    blocks; a tile whose best possible key (its max, its first token) is below the K-th key
    found so far is skipped unread, and then so is every tile after it. Exact on any input,
    ties included; about 3 K block-wide reductions in sequence."""
    o_k = tl.arange(0, KP)
    key_min = tl.full([KP], -9223372036854775807 - 1, tl.int64)
    b_top = tl.where(o_k < K, key_min + 1 + o_k, 9223372036854775807)  # as in _stream_row
    b_thr = tl.min(b_top)
    o_b = tl.arange(0, BLOCK_V)
    # three tiles in flight ahead of the one being merged (a tile is BLOCK_V / 128 raw 16-bit
    # values per thread: cheap), so the row's ~K reads cost ~K / 3 round trips, not K. A tile not
    # to read starts at V: its load is masked off entirely. The K-th key only rises, so a tile
    # the bound skips when its read is issued stays skipped.
    t_key, v_1, bound_1 = _next_tile(t_key, BLOCK_V)
    b_1 = _tile(p_row, tl.where(bound_1 > b_thr, v_1, V), V, V, BLOCK_V)
    t_key, v_2, bound_2 = _next_tile(t_key, BLOCK_V)
    b_2 = _tile(p_row, tl.where(bound_2 > b_thr, v_2, V), V, V, BLOCK_V)
    t_key, v_3, bound_3 = _next_tile(t_key, BLOCK_V)
    b_3 = _tile(p_row, tl.where(bound_3 > b_thr, v_3, V), V, V, BLOCK_V)
    for _ in range(K):
        b_raw, v0, bound = b_1, v_1, bound_1
        b_1, v_1, bound_1 = b_2, v_2, bound_2
        b_2, v_2, bound_2 = b_3, v_3, bound_3
        t_key, v_3, bound_3 = _next_tile(t_key, BLOCK_V)
        b_3 = _tile(p_row, tl.where(bound_3 > b_thr, v_3, V), V, V, BLOCK_V)
        if bound > b_thr:
            b_top, b_thr = _merge_keys(b_raw.to(tl.float32) + 0.0, v0 + o_b, V, b_top, b_thr)
    return b_top


@triton.jit
def _read_tiles(p_row, b_v0, g, V, v_none, K: tl.constexpr, KP: tl.constexpr, GT: tl.constexpr,
                BLOCK_V: tl.constexpr):  # fmt: skip
    """Tiles ``g .. g + GT`` of the K whose first tokens are ``b_v0`` [KP] (v_none: none, and
    past K none): their [GT, BLOCK_V] token ids and raw logits (-inf past V)."""
    o_k = tl.arange(0, KP)
    o_g = tl.arange(0, GT)
    v0_g = tl.sum(tl.where(o_k[None, :] == g + o_g[:, None], b_v0[None, :], 0), axis=1)
    v0_g = tl.where(g + o_g < K, v0_g, v_none)
    # every entry a tile's first token (or v_none): BLOCK_V-aligned, so the reads are 16-byte
    # vectors where the row is 16-byte aligned
    v0_g = tl.multiple_of(v0_g, BLOCK_V)
    o_v = v0_g[:, None] + tl.arange(0, BLOCK_V)[None, :]  # [GT, BLOCK_V]
    return o_v, tl.load(p_row + o_v, mask=o_v < V, other=-float("inf"))


@triton.jit
def _top_of_tiles(
    p_row,
    p_tmax,
    V,
    row_ok,
    K: tl.constexpr,
    KP: tl.constexpr,
    BLOCK_V: tl.constexpr,
    NT: tl.constexpr,
    NTP: tl.constexpr,
    GT: tl.constexpr,
    CAP: tl.constexpr,
    BLOCKS_TOPK: tl.constexpr,
    RANK_TOPK: tl.constexpr,
    CAND_AHEAD: tl.constexpr,
):
    """The row's top-K packed keys, reading only the tiles that can hold them.

    Tiles rank by their max, the lower tile first on ties (tiles are contiguous token ranges,
    so this is the order of each tile's best packed key). A tile holding one of the row's top-K
    elements has its best key at or above the K-th key, and at most K tiles do: they are the K
    best-ranked tiles. Each of those holds an element at or above the K-th best tile's max
    ``T``, so the row's K-th largest logit is at least ``T``: the top-K are among the elements
    of those K tiles with a logit >= ``T``. Those are read ``GT`` tiles at a time, and the
    tokens at or above ``T`` are compacted (a prefix sum) into ``p_tmax``'s row, whose tile
    maxima are in registers by then and which the next ``_stream_kernel`` launch rewrites
    (``CAND_AHEAD``: each read of GT tiles issued before the one before is compacted, as the
    reads' addresses do not depend on the running count).
    When they fit (at most ``min(CAP, NT)``; at least K qualify, the K tiles' maxima), their keys
    are ranked at once: a constant number of block-wide steps instead of a reduction per
    candidate. Otherwise (many equal logits), or always with ``CAP`` = 0,
    ``_top_of_tiles_merged`` takes the row. Either way the result is the exact top-K by packed
    key."""
    o_t = tl.arange(0, NTP)
    m_t = o_t < NT
    b_tm = tl.load(p_tmax + o_t, mask=m_t, other=0, cache_modifier=".cg")  # (unused if not row_ok)
    t_key = (b_tm.to(tl.int64) << 32) | (0x7FFFFFFF - o_t).to(tl.int64)
    t_key = tl.where(m_t, t_key, -9223372036854775807 - 1)
    o_k = tl.arange(0, KP)
    key_min = tl.full([KP], -9223372036854775807 - 1, tl.int64)
    b_top = tl.where(o_k < K, key_min + 1 + o_k, 9223372036854775807)  # as in _stream_row
    if CAP == 0:
        if row_ok:
            b_top = _top_of_tiles_merged(p_row, t_key, V, K, KP, BLOCK_V)
    elif row_ok:
        # the K best tiles' first tokens (v_none: no such tile, not read; past V and, like
        # every tile's first token, a multiple of BLOCK_V) and the K-th one's max
        v_none = tl.cdiv(V, BLOCK_V) * BLOCK_V
        if BLOCKS_TOPK:
            # one bitonic top-KP of the tile keys (distinct but for the padding, which ranks
            # last) instead of K max-reductions in sequence
            t_top = tl.topk(t_key, KP)
            t_kth = tl.sum(tl.where(o_k == K - 1, t_top, 0))
            v0_k = (0x7FFFFFFF - (t_top & 0xFFFFFFFF)).to(tl.int32) * BLOCK_V
            b_v0 = tl.where((o_k < K) & (t_top > -9223372036854775807 - 1), v0_k, v_none)
        else:
            t_rest = t_key
            b_v0 = tl.zeros([KP], tl.int32) + v_none
            t_kth = tl.max(t_key)
            for k in range(K):
                t_kth = tl.max(t_rest)
                t_rest = tl.where(t_rest == t_kth, -9223372036854775807 - 1, t_rest)
                v0 = (0x7FFFFFFF - (t_kth & 0xFFFFFFFF)).to(tl.int32) * BLOCK_V
                b_v0 = tl.where((o_k == k) & (t_kth > -9223372036854775807 - 1), v0, b_v0)
        # fewer than K tiles: the smallest key, so every logit of the row qualifies
        thr = (t_kth >> 32).to(tl.int32)
        # every tile max is in registers (the reductions above waited on the loads): the row's
        # slots of p_tmax are free for the candidate tokens
        n_c = tl.sum(tl.zeros([GT], tl.int32))
        if CAND_AHEAD:
            o_n, b_n = _read_tiles(p_row, b_v0, 0, V, v_none, K, KP, GT, BLOCK_V)
        for g in range(0, K, GT):
            if CAND_AHEAD:
                o_v, b_raw = o_n, b_n
                o_n, b_n = _read_tiles(p_row, b_v0, g + GT, V, v_none, K, KP, GT, BLOCK_V)
            else:
                o_v, b_raw = _read_tiles(p_row, b_v0, g, V, v_none, K, KP, GT, BLOCK_V)
            m_v = o_v < V
            b_x = b_raw.to(tl.float32) + 0.0
            c_i = (m_v & (_ordered(b_x) >= thr)).to(tl.int32)
            n_g = tl.sum(c_i, axis=1)  # [GT]
            pos = n_c + (tl.cumsum(n_g, 0) - n_g)[:, None] + tl.cumsum(c_i, axis=1) - 1
            tl.store(p_tmax + pos, o_v, mask=(c_i != 0) & (pos < NT))
            n_c += tl.sum(n_g)
        tl.debug_barrier()  # every thread's candidates written before any is read back
        if (n_c <= CAP) & (n_c <= NT):
            o_c = tl.arange(0, CAP)
            m_c = o_c < n_c
            c_tok = tl.load(p_tmax + o_c, mask=m_c, other=0, cache_modifier=".cg")
            c_x = tl.load(p_row + c_tok, mask=m_c, other=-float("inf")).to(tl.float32) + 0.0
            c_key = (_ordered(c_x).to(tl.int64) << 32) | (0x7FFFFFFF - c_tok).to(tl.int64)
            c_key = tl.where(m_c, c_key, -9223372036854775807 - 1)
            if RANK_TOPK:
                # the K best in registers (one bitonic top-KP; padding ranks last)
                b_top = tl.where(o_k < K, tl.topk(c_key, KP), b_top)
            else:
                # keys are distinct; padding (all equal) ranks n_c >= K: never among the first
                # K. Against chunks of 16 read again: a [CAP, CAP] compare at once would set
                # the register budget of the whole kernel (and so its occupancy at large B)
                c_rank = tl.zeros([CAP], tl.int32)
                for j0 in tl.static_range(0, CAP, 16):
                    o_j = j0 + tl.arange(0, 16)
                    m_j = o_j < n_c
                    j_tok = tl.load(p_tmax + o_j, mask=m_j, other=0, cache_modifier=".cg")
                    j_x = tl.load(p_row + j_tok, mask=m_j, other=-float("inf")).to(tl.float32)
                    j_x = j_x + 0.0
                    j_key = (_ordered(j_x).to(tl.int64) << 32) | (0x7FFFFFFF - j_tok).to(tl.int64)
                    j_key = tl.where(m_j, j_key, -9223372036854775807 - 1)
                    c_rank += tl.sum((j_key[None, :] > c_key[:, None]).to(tl.int32), axis=1)
                b_sel = tl.where(c_rank[None, :] == o_k[:, None], c_key[None, :], key_min[:, None])
                b_top = tl.where(o_k < K, tl.max(b_sel, axis=1), b_top)
        else:
            b_top = _top_of_tiles_merged(p_row, t_key, V, K, KP, BLOCK_V)
    return b_top


@triton.jit
def _stream_kernel(
    p_logits,  # [B, RW, V] draft logits (strides s_lb, s_lw; the vocabulary contiguous)
    p_fscore,  # [B, W] f32 frontier path score (-1 = unused row)
    p_active,  # [B] u8 active requests
    p_part_m,  # [B * RW * SPLIT] f32 out: each chunk's running max
    p_part_s,  # [B * RW * SPLIT] f32 out: each chunk's sum of exp(x - max)
    p_part_t,  # [B * RW, NT] i32 out: each MB-token block's max (``_ordered``)
    V,
    s_lb,
    s_lw,
    W: tl.constexpr,  # frontier rows per request
    RW: tl.constexpr,  # logits rows per request: W, or 1 at layer 0 (the root's row alone)
    BLOCK_V: tl.constexpr,
    MB: tl.constexpr,  # tokens per recorded maximum (divides BLOCK_V)
    SPLIT: tl.constexpr,
    CHUNK: tl.constexpr,
    NT: tl.constexpr,  # blocks per row (columns of p_part_t)
    PDL: tl.constexpr,  # launched with programmatic dependent launch (``_pdl``)
    AHEAD: tl.constexpr,  # tiles loaded ahead of the one being reduced (2 or 3)
    VEC: tl.constexpr,  # > 0: max and sum per VEC-token vector (``_stream_tiles_lanes``)
    WARPS: tl.constexpr,  # the launch's num_warps (the per-vector tile's layout)
    EARLY: tl.constexpr,  # the first tiles loaded before the row's state (``early_tile_loads``)
):
    """Step 1 of ``expand`` over (row, chunk) programs, ahead of the finishing launch: small
    (one-warp) programs, enough of them to fill the GPU at B = 1, each a pure stream (max, sum and
    a max per block; no top-K work, which ``_top_of_tiles`` does on the few blocks that matter)."""
    pdl_enter(PDL)
    i_p = tl.program_id(0)
    i_row = i_p // SPLIT  # a logits row: (request, frontier row < RW)
    i_s = i_p % SPLIT
    i_b64 = (i_row // RW).to(tl.int64)
    i_r = i_row % RW
    row_ok = (tl.load(p_fscore + i_b64 * W + i_r) >= 0) & (tl.load(p_active + i_b64) != 0)
    p_row = p_logits + i_b64 * s_lb + i_r.to(tl.int64) * s_lw
    v_lo = i_s * CHUNK
    v_hi = tl.minimum(v_lo + CHUNK, V)
    p_out = p_part_t + i_row.to(tl.int64) * NT
    if VEC > 0:
        m_run, s_run = _stream_tiles_lanes(
            p_row, v_lo, v_hi, V, row_ok, p_out, BLOCK_V, MB, VEC, WARPS, EARLY
        )
    else:
        m_run, s_run = _stream_tiles(p_row, v_lo, v_hi, V, row_ok, p_out, BLOCK_V, MB, AHEAD, EARLY)
    pdl_release(PDL)
    o_part = i_p.to(tl.int64)
    tl.store(p_part_m + o_part, m_run)
    tl.store(p_part_s + o_part, s_run)

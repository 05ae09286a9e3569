"""Graft's adjacency-table update: its kernels and their launcher, ``adjacency_update``.

``adjacency_update``: stage 1, grid (nodes, splits of V, about 32 one-warp programs per SM): each
program streams its chunk of V once and keeps a running top-k of integer order keys (value desc,
id asc; below); a block enters the running list only while its best key beats the
list's worst, so most blocks cost one max. Split 0 also claims the node's token with
``atomic_min(owner[token], flat index)``. Stage 2, grid (node blocks): merge the splits' lists,
and the node whose index equals ``owner[token]`` writes the row and resets the owner to INT32_MAX
(losers read either their winner's index or INT32_MAX, never their own), so the owner buffer is
all INT32_MAX again after every update and no host sync or memset is needed. With ``topk_ids``
stage 1 only claims. By default (``UPDATE_TUNING["block_max"]``: 64 or 128 logits by vocabulary;
0 takes the lists above) stage 1 keeps a max per block of logits instead of a list, and stage 2
(one program per node) ranks the blocks and rereads the best (below).

Top-k order is one integer compare: every logit gets an *order key* whose signed order is
(value descending, id ascending). The value part is ``_value_key`` (the float's bits made
monotone, -0 equal to +0, NaN below -inf as the reference's sort puts it); the id part is
``MASK - (id - chunk start)``, so the lower id wins a tie. For bf16 logits the value needs only
the top 16 bits of its fp32 upcast, and the key is int32 (``KEY32``: a chunk of V is at most
2^16 ids, which the launcher guarantees); otherwise it is int64. Empty entries hold the type's
minimum, below every real key (the NaN key's value part is above it).

``_topk_partial_kernel``, grid (nodes, splits): each program streams its chunk of V once, one
block at a time, and finds the chunk's top keys by one of two methods (``GROUP``). The running
list (``GROUP`` 0): a block's best key enters only while it beats the list's worst, so after the
first blocks most cost one max, but the first fills serially. Group maxima (``GROUP`` g): the
maxima of groups of g logits, a bitonic top-KB of them per block merged into a running list,
then the KB winning groups reread: a fixed sequence of vector steps. It writes the list as
(value key, bit-cast into the float32 buffer; id, or -1 when empty). Split 0 also claims the node's
token with ``atomic_min(owner[token], claim)``. ``_claim_kernel``: the claims alone (top-k ids
given). ``_update_write_kernel``, grid (node blocks): merges the splits' lists with int64 keys
rebuilt from (value key, id), by k dependent max passes or (``BITONIC``) one bitonic top-KB a
row, or reads the given ids, and the node whose claim equals ``owner[token]`` writes the row
and resets the owner to INT32_MAX. A claim is the flattened node index (the lowest wins), or its
mirror ``n_flat - 1 - index`` when the last one wins.

The block-maxima method (``UPDATE_TUNING["block_max"]`` = MB > 0) moves the ranking out of the
stream: ``_block_max_kernel``, grid (nodes, splits), stores one value key per block of MB logits
(a float max per logit, where the lists above build an order key per logit), and
``_block_top_kernel``, one program per node, ranks the node's block maxima, rereads its k best
blocks and writes the winner's row (the build's per-row top-K does the same,
``build_tree_vocab``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeops import _runtime
from treeops._runtime import cdiv, interpreted, pow2

from ._launch import direct
from ._pdl import pdl_enter, pdl_release, use_pdl
from .build_tree_vocab import _tile_blocks

INT32_MAX = 2**31 - 1

_I32MAX = tl.constexpr(INT32_MAX)
_K32MIN = tl.constexpr(-(2**31))
_K64MIN = tl.constexpr(-(2**63))
_K64MAX = tl.constexpr(2**63 - 1)
# the value key of NaN: below -inf's (0x807FFFFF), above an empty entry's, the top 16 bits alone
# also distinct from both
_NAN_KEY = tl.constexpr(-(2**31) + (1 << 16))
_LOW32 = tl.constexpr(2**32 - 1)


@triton.jit
def _value_key(x):
    """fp32 ``x`` -> int32 whose signed order is x's (-0 == +0, NaN below -inf)."""
    bits = tl.where(x == 0, 0.0, x).to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return tl.where(x != x, _NAN_KEY, key)


@triton.jit
def _order_key(x, local, m, KEY32: tl.constexpr):
    """Order keys of fp32 values ``x`` at chunk offsets ``local`` (< 2^16 when ``KEY32``); the
    type's minimum where ``m`` is false."""
    vk = _value_key(x)
    if KEY32:
        key = (vk & -65536) | (65535 - local).to(tl.int32)
        key = tl.where(m, key, _K32MIN)
    else:
        key = (vk.to(tl.int64) << 32) | (_LOW32 - local.to(tl.int64))
        key = tl.where(m, key, _K64MIN)
    return key


@triton.jit
def _node_claim(tok_ptr, num_ptr, N, V, n_flat, LAST_WINS: tl.constexpr):
    """The program's node (axis 0: the flattened index b*N + i): (index, b, i, its token, whether
    it is valid — a node of the tree with a token in [0, V) — and its claim on the token: the
    index, or its mirror ``n_flat - 1 - index`` when the last node wins)."""
    i_f = tl.program_id(0).to(tl.int64)
    i_b = i_f // N
    i_n = i_f % N
    tok = tl.load(tok_ptr + i_f)
    valid = (i_n < tl.load(num_ptr + i_b)) & (tok >= 0) & (tok < V)
    if LAST_WINS:
        claim = (n_flat - 1 - i_f).to(tl.int32)
    else:
        claim = i_f.to(tl.int32)
    return i_f, i_b, i_n, tok, valid, claim


@triton.jit(do_not_specialize=["N", "n_flat"])
def _topk_partial_kernel(
    x_ptr,
    tok_ptr,
    num_ptr,
    owner_ptr,
    ws_val_ptr,
    ws_id_ptr,
    N,
    V,
    n_flat,
    chunk,
    stride_b,
    stride_n,
    K: tl.constexpr,
    KB: tl.constexpr,
    S: tl.constexpr,
    BLOCK_V: tl.constexpr,
    GROUP: tl.constexpr,
    KEY32: tl.constexpr,
    LAST_WINS: tl.constexpr,
):
    i_f, i_b, i_n, tok, valid, claim = _node_claim(tok_ptr, num_ptr, N, V, n_flat, LAST_WINS)
    i_s = tl.program_id(1)
    if valid:
        if i_s == 0:
            tl.atomic_min(owner_ptr + tok, claim)
        o_k = tl.arange(0, KB)
        p_x = x_ptr + i_b * stride_b + i_n * stride_n
        lo = i_s * chunk
        hi = tl.minimum(lo + chunk, V)
        if GROUP > 0:
            run = _chunk_topk_by_groups(p_x, lo, hi, V, KB, BLOCK_V, GROUP, KEY32)
        else:
            run = _chunk_topk_by_insertion(p_x, lo, hi, V, K, KB, BLOCK_V, KEY32)
        # (value key, id) per slot; -1 for an empty or padding slot
        if KEY32:
            live = (o_k < K) & (run != _K32MIN)
            vk = run & -65536
            ids = lo + 65535 - (run & 65535)
        else:
            live = (o_k < K) & (run != _K64MIN)
            vk = (run >> 32).to(tl.int32)
            ids = (lo + (_LOW32 - (run & _LOW32))).to(tl.int32)
        p_ws = (i_f * S + i_s) * KB + o_k
        tl.store(ws_val_ptr + p_ws, vk.to(tl.float32, bitcast=True))
        tl.store(ws_id_ptr + p_ws, tl.where(live, ids, -1))


@triton.jit
def _local_of(key, KEY32: tl.constexpr):
    """The chunk offset an order key holds."""
    if KEY32:
        return 65535 - (key & 65535)
    else:
        return ((key & _LOW32) * -1 + _LOW32).to(tl.int32)  # tensor first: the interpreter


@triton.jit
def _chunk_topk_by_groups(
    p_x, lo, hi, V, KB: tl.constexpr, BLOCK_V: tl.constexpr, GROUP: tl.constexpr,
    KEY32: tl.constexpr,
):  # fmt: skip
    """The KB largest order keys of ``p_x[lo:hi]`` (descending; the type's minimum past the
    end). Keys are distinct, so the KB largest lie in the groups of GROUP consecutive logits
    whose maxima are the KB largest group maxima: a group holding one of them has at most KB - 1
    groups with a larger maximum. One pass keeps those maxima (a bitonic top-KB per block, merged
    into the running list), then those KB groups are read again (L2) and their KB * GROUP keys
    give the result: no data-dependent loop."""
    NG: tl.constexpr = BLOCK_V // GROUP
    o_g = tl.arange(0, NG)
    o_e = tl.arange(0, GROUP)
    o_t = o_g[:, None] * GROUP + o_e[None, :]  # [NG, GROUP] offsets in a block
    if KEY32:
        run = tl.full([KB], _K32MIN, tl.int32)
    else:
        run = tl.full([KB], _K64MIN, tl.int64)
    b_next = tl.load(p_x + lo + o_t, mask=lo + o_t < V, other=0.0)
    for start in range(lo, hi, BLOCK_V):
        o_v = start + o_t
        b_x = b_next.to(tl.float32)
        nxt = start + BLOCK_V
        b_next = tl.load(p_x + nxt + o_t, mask=(nxt + o_t < V) & (nxt < hi), other=0.0)
        g_max = tl.max(_order_key(b_x, o_v - lo, o_v < V, KEY32), 1)  # [NG]
        both = tl.join(run, tl.topk(g_max, KB))  # [KB, 2]
        run = tl.topk(tl.reshape(both, [2 * KB]), KB)
    # the KB groups again; an empty entry (fewer than KB groups hold logits) reads nothing
    if KEY32:
        has = run != _K32MIN
    else:
        has = run != _K64MIN
    g_lo = (_local_of(run, KEY32) // GROUP) * GROUP
    o_c = tl.where(has, g_lo, 0)[:, None] + o_e[None, :]  # [KB, GROUP] chunk offsets
    m_c = has[:, None] & (lo + o_c < V)
    b_x = tl.load(p_x + lo + o_c, mask=m_c, other=0.0).to(tl.float32)
    key = _order_key(b_x, o_c, m_c, KEY32)
    return tl.topk(tl.reshape(key, [KB * GROUP]), KB)


@triton.jit
def _chunk_topk_by_insertion(
    p_x, lo, hi, V, K: tl.constexpr, KB: tl.constexpr, BLOCK_V: tl.constexpr,
    KEY32: tl.constexpr,
):  # fmt: skip
    """The K largest order keys of ``p_x[lo:hi]`` in slots < K (any order; the type's minimum
    where empty), the type's maximum in the padding slots: a running list that a block's best
    key enters while it beats the list's worst."""
    o_k = tl.arange(0, KB)
    # running list: slots < K start empty (the minimum), padding slots hold the maximum so
    # they are never the worst entry
    if KEY32:
        run = tl.where(o_k < K, _K32MIN, _I32MAX)
    else:
        run = tl.where(o_k < K, _K64MIN, _K64MAX)
    # chunk is whole blocks, so a block's only bound is V; V, chunk and the strides are
    # specialised (divisibility) so that these loads vectorise. The next block is loaded
    # ahead, as raw 16-bit values (cheap registers), to keep two in flight.
    o_b = tl.arange(0, BLOCK_V)
    b_next = tl.load(p_x + lo + o_b, mask=lo + o_b < V, other=0.0)
    for start in range(lo, hi, BLOCK_V):
        o_v = start + o_b
        m_v = o_v < V
        b_x = b_next.to(tl.float32)
        nxt = start + BLOCK_V
        b_next = tl.load(p_x + nxt + o_b, mask=(nxt + o_b < V) & (nxt < hi), other=0.0)
        key = _order_key(b_x, o_v - lo, m_v, KEY32)
        best = tl.max(key, 0)
        worst = tl.min(run, 0)
        # keys are distinct (each holds its id): the block's best replaces the list's worst
        while best > worst:
            slot = tl.min(tl.where(run == worst, o_k, KB), 0)
            run = tl.where(o_k == slot, best, run)
            if KEY32:
                key = tl.where(key == best, _K32MIN, key)
            else:
                key = tl.where(key == best, _K64MIN, key)
            best = tl.max(key, 0)
            worst = tl.min(run, 0)
    return run


@triton.jit(do_not_specialize=["N", "n_flat"])
def _claim_kernel(
    tok_ptr, num_ptr, owner_ptr, N, V, n_flat, BLOCK: tl.constexpr, LAST_WINS: tl.constexpr
):
    o_f = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m_f = o_f < n_flat
    tok = tl.load(tok_ptr + o_f, mask=m_f, other=-1)
    num = tl.load(num_ptr + o_f // N, mask=m_f, other=0)
    valid = m_f & (o_f % N < num) & (tok >= 0) & (tok < V)
    if LAST_WINS:
        claim = (n_flat - 1 - o_f).to(tl.int32)
    else:
        claim = o_f.to(tl.int32)
    tl.atomic_min(owner_ptr + tok, claim, mask=valid)


@triton.jit(do_not_specialize=["N", "V", "n_flat", "k_ids", "stride_ib", "stride_in", "n_cand"])
def _update_write_kernel(
    tok_ptr,
    num_ptr,
    owner_ptr,
    table_ptr,
    ws_val_ptr,
    ws_id_ptr,
    ids_ptr,
    N,
    V,
    n_flat,
    k_ids,
    stride_ib,
    stride_in,
    n_cand,
    K: tl.constexpr,
    KB: tl.constexpr,
    C: tl.constexpr,
    BLOCK_M: tl.constexpr,
    FROM_LOGITS: tl.constexpr,
    BITONIC: tl.constexpr,
    LAST_WINS: tl.constexpr,
):
    o_f = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [M] flat nodes
    m_f = o_f < n_flat
    tok = tl.load(tok_ptr + o_f, mask=m_f, other=-1)
    num = tl.load(num_ptr + o_f // N, mask=m_f, other=0)
    valid = m_f & (o_f % N < num) & (tok >= 0) & (tok < V)
    if LAST_WINS:
        claim = (n_flat - 1 - o_f).to(tl.int32)
    else:
        claim = o_f.to(tl.int32)
    owner = tl.load(owner_ptr + tok, mask=valid, other=-1)
    win = valid & (owner == claim)
    o_k = tl.arange(0, KB)
    if FROM_LOGITS:
        # merge the splits' lists: n_cand = S * KB candidates per node, C its power of two
        o_c = tl.arange(0, C)
        p_c = o_f[:, None] * n_cand + o_c[None, :]
        m_c = win[:, None] & (o_c[None, :] < n_cand)
        vk = tl.load(ws_val_ptr + p_c, mask=m_c, other=0.0).to(tl.int32, bitcast=True)
        b_i = tl.load(ws_id_ptr + p_c, mask=m_c, other=-1)  # [M, C]
        key = (vk.to(tl.int64) << 32) | (_LOW32 - b_i.to(tl.int64))
        key = tl.where(b_i >= 0, key, _K64MIN)
        if BITONIC:
            # one bitonic top-KB per row (descending), instead of K dependent max passes
            top = tl.topk(key, KB)  # [M, KB]
            b_row = tl.where(top != _K64MIN, (top & _LOW32) * -1 + _LOW32, -1).to(tl.int32)
        else:
            b_row = tl.full([BLOCK_M, KB], -1, tl.int32)
            for r in tl.static_range(K):
                best = tl.max(key, axis=1)
                bi = tl.where(best != _K64MIN, _LOW32 - (best & _LOW32), -1).to(tl.int32)
                b_row = tl.where(o_k[None, :] == r, bi[:, None], b_row)
                key = tl.where(key == best[:, None], _K64MIN, key)
    else:
        p_i = o_f[:, None] // N * stride_ib + o_f[:, None] % N * stride_in + o_k[None, :]
        b_row = tl.load(ids_ptr + p_i, mask=win[:, None] & (o_k[None, :] < k_ids), other=-1)
    m_w = win[:, None] & (o_k[None, :] < K)
    tl.store(table_ptr + tok[:, None] * K + o_k[None, :], b_row, mask=m_w)
    tl.store(owner_ptr + tok, tl.full([BLOCK_M], _I32MAX, tl.int32), mask=win)


# the value key of -inf (0xFF800000 made monotone: 0x807FFFFF): a block whose best value key is
# at or below it holds only -inf and NaN
_VK_NEG_INF = tl.constexpr(-(2**31) + 0x7FFFFF)
_VK16_NEG_INF = tl.constexpr((-(2**31) + 0x7FFFFF) & -65536)  # its top 16 bits (KEY32)


@triton.jit(do_not_specialize=["N", "n_flat"])
def _block_max_kernel(
    x_ptr,
    tok_ptr,
    num_ptr,
    owner_ptr,
    ws_key_ptr,
    N,
    V,
    n_flat,
    chunk,
    stride_b,
    stride_n,
    BLOCK_V: tl.constexpr,
    MB: tl.constexpr,
    LAST_WINS: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (``_pdl``)
):
    """Stage 1 of the block-maxima update, grid (nodes, splits of V): each program streams its
    chunk of V once and stores, per block of MB logits, the value key of the block's largest
    value with NaN left out (-inf for a block of NaN and -inf only) at ``ws_key[node, v // MB]``:
    one float max per logit, no order keys. Split 0 claims the node's token as
    ``_topk_partial_kernel`` does."""
    pdl_enter(PDL)
    i_f, i_b, i_n, tok, valid, claim = _node_claim(tok_ptr, num_ptr, N, V, n_flat, LAST_WINS)
    i_s = tl.program_id(1)
    p_x = x_ptr + i_b * stride_b + i_n * stride_n
    lo = i_s * chunk
    hi = tl.minimum(lo + chunk, V)
    # chunks are whole tiles, loaded as [blocks, MB] (the build's stream tile); the next is
    # loaded ahead (raw 16-bit values where the logits are) so that two are in flight. The first
    # is loaded before the node is known valid (every node's row exists): its load leaves beside
    # the token's, not after it, for one tile of an invalid node's row
    b_next = _tile_blocks(p_x, lo, hi, V, BLOCK_V, MB)
    if valid:
        if i_s == 0:
            tl.atomic_min(owner_ptr + tok, claim)
        p_k = ws_key_ptr + i_f * ((V + MB - 1) // MB)
        o_r = tl.arange(0, BLOCK_V // MB)
        for start in range(lo, hi, BLOCK_V):
            b_x = b_next.to(tl.float32)
            b_next = _tile_blocks(p_x, start + BLOCK_V, hi, V, BLOCK_V, MB)
            b_x = tl.where(b_x == b_x, b_x, -float("inf"))
            b_max = tl.max(b_x, axis=1)
            tl.store(p_k + start // MB + o_r, _value_key(b_max), mask=start + o_r * MB < V)
    pdl_release(PDL)  # stage 2 may be placed; it waits for every block maximum (``pdl_enter``)


@triton.jit(do_not_specialize=["N", "n_flat"])
def _block_top_kernel(
    x_ptr,
    tok_ptr,
    num_ptr,
    owner_ptr,
    table_ptr,
    ws_key_ptr,
    N,
    V,
    n_flat,
    stride_b,
    stride_n,
    K: tl.constexpr,
    KB: tl.constexpr,
    NBP: tl.constexpr,
    MB: tl.constexpr,
    LAST_WINS: tl.constexpr,
    KEY32: tl.constexpr,
    RANK_ALL: tl.constexpr,
    PDL: tl.constexpr,  # launched with programmatic dependent launch (``_pdl``)
):
    """Stage 2 of the block-maxima update, one program per node: the node whose claim equals
    ``owner[token]`` takes its top-k and writes the row, then resets the owner to INT32_MAX.
    ``KEY32`` (bf16 logits, whose value keys are exact in their top 16 bits): both rankings on
    int32 keys, (value key's top 16 bits, 65535 - position), instead of int64 ones.

    The top-k lie in the K blocks ranked highest by (block max, lower block first) when the K-th
    of them holds a value above -inf: a block ranked above the block of a top-k element holds a
    larger value, or an equal one at a lower id, so fewer than K blocks rank above it; and K
    blocks with a value above -inf mean no NaN or -inf is among the top-k, so leaving NaN out of
    the maxima changes nothing. Those K blocks are read again (L2) and their keys ranked at once.
    Otherwise (fewer than K blocks hold a value above -inf) the program ranks the whole row.

    The node's block maxima are loaded before its claim is known (every node's row of the
    workspace exists): the load is in flight while the token and then the owner are read, so
    the ranking waits for two memory latencies, not three. ``RANK_ALL`` (launches where every
    node has an SM): every valid node ranks and only the winner stores, so the owner's load,
    which waits for the token's, is off the ranking's path: one memory latency less. Otherwise
    only the winner ranks: a token many nodes share costs one ranking."""
    pdl_enter(PDL)
    i_f, i_b, i_n, tok, valid, claim = _node_claim(tok_ptr, num_ptr, N, V, n_flat, LAST_WINS)
    NB = (V + MB - 1) // MB
    o_g = tl.arange(0, NBP)
    # not masked by ``valid`` (which waits for the token): an invalid node's row of the
    # workspace exists and is never used
    vk = tl.load(ws_key_ptr + i_f * NB + o_g, mask=o_g < NB, other=0)
    owner = tl.load(owner_ptr + tok, mask=valid, other=-1)
    if RANK_ALL:
        ranks = valid
    else:
        ranks = valid & (owner == claim)
    if ranks:
        p_x = x_ptr + i_b * stride_b + i_n * stride_n
        o_k = tl.arange(0, KB)
        o_e = tl.arange(0, MB)
        if KEY32:
            b_key = tl.where(o_g < NB, (vk & -65536) | (65535 - o_g), _K32MIN)
            top_b = tl.topk(b_key, KB)  # [KB] descending
            kth = tl.sum(tl.where(o_k == K - 1, top_b & -65536, 0))  # the K-th block's max
            found = top_b != _K32MIN
            above_inf = kth > _VK16_NEG_INF
        else:
            b_key = (vk.to(tl.int64) << 32) | (_LOW32 - o_g.to(tl.int64))
            b_key = tl.where(o_g < NB, b_key, _K64MIN)
            top_b = tl.topk(b_key, KB)  # [KB] descending
            kth = tl.sum(tl.where(o_k == K - 1, top_b >> 32, 0))  # the K-th block's value key
            found = top_b != _K64MIN
            above_inf = kth > _VK_NEG_INF
        if above_inf | (NB <= K):
            has = (o_k < K) & found
            g = _local_of(top_b, KEY32)
            if KEY32:
                # the blocks in id order, so that a key's position in the [KB, MB] tile orders
                # as its id does (ties: the lower id first)
                g = tl.sort(tl.where(has, g, _I32MAX))
                has = g != _I32MAX
            o_c = tl.where(has, g * MB, 0)[:, None] + o_e[None, :]  # [KB, MB] ids
            m_c = has[:, None] & (o_c < V)
            b_x = tl.load(p_x + o_c, mask=m_c, other=0.0).to(tl.float32)
            if KEY32:
                o_p = o_k[:, None] * MB + o_e[None, :]  # [KB, MB] positions (< 2^16)
                top_p = tl.topk(tl.reshape(_order_key(b_x, o_p, m_c, True), [KB * MB]), KB)
                p_top = _local_of(top_p, True)
                g_top = tl.sum(tl.where(o_k[None, :] == (p_top // MB)[:, None], g[None, :], 0), 1)
                top_ids = tl.where(top_p != _K32MIN, g_top * MB + p_top % MB, -1)
            else:
                top = tl.topk(tl.reshape(_order_key(b_x, o_c, m_c, False), [KB * MB]), KB)
                top_ids = tl.where(top != _K64MIN, _local_of(top, False), -1)
        else:
            # the whole row, a tile of KB * MB ids at a time, merged into a running top-KB
            o_v = tl.arange(0, KB * MB)
            top = tl.full([KB], _K64MIN, tl.int64)
            for start in range(0, V, KB * MB):
                m_v = start + o_v < V
                b_x = tl.load(p_x + start + o_v, mask=m_v, other=0.0).to(tl.float32)
                both = tl.join(top, tl.topk(_order_key(b_x, start + o_v, m_v, False), KB))
                top = tl.topk(tl.reshape(both, [2 * KB]), KB)
            top_ids = tl.where(top != _K64MIN, _local_of(top, False), -1)
        if owner == claim:
            tl.store(table_ptr + tok * K + o_k, top_ids, mask=o_k < K)
            tl.store(owner_ptr + tok, _I32MAX)


# --------------------------------------------------------------------------------- launcher
def _contig(name: str, t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"Invalid layout of {name}: expected a contiguous tensor")
    return t


UPDATE_TUNING = {
    "block_v": None,
    "programs_per_sm": 32,
    "num_warps": 1,
    "group": 0,
    "merge": "bitonic",
    "block_max": None,
    "rank32": True,
    "rank_all": None,
    "rank_warps": None,
}
"""The update's configuration on the GPU. Stage 1: logits per block (None: the rule of
``update_tiling``), programs per SM that the splits of V aim for, warps per program, and the
top-k method: ``group`` 0 keeps a running list
that a block's best key enters while it beats the worst; ``group`` g > 0 keeps the largest
maxima of groups of g logits and rereads those groups (``_update_group``). The write stage:
``merge`` "passes" (K dependent max passes over the splits' lists) or "bitonic" (one top-KB a
row). ``block_max`` m > 0 replaces both: stage 1 keeps one max per m logits (a float max per
logit, no order keys), stage 2 rereads each node's k best blocks (``_update_by_block_maxima``);
0 keeps the lists; None (the default) takes m from the vocabulary (``_update_block_max``).
``rank32``: stage 2 of the block maxima ranks int32 keys where the logits are bf16 (their value
keys are exact in 16 bits), int64 ones otherwise; on an H100 (session 39,
bench/results/h100/graft_update_rank32_s39.json) int32 keys took 4-16 % off every row: B 1 / 8 /
64 at V 32,000 9.1 / 22.3 / 143 -> 8.6 / 20.5 / 129.5 µs, at V 128,256 15.2 / 64.6 / 450-491 ->
13.4 / 59.9 / 414.
``rank_all``: stage 2 of the block maxima ranks every valid node's row, not only the winner's,
so that no ranking waits for the owner's load (None: where the nodes are at most the SMs,
``_rank_all``; on an H100, session 45, B 1 V 128,256 13.26 -> 13.0 us, 1-2 % at B 1 and 2).
``rank_warps``: the warps of a stage-2 program of the block maxima (its two bitonic rankings of
about 1,024 keys each; None: ``_rank_warps``, 4 where each node's program has an SM, else 2; on
an H100, session 46, bench/results/h100/graft_update_rank_warps_s46.json, 4 -> 2 warps: B 8 / 64
at V 32,000 20.1 / 128.7 -> 19.1 / 122.2 µs, at V 128,256 58.8 / 410-447 -> 58.8 / 413.7; B 1
13.0 -> 15.3 at V 128,256 and 7.7 -> 8.0 at V 32,000; 8 warps slower at every B).
``bench/bench_graft.py --sweep-update`` varies it; the splits and the method are part of
``update_workspace_key``, so a table's cached workspace follows it. H200, µs
(bench/results/h200/graft_update_block_max.json, session 33), B 1 / 8 / 64, lists -> m 64 -> m 128:
V 32,000 11.3 / 30.7 / 132.9 -> 9.1 / 19.9 / 120.6 -> 9.5 / 21.1 / 129.1; V 128,256 20.8 / 77.4
/ 439.6 -> 16.4 / 59.0 / 405.1 -> 14.2 / 53.7 / 366.7 (m 256: slower at both). Earlier, for the
lists (graft_update_sweep.json): the bitonic merge 21.15 against 21.57 µs at B 1 V 128,256;
groups of 16 (2,048-logit blocks) 19.2 at B 1 but 576 at B 64."""
BLOCK_MAX_SMALL_V = 65536
"""Vocabularies up to this size take 64-logit block maxima, larger ones 128 (the fastest of 64,
128 and 256 at every B of the sweep at V 32,000 and V 128,256; ``UPDATE_TUNING``)."""


def _splits(n_flat: int, V: int, block_v: int, device: torch.device) -> int:
    """Splits of V per node: enough programs to fill the GPU (at most ``programs_per_sm`` of
    them per SM, so that even one request's nodes stream at full bandwidth), at least one block
    of V each. Rounded down: 32 one-warp programs are all an SM holds at once, and a few more
    would run as a second wave (B 8's 480 nodes made 4,320 programs for 4,224 places). Depends
    on shapes and the SM count only (fixed for a CUDA graph)."""
    if device.type != "cuda":
        return min(2, cdiv(V, block_v))
    sms = _runtime.sm_count(device)
    want = UPDATE_TUNING["programs_per_sm"] * sms // max(n_flat, 1)
    return max(1, min(want, cdiv(V, block_v), 64))


def update_tiling(n_flat: int, V: int, device: torch.device) -> tuple[int, int]:
    """(logits per block, warps) of stage 1 for ``n_flat`` nodes of V logits: ``UPDATE_TUNING``'s;
    its ``block_v`` None means 512 logits over its warps, except that the block-maxima method
    takes 1,024-logit blocks over two warps where, at that size, every program streams one block
    (B <= 2 at V 32,000 on 132 SMs: half the programs of one-warp 512-logit blocks, each of one
    or two blocks); elsewhere two warps lose or tie (docs/design.md, op 6, the update).
    Shapes and the SM count only, so a captured launch keeps its tiling."""
    if interpreted():
        return 256, 1
    block_v, warps = UPDATE_TUNING["block_v"], UPDATE_TUNING["num_warps"]
    if block_v is None:
        block_v = 512
        one_block = _splits(n_flat, V, 1024, device) >= cdiv(V, 1024)
        if UPDATE_TUNING["block_max"] != 0 and one_block:
            block_v, warps = 1024, max(warps, 2)
    return block_v, warps


def _update_group(block_v: int, KB: int) -> int:
    """Stage 1's group size (0: the running-list method): ``UPDATE_TUNING["group"]`` where a
    block holds at least KB groups of it (the bitonic top-KB runs over a block's group maxima),
    else 0."""
    g = UPDATE_TUNING["group"]
    return g if g > 0 and block_v // g >= KB else 0


_MAX_CHUNK = 1 << 16
"""A split's ids fit the 16 bits that bf16 order keys give them (the kernels above)."""


def update_splits(n_flat: int, V: int, device: torch.device, block_v: int | None = None) -> int:
    """Stage 1's splits of V per node (``_splits``, at least enough that a split's ids fit the
    16 bits of a bf16 order key, and none empty) for blocks of ``block_v`` logits (default
    ``update_tiling``'s)."""
    if block_v is None:
        block_v = update_tiling(n_flat, V, device)[0]
    S = max(_splits(n_flat, V, block_v, device), cdiv(V, _MAX_CHUNK))
    return cdiv(V, _chunk(V, S, block_v))


def _rank_all(n_flat: int, device: torch.device) -> bool:
    """Whether stage 2 of the block maxima ranks every valid node (``UPDATE_TUNING["rank_all"]``,
    None: where each node's program has an SM to itself, so a loser's ranking delays no one)."""
    rank_all = UPDATE_TUNING.get("rank_all")
    if rank_all is None:
        return device.type == "cuda" and n_flat <= _runtime.sm_count(device)
    return bool(rank_all)


def _rank_warps(n_flat: int, device: torch.device) -> int:
    """Warps of a stage-2 program of the block maxima (``UPDATE_TUNING["rank_warps"]``, None: 4
    where each node's program has an SM to itself, so its two rankings are the launch's latency;
    else 2, where programs queue for the SMs and fewer warps a ranking keep more of them
    resident)."""
    warps = UPDATE_TUNING.get("rank_warps")
    if warps is None:
        return 4 if device.type != "cuda" or n_flat <= _runtime.sm_count(device) else 2
    return int(warps)


def _update_block_max(V: int, block_v: int) -> int:
    """Logits per block of the block-maxima method for a vocabulary of V (``UPDATE_TUNING
    ["block_max"]``, or by default 64 up to ``BLOCK_MAX_SMALL_V`` and 128 above; at most a
    stage-1 block of ``block_v``), or 0: the top-k lists."""
    mb = UPDATE_TUNING.get("block_max")
    if mb is None:
        mb = 64 if V <= BLOCK_MAX_SMALL_V else 128
    return min(mb, block_v) if mb else 0


def update_workspace_key(n_flat: int, V: int, K: int, device: torch.device) -> tuple[int, int, int]:
    """(nodes, float32 slots a node, int32 slots a node): the key, and the sizes, of
    ``adjacency_update``'s workspace for ``n_flat`` nodes of V logits and a table of width K:
    each split's top-k list (S * padded k slots of both), or with the block-maxima method each
    block's value key (cdiv(V, block) int32 slots and no float32 slot)."""
    mb = _update_block_max(V, update_tiling(n_flat, V, device)[0])
    if mb:
        return n_flat, 0, cdiv(V, mb)
    slots = update_splits(n_flat, V, device) * max(pow2(K), 2)
    return n_flat, slots, slots


def _chunk(V: int, S: int, block_v: int) -> int:
    """Ids per split: V / S rounded up to whole blocks (at most ``_MAX_CHUNK`` when V / S is,
    since ``block_v`` divides it)."""
    return cdiv(cdiv(V, S), block_v) * block_v


def _update_by_block_maxima(
    table, owner, ws_key, tokens, num_nodes, logits, S, chunk, mb, last_wins, block_v, warps
) -> None:  # fmt: skip
    """The update's block-maxima method (``graft_update._block_max_kernel`` then
    ``_block_top_kernel``): stage 1 keeps a max per ``mb`` logits, stage 2 rereads the K best
    blocks of each winning node (of every valid node where ``_rank_all``; only winners store)."""
    V, K = table.shape
    B, N = tokens.shape
    n_flat = B * N
    KB = max(pow2(K), 2)
    common = (tokens, num_nodes, owner)
    # PDL only where ``TREEOPS_PDL`` asks: late release made B 1 slower on an H100 (V 32,000:
    # 8.4 -> 10.5 us; docs/benchmarks.md)
    pdl = use_pdl(logits.device)
    direct(_block_max_kernel).launch(
        (n_flat, S), logits, *common, ws_key, N, V, n_flat, chunk, logits.stride(0),
        logits.stride(1), BLOCK_V=block_v, MB=mb, LAST_WINS=last_wins, PDL=pdl,
        num_warps=warps, launch_pdl=pdl > 0,
    )  # fmt: skip
    # int32 keys hold 16 bits of a bf16 value and 16 of a block index or tile position
    key32 = (UPDATE_TUNING["rank32"] and logits.dtype == torch.bfloat16
             and max(cdiv(V, mb), KB * mb) <= 1 << 16)  # fmt: skip
    direct(_block_top_kernel).launch(
        (n_flat,), logits, *common, table, ws_key, N, V, n_flat, logits.stride(0),
        logits.stride(1), K=K, KB=KB, NBP=max(pow2(cdiv(V, mb)), KB), MB=mb,
        LAST_WINS=last_wins, KEY32=key32, RANK_ALL=_rank_all(n_flat, logits.device), PDL=pdl,
        num_warps=_rank_warps(n_flat, logits.device), launch_pdl=pdl > 0,
    )  # fmt: skip


def adjacency_update(
    table: torch.Tensor,
    owner: torch.Tensor,
    workspace: dict,
    tokens: torch.Tensor,
    num_nodes: torch.Tensor,
    logits: torch.Tensor | None,
    topk_ids: torch.Tensor | None,
    last_wins: bool,
) -> None:
    """``table[tokens[b, i]] = top-k(logits[b, i])`` (or ``topk_ids[b, i, :k]``) for
    ``i < num_nodes[b]``; duplicate tokens: lowest flattened index wins (highest when
    ``last_wins``). ``owner`` [V] int32 must be all INT32_MAX (it is again afterwards)."""
    V, K = table.shape
    B, N = tokens.shape
    n_flat = B * N
    KB = max(pow2(K), 2)
    _contig("tokens", tokens)
    if n_flat == 0:
        return
    # from the first launch on, a failure undoes the claims: only the write launch's winners
    # reset them, and a stale claim would block its token's row from every later update
    try:
        if logits is not None:
            key = update_workspace_key(n_flat, V, K, logits.device)
            block_v, warps = update_tiling(n_flat, V, logits.device)
            S = update_splits(n_flat, V, logits.device, block_v)
            chunk = _chunk(V, S, block_v)
            if key not in workspace:
                workspace[key] = (
                    torch.empty(n_flat * key[1], dtype=torch.float32, device=table.device),
                    torch.empty(n_flat * key[2], dtype=torch.int32, device=table.device),
                )
            ws_val, ws_id = workspace[key]
            mb = _update_block_max(V, block_v)
            if mb:
                _update_by_block_maxima(table, owner, ws_id, tokens, num_nodes, logits, S,
                                        chunk, mb, last_wins, block_v, warps)  # fmt: skip
                return
            direct(_topk_partial_kernel).launch(
                (n_flat, S),
                logits,
                tokens,
                num_nodes,
                owner,
                ws_val,
                ws_id,
                N,
                V,
                n_flat,
                chunk,
                logits.stride(0),
                logits.stride(1),
                K=K,
                KB=KB,
                S=S,
                BLOCK_V=block_v,
                GROUP=_update_group(block_v, KB),
                KEY32=logits.dtype == torch.bfloat16,
                LAST_WINS=last_wins,
                num_warps=warps,
            )
            n_cand = S * KB
            ids, s_ib, s_in, k_ids = ws_id, 0, 0, 0
        else:
            assert topk_ids is not None
            # before any launch: a claim left behind by a failed call would block later updates
            if topk_ids.stride(2) != 1 and topk_ids.shape[2] > 1:  # the rule of treeops._checks
                raise ValueError(
                    "Invalid stride of topk_ids: expected the last dimension contiguous"
                )
            direct(_claim_kernel).launch(
                (cdiv(n_flat, 256),),
                tokens,
                num_nodes,
                owner,
                N,
                V,
                n_flat,
                BLOCK=256,
                LAST_WINS=last_wins,
            )
            ws_val, ws_id = table, table  # unused
            n_cand = KB
            ids, k_ids = topk_ids, topk_ids.shape[2]
            s_ib, s_in = topk_ids.stride(0), topk_ids.stride(1)
        C = pow2(n_cand)
        block_m = max(1, min(64, 512 // C))
        direct(_update_write_kernel).launch(
            (cdiv(n_flat, block_m),),
            tokens,
            num_nodes,
            owner,
            table,
            ws_val,
            ws_id,
            ids,
            N,
            V,
            n_flat,
            k_ids,
            s_ib,
            s_in,
            n_cand,
            K=K,
            KB=KB,
            C=C,
            BLOCK_M=block_m,
            FROM_LOGITS=logits is not None,
            BITONIC=UPDATE_TUNING["merge"] == "bitonic",
            LAST_WINS=last_wins,
            num_warps=4,
        )
    except BaseException:
        owner.fill_(INT32_MAX)
        raise

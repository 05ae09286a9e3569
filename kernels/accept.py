"""Acceptance kernels (docs/design.md op 7): greedy and lossless sampling.

Greedy, one launch: one program per (request b, node i, vocabulary split s) reads its slice of
node i's logits once and writes partial statistics to a small workspace: running max and its
lowest id (the argmax), with logprobs the sum of ``exp(x - max)``, optionally the k largest
(value, id) pairs. Each program then bumps a per-request counter (release/acquire); the last of
the request's ``N * S`` programs merges the partials of all nodes (vectorised over nodes) and
walks the tree in registers -- at most N steps, each a few O(N) vector operations -- then writes
the outputs and resets the counter to 0, so the launch can be replayed in a CUDA graph without a
memset. ``phase=1`` splits the same code into two launches (node statistics, then one walker
program per request) as a fallback.

Sampling, three launches whatever ``phase`` (without top-k / top-p tensors, no pass 2:
``PLAIN_SAMPLING_PHASE``). Pass 1, the same split grid as greedy, reads every
logit once: per split the max, argmax and sum of ``exp((x - max) / T)``, each vocabulary block's
mass (relative to the split's running max) and, for top-k/top-p rows, the maxima of groups of GROUP
tokens. Pass 2, one program per node (``accept_thresh``): merges the partials into the node's max
and normaliser; a top-k/top-p row takes a lower bound L of its threshold from coarse maxima (the
max of G_PAD / GC consecutive groups; the k-th largest of them, or for top-p alone the one where
the sorted maxima's mass reaches top_p), rereads only the groups whose maximum reaches L (about k
groups of GROUP tokens: a few KB), sorts the tokens >= L (at most CAP) by (logit descending, id
ascending) and reads the kept set off them: the first C tokens, i.e. ``key(x_t) > thr or (key(x_t)
== thr and t <= idcut)`` with ``key`` an order-preserving int32 image of the fp32 logit, its mass
and its mass per vocabulary block. When k exceeds the number of groups or more than CAP tokens
reach L (a wide nucleus), an exact search over the keys runs instead (``EXACT_PIVOTS`` 1: two
pivots a pass, the value where the mass interpolated between the bracket's ends meets the goal
and the values' midpoint, or the keys' after a pass that did not halve their span: at most
twice the keys' bisection, which takes 32 passes over fp32 logits and 16 over bf16 ones, whose
keys differ only in their high bits; 2-9 over dense bf16 rows of 128K; plus tie and mass passes; by
the node's program alone, in ``EXACT_TILE``-token reads: hundreds of µs where the fast path
takes tens, but exact).
Then a walker launch, one program per request, walks. (The walk fused into the request's last
pass-2 program, as greedy's is into pass 1, measured slower on the H200 at every B: its code
doubled pass 2's registers.)

The walker finds the bonus token of a sampling node from the per-block kept masses, then scans
that block (and the next ones only if rounding says so), so no request rescans a whole row.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
import triton
import triton.language as tl

from treeops import _runtime
from treeops._accept_inputs import Acceptance
from treeops._runtime import interpreted, pow2, refuse_in_capture
from treeops.tree import Tree

from ._counters import arrival_counters, arrive
from ._launch import direct, kept
from ._pdl import PDL_LATE, first_launch_pdl, pdl_enter, pdl_release, use_pdl
from .accept_stats import _node_stats
from .accept_thresh import _finish_node
from .accept_walk import _walk


# V is specialised (Triton keys an integer on ``== 1`` and ``% 16`` only, not its value): a V
# divisible by 16 lets pass 1 load 16 bytes per instruction (``_node_stats``)
@triton.jit(do_not_specialize=["B", "N", "CHUNK", "NCH", "n_stop"])
def _accept_kernel(
    p_logits,  # [B, N, V] target logits (strides s_lb, s_ln, s_lv)
    s_lb,
    s_ln,
    s_lv,
    p_tokens,  # [B, N] tree tokens (stride s_tb)
    s_tb,
    p_parents,  # [B, N] tree parents (stride s_pb)
    s_pb,
    p_num_nodes,  # [B] nodes per request
    p_temp,  # [B] sampling: temperature (<= 0: greedy row)
    p_topk_param,  # [B] sampling: top-k (0: off)
    p_topp,  # [B] sampling: top-p (1: off)
    p_uni,  # [B, N] sampling: uniforms (stride s_ub)
    s_ub,
    p_stop,  # [B or 1, n_stop] stop ids (stride s_sb)
    s_sb,
    n_stop,
    p_budget,  # [B] max new tokens
    p_wmax,  # workspace [B*N*S]: running max per (node, split)
    p_warg,  # workspace [B*N*S]: its lowest id
    p_wse,  # workspace [B*N*S]: sum of exp((x - max) / T) over the kept set
    p_wtkv,  # workspace [B*N*S, K_PAD]: top-K values
    p_wtki,  # workspace [B*N*S, K_PAD]: top-K ids
    p_wthr,  # workspace [B*N]: kept-set threshold key
    p_wcut,  # workspace [B*N]: kept-set id cut at the threshold
    p_wcs,  # workspace [B*N, NCH]: kept mass per vocabulary block
    p_wcm,  # workspace [B*N, NCH]: the max that mass is relative to
    p_wgm,  # workspace [B*N, G_PAD]: group maxima (lower bound of the threshold)
    p_wcand,  # workspace [B*N, CAP] i64: candidate (key, id) slots
    p_wz,  # workspace [B*N]: sampling: the kept set's mass (relative to the node's max)
    p_wsel,  # workspace [B*N, G_PAD] i32: sampling: ids of the groups reaching the bound
    p_count,  # [B] arrival counters (PHASE 0), 0 between launches
    p_acc,  # out [B, N] accepted path
    p_len,  # out [B] accept length
    p_bonus,  # out [B] bonus token
    p_lp,  # out [B, N] log-probs (HAS_LP)
    p_topk,  # out [B, N, K] top-K ids (K > 0)
    B,
    N,
    V,
    CHUNK,
    NCH,
    N_PAD: tl.constexpr,  # N, S, NCH (vocabulary blocks), stop ids: padded to powers of two
    S: tl.constexpr,
    S_PAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_T: tl.constexpr,
    NPIV: tl.constexpr,
    NCH_PAD: tl.constexpr,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    SAMPLE: tl.constexpr,
    NEED_SE: tl.constexpr,
    HAS_STOP: tl.constexpr,
    STOP_PAD: tl.constexpr,
    HAS_BUDGET: tl.constexpr,
    HAS_LP: tl.constexpr,
    PHASE: tl.constexpr,  # see the docstring
    FENCE: tl.constexpr,
    GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    GC: tl.constexpr,
    READ: tl.constexpr,
    CAP: tl.constexpr,
    CAP_S: tl.constexpr,
    SUB: tl.constexpr,
    MASS_TILE: tl.constexpr,  # pass 2: the kept set's block masses from registers up to this tile
    AHEAD: tl.constexpr,  # pass 1's blocks in flight a program (1 or 2; ``_node_stats``)
    VEC: tl.constexpr,  # pass 1's blocks known aligned: vector loads (``_node_stats``)
    HAS_TOPK: tl.constexpr,  # sampling: the launch has top-k / top-p tensors (else off)
    HAS_TOPP: tl.constexpr,
    TRUNC: tl.constexpr,  # sampling: either (else no kept-set pass: PHASE 0 walks as greedy's)
    PDL: tl.constexpr = 0,  # launched with programmatic dependent launch (``_pdl``)
):
    """PHASE 0: pass 1, the request's last program walks (grid B*N*S; greedy, and sampling
    without top-k / top-p tensors). 1: pass 1 only
    (grid B*N*S). 2: the walk only (grid B). 5: sampling's pass 2, each node's kept set (grid
    B*N)."""
    pdl_enter(PDL)
    pid = tl.program_id(0).to(tl.int64)
    if PHASE <= 1:
        _node_stats(
            pid, p_logits, s_lb, s_ln, s_lv, p_num_nodes, p_temp, p_topk_param, p_topp, p_wmax,
            p_warg, p_wse, p_wtkv, p_wtki, p_wcs, p_wcm, p_wgm, N, V, CHUNK, S, BLOCK_V,
            NCH, K, K_PAD, SAMPLE, NEED_SE, GROUP, G_PAD, AHEAD, VEC, HAS_TOPK, HAS_TOPP, TRUNC
        )  # fmt: skip
    if PHASE == 5:
        _finish_node(
            pid, p_logits, s_lb, s_ln, s_lv, p_num_nodes, p_temp, p_topk_param, p_topp, p_wmax,
            p_wse, p_wthr, p_wcut, p_wz, p_wcs, p_wcm, p_wgm, p_wcand, p_wsel, N, V, NCH, S,
            S_PAD, BLOCK_V, BLOCK_T, NPIV, NCH_PAD, GROUP, G_PAD, GC, READ, CAP, CAP_S,
            SUB, MASS_TILE, HAS_TOPK, HAS_TOPP
        )  # fmt: skip
    # the next launch (pass 2 after pass 1, the walk after pass 2) may be placed now; it waits
    # for this one to complete before it reads what this one stored
    pdl_release(PDL)
    # PHASE 0: the request's last program to arrive walks; PHASE 2: one walker per request
    last = False
    if PHASE == 2:
        i_b = pid
        last = True
    if PHASE == 0:
        i_b = pid // (S * N)
        count = arrive(p_count + i_b, FENCE)  # the workspace stores above, then the count
        last = count == N * S - 1
    if (PHASE == 0) or (PHASE == 2):
        if last:
            _walk(
                i_b, p_logits, s_lb, s_ln, s_lv, p_tokens, s_tb, p_parents, s_pb, p_num_nodes,
                p_temp, p_uni, s_ub, p_stop, s_sb, n_stop, p_budget, p_wmax, p_warg, p_wse,
                p_wtkv, p_wtki, p_wthr, p_wcut, p_wz, p_wcs, p_wcm, p_acc, p_len, p_bonus, p_lp,
                p_topk, N, V, NCH, N_PAD, S, S_PAD, BLOCK_V, NCH_PAD, K, K_PAD, SAMPLE, HAS_STOP,
                STOP_PAD, HAS_BUDGET, HAS_LP, TRUNC
            )  # fmt: skip
            if PHASE != 2:
                tl.store(p_count + i_b, 0)


PLAIN_SAMPLING_PHASE = 1
"""The launches of sampling without top-k / top-p tensors when ``accept_launch`` is given no
``phase``: 1, pass 1 and then the walk (two launches; three with truncation). 0, one launch
whose last program per request walks, is slower: the walker's code raises the launch's
registers from pass 1's 48 to 203 (V 32,000) and 255 (V 128,256) at B 1, 4 warps
(``bench/compile_check.py``), so two programs fit an SM where ten did. H100, session 50
(``bench_accept.py``'s ``treeops_one_launch_us``), us, two launches / one: B 1 V 32,000 12.71 /
15.37, V 128,256 21.61 / 28.20, B 2 V 128,256 31.45 / 40.72."""

# every scratch buffer ever handed out stays alive: a CUDA graph captured with an older, smaller
# one keeps using it after a larger launch made a new one
_RETIRED: list[torch.Tensor] = []


def default_splits(
    B: int,
    N: int,
    V: int,
    device: torch.device,
    block_v: int,
    topk_ids: bool = False,
    sample: bool = False,
) -> int:
    """Vocabulary splits per node in pass 1 (greedy, ``sample``: sampling), at most 16, each
    at least one block long: enough programs to fill the GPU twice over. With top-K ids
    (``topk_ids``) the walker merges every split's K candidates, so fewer: sampling's splits
    double while the doubled launch stays within two programs per SM, greedy's (whose walker
    runs in the same launch) within one. The last split may end in a partial block, except
    sampling's with top-K ids. Depends on capacities and the SM count only.

    A partial last split lets V 32,000 (15.6 blocks of 2,048) split 16 ways at B·N <= 32: H100,
    session 53 (``bench_accept.py --topk-splits default --topk-ids 0 --topk-nodes 7,16``), us,
    whole blocks -> a partial last one, greedy / sampling / top-k 50 and top-p 0.9: B 1 N 7
    4.82 -> 4.22 / 8.39 -> 7.41 / 19.96 -> 18.94; B 4 N 7 6.09 -> 5.57 / 10.05 -> 9.48 / 22.64
    -> 21.88; B 2 N 16 5.86 -> 5.91 / 10.47 -> 10.10 / 23.21 -> 22.81.

    One-block splits let B 1 V 32,000 split eight ways in 2,048-logit blocks (H100, session
    50, us, two runs each: greedy 6.84 / 6.86 -> 6.32 / 6.32, sampling 13.64 / 13.76 ->
    12.64 / 12.58, top-k 50 / top-p 0.9 25.48 / 25.43 -> 24.60 / 24.69). With top-8 ids
    (H100, session 51, us), greedy: B 1 N 64 V 32,000 19.49 in 2 splits, 20.8 in 4; B 1 N 7
    V 32,000 17.77 in 2, 13.38 in 4, 9.95 in 8 (8 4,096-logit splits, the last partial); B 1
    N 100 V 32,000 28.78 in 2, 26.51 in 1. Sampling (forced counts, ``bench_accept.py
    --topk-splits``), temperature only / with top-k 50 and top-p 0.9: B 8 N 7 V 8,192 18.15 /
    28.79 in 2, 15.47 / 26.6 in 4, 17.47 / 28.28 in 8; B 2 N 64 V 8,192 24.16 / 35.67 in 1,
    22.54 / 33.1 in 2, 24.46 / 35.19 in 4."""
    if device.type != "cuda":
        return 1
    sms = _runtime.sm_count(device)
    # the most programs a doubled launch may have: without top-K ids under four per SM (so a
    # launch stops doubling at two per SM or more), with them two per SM (sampling) or one
    if not topk_ids:
        most = 4 * sms - 1
    else:
        most = 2 * sms if sample else sms
    # a split holds at least one block and may end in a partial one (the last split's), but
    # sampling's with top-K ids keep whole blocks
    blocks = V // block_v if topk_ids and sample else -(-V // block_v)
    s = 1
    while 2 * s <= blocks and s < 16 and 2 * B * N * s <= most:
        s *= 2
    return s


AHEAD_PROGRAMS_PER_SM = 4
"""Pass 1 loads a block ahead (``ahead`` 2) when its launch has at most this many programs per
SM: B 1 and B 8 at N 64 (512 programs on 132 SMs). Measured on an H100 (``bench_accept.py
--sweep-pass1``, V 32,000, µs, one block / two in flight): greedy B 1 8.3 / 7.4, sampling B 1
16.2 / 14.9, with top-k / top-p 26.2 / 24.9, B 8 sampling 30.0 / 28.1, greedy B 8 16.7 / 16.9;
at B 64 (4,096 programs) two blocks in flight cost sampling 128.5 / 132.3 and 116.4 / 122.9
without truncation tensors, where the launch's many programs already fill the memory pipeline."""


REREAD_TOKENS = 512
"""Pass 2's reread tile (tokens): the candidate groups are read this many tokens at a time. Its
[READ] keys and ids set pass 2's registers at B 64, V 32,000, 4 warps (``bench/compile_check.py``,
sm_90: 1,024: 159; 512: 128; 256: 123): a smaller tile fits more programs an SM (four at 512,
three at 1,024) and takes more reads one after another.
Measured on an H100 at 2,048 groups (``bench_accept.py --sweep-top --batches 8,64``, top-k 50 /
top-p 0.9, µs, 1,024 / 512 / 256 tokens): B 8 V 32,000 56.7 / 48.4 / 50.5; B 64 289.2 / 267.1 /
288.2; B 8 V 128,256 108.8 / 96.4 / 104.5; B 64 650.0 / 621.3 / 684.3. At B 1 (4,096 groups,
session 37) 1,024 and 512 tied: 25.5 / 25.8."""


def default_ahead(programs: int, device: torch.device) -> int:
    """Blocks in flight per pass 1 program (1 or 2) for a launch of ``programs`` programs."""
    if device.type != "cuda":
        return 1
    return 2 if programs <= AHEAD_PROGRAMS_PER_SM * _runtime.sm_count(device) else 1


_SCRATCH: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
_VIEWS: dict[tuple, tuple] = {}  # plan key -> (the scratch they view, its parts)


def _scratch(device: torch.device, n_f: int, n_i: int, n_c: int) -> tuple:
    """The per-device scratch workspace (float32, int32 and int64 parts of at least these sizes),
    as the arrival counters (``arrival_counters``): cached so that an eager launch allocates none,
    grown to the largest launch seen, built by an eager call (a miss during CUDA-graph capture
    raises), a replaced one kept alive for the graphs captured with it; launches on concurrent
    streams must not share it (``workspace``)."""
    cur = _SCRATCH.get(device)
    if cur is None or cur[0].numel() < n_f or cur[1].numel() < n_i or cur[2].numel() < n_c:
        refuse_in_capture("accept's scratch workspace (per device, up to the largest launch)")
        if cur is not None:
            _RETIRED.extend(cur)
            n_f, n_i, n_c = (
                max(n_f, cur[0].numel()),
                max(n_i, cur[1].numel()),
                max(n_c, cur[2].numel()),
            )
        cur = (
            kept(torch.empty(n_f, dtype=torch.float32, device=device)),
            kept(torch.empty(n_i, dtype=torch.int32, device=device)),
            kept(torch.empty(n_c, dtype=torch.int64, device=device)),
        )
        _SCRATCH[device] = cur
    return cur


class _Plan(NamedTuple):
    """A launch's sizes and constexprs: functions of shapes, flags and the device only."""

    S: int
    chunk: int
    NCH: int
    n_f: list[int]  # float32 parts: max, sum-exp, top-K values, block mass, its max, group
    n_i: list[int]  # maxima, kept mass; int32: argmax, top-K ids, threshold, id cut, group ids
    n_cand: int  # int64 candidate slots
    common: dict
    common2: dict  # sampling's pass 2 (PHASE 5)
    common_walk: dict  # sampling's walker (PHASE 2)


_PLANS: dict[tuple, _Plan] = {}


EXACT_TILE = 2048
"""Tokens an iteration of pass 2's exact search (a wide nucleus, or k past the group count):
one program scans its node's row several times, an iteration's loads at a time, so the tile sets
its speed; [EXACT_TILE, EXACT_PIVOTS] compares keep pass 2 at its registers (128 at 4 warps on
sm_90, as at [128, 16]: ``bench/compile_check.py``). Top-p 0.9 alone over standard-normal bf16
logits (a nucleus of most of the row), B 1 N 64, H100, session 53 (``bench/pass2_phases.py``),
us at tile x pivots: V 32,000 128x16 772, 512x4 376, 1024x2 258, 1024x4 336, 2048x1 221,
2048x2 263; V 128,256 3,576 / 1,571 / 1,246 / 1,386 / 973 / 1,133 (the whole-key search
at 128x16 before: 1,649 and 7,703). With session 55's search (interpolated pivot, no membership
test) 4,096 was 12-15 % faster than 2,048 at B 1 V 128,256 but slower at B 8 V 32,000 on both
paths (fast path 43.8 -> 52.4)."""

EXACT_PIVOTS = 1
"""Pivots a pass of the exact search (``_count_search``): 1 takes two of the interpolated
pivot, the values' midpoint and the keys', each in its own [tile] accumulator; more spread
that many over the keys in a [tile, pivots] one. With the widest tile (``EXACT_TILE``)."""


def _plan(B, N, V, dev, sample, K, return_logprobs, n_stop, has_stop, has_budget, num_splits,
          block_v, num_pivots, cap, max_groups, num_warps, ahead, vector_loads, has_topk,
          has_topp, reread, pass2_warps, exact_tile) -> _Plan:  # fmt: skip
    # blocks and warps from the H200 sweep (bench_accept.py --sweep, accept_sweep.json): from
    # B*N = 512 (B 8 at N 64) every program is one split of a whole row and larger blocks keep
    # more bytes in flight: greedy 8,192 at 4 warps (B 64 V 32,000 71.7 against 78.7 us at 4,096
    # and 8 warps; B 8 V 128,256 37.6 against 41.9), sampling 4,096 (B 8 V 128,256 66.6 against
    # 87.8; B 64 321 against 374). Below it, 4,096 (greedy, 8 warps) and 2,048 (sampling): the
    # sampling walker rescans a block for a bonus token, and small B splits rows anyway. Greedy
    # with top-K ids keeps 4,096: its int64 keys over 8,192 logits would spill.
    wide = B * N >= 512
    if block_v is None:
        if sample:
            block_v = 4096 if wide else 2048
            # below B*N = 512, 4,096 too where a split still holds two of them: twice the bytes
            # in flight a program (H100, session 52: B 1 V 128,256 18.4 against 19.9 us; V 32,000,
            # whose splits would hold fewer, keeps 2,048: 14.7 against 15.6 in session 49)
            if not wide and dev.type == "cuda":
                if V >= default_splits(B, N, V, dev, 4096, sample=True) * 2 * 4096:
                    block_v = 4096
        else:
            block_v = 8192 if wide and not K else 4096
            # below B*N = 512 the splits are short: where a split of 4,096-logit blocks would
            # hold fewer than two of them, 2,048 (at 4 warps). H100 sweep, session 49
            # (accept_sweep_s49.json), us, 4,096 at 8 warps / 2,048 at the splits each takes:
            # B 1 V 32,000 6.69 (4 splits) / 6.41 (8), B 2 8.44 / 8.18 (4 each); V 128,256
            # keeps 4,096 (B 1, 8 splits: 11.05 / 11.11; B 2, 4: 16.44 / 17.42)
            if not wide and not K and dev.type == "cuda":
                if V < default_splits(B, N, V, dev, 4096) * 2 * 4096:
                    block_v = 2048
        block_v = min(block_v, pow2(V))
    # the exact search's [BLOCK_T, NPIV] tile (sampling: ``EXACT_TILE``)
    block_t = max(16, min(block_v, exact_tile if sample else 512))
    S = num_splits
    if S is None:
        S = default_splits(B, N, V, dev, block_v, topk_ids=K > 0, sample=sample)
    if ahead is None:
        ahead = default_ahead(B * N * S, dev)
    per_split = -(-V // S)
    chunk = -(-per_split // block_v) * block_v
    K_PAD = pow2(max(K, 1))
    NCH = -(-V // block_v) if sample else 1
    # top-k/top-p fast path: group maxima (at most max_groups groups), GC coarse maxima over them
    # and CAP candidate slots, the last two sorted in registers (512 each on the GPU; 16 and 64
    # under the interpreter, whose tl.sort takes about a second for 1024 elements). Pass 2
    # rereads ~k groups one READ-token tile after another, each read waiting on the last: finer
    # groups make fewer reads for a float per group more written by pass 1. 2,048 groups: the
    # best or within 4 % of it at top-k 50 / top-p 0.9 since pass 2 scans the maxima GC at a time
    # (bench_accept.py --sweep-top, H100, session 37, µs at 512 / 1,024 / 2,048 / 4,096 groups:
    # B 64 V 32,000 326 / 287 / 286 / 350, V 128,256 799 / 696 / 653 / 672; B 8 V 32,000 60 /
    # 55 / 57 / 68; B 1 V 32,000 29 / 25 / 26 / 29)
    if cap is None:
        cap = 64 if interpreted() else 512
    if max_groups is None:
        max_groups = 64 if interpreted() else 2048
        if not interpreted():
            # the group maxima and their selected ids take 8 bytes per group and node of
            # scratch: at most 2^24 groups in all (128 MB, reached at B*N = 4,096), fewer per
            # node beyond (any count gives the exact kept set), never below 512
            per_node = max((1 << 24) // max(B * N, 1), 1)
            max_groups = max(512, min(max_groups, 1 << (per_node.bit_length() - 1)))
    group = min(block_v, pow2(-(-V // max_groups)))
    G_PAD = pow2(-(-V // group))
    GC = min(G_PAD, 16 if interpreted() else 512)
    CAP = pow2(cap)
    BNS = B * N * S
    # sampling's launches chained by programmatic dependent launch where the next launch's
    # programs fit beside the one before (pass 2: one per node; B * N at most the SMs): an H100
    # in session 48 (docs/benchmarks.md), plain -> PDL (pass 1 on PDL too), us: B 1 V 32,000
    # with top-k / top-p 26.56 -> 25.47, without 13.87 -> 12.98, V 128,256 41.78 -> 40.72 and
    # 20.5 -> 19.45; at B 8, where pass 2's 512 programs take SM slots from pass 1's last wave,
    # 49.81 -> 50.61. As chosen (pass 1 plain), B 2, N 8, V 64 chained: 7.14 -> 6.34
    pdl = 0
    if sample and dev.type == "cuda":
        pdl = use_pdl(dev, PDL_LATE.value if B * N <= _runtime.sm_count(dev) else 0)
    trunc = sample and (has_topk or has_topp)
    n_f = [
        BNS,
        BNS,
        BNS * K_PAD if K else 1,
        B * N * NCH if sample else 1,
        B * N * NCH if sample else 1,
        B * N * G_PAD if trunc else 1,
        B * N if sample else 1,
    ]
    n_i = [BNS, BNS * K_PAD if K else 1] + [B * N if sample else 1] * 2
    n_i.append(B * N * G_PAD if trunc else 1)
    if num_warps is None:
        # greedy's 4,096-logit blocks take 8 warps (below B*N = 512, or with top-K ids), its
        # 2,048 and 8,192 blocks and sampling's pass 1 and walk 4: the sweep had 4 warps at or
        # below 8 at every B and V for those (sampling B 64 V 32,000: 118.7 against 157.6 us at
        # 2,048)
        greedy8 = not sample and block_v == 4096 and (not wide or K > 0)
        num_warps = 8 if greedy8 and not interpreted() else 4
    common = dict(
        N_PAD=pow2(N),
        S=S,
        S_PAD=pow2(S),
        BLOCK_V=block_v,
        BLOCK_T=block_t,
        NPIV=num_pivots,
        NCH_PAD=pow2(NCH),
        K=K,
        K_PAD=K_PAD,
        SAMPLE=sample,
        NEED_SE=sample or return_logprobs,
        HAS_STOP=has_stop,
        STOP_PAD=pow2(max(n_stop, 1)),
        HAS_BUDGET=has_budget,
        HAS_LP=return_logprobs,
        FENCE=not interpreted(),
        GROUP=group,
        G_PAD=G_PAD,
        GC=GC,
        READ=max(group, reread or (64 if interpreted() else REREAD_TOKENS)),
        CAP=CAP,
        # the candidates' small sort (the interpreter's tests reach both sizes)
        CAP_S=min(CAP, 128) if not interpreted() else max(CAP // 2, min(CAP, 2)),
        SUB=min(32, CAP),
        # the kept set's [candidates, blocks] tile summed in registers where it has at most this
        # many entries (64 a thread at 4 warps), else the sorted candidates are reread SUB at a
        # time (the interpreter's tests reach both)
        MASS_TILE=8192 if not interpreted() else 256,
        AHEAD=ahead,
        VEC=vector_loads,
        HAS_TOPK=sample and has_topk,
        HAS_TOPP=sample and has_topp,
        TRUNC=trunc,
        # sampling's launches follow one another with programmatic dependent launch: each is
        # placed while the one before finishes; the first starts as usual (kernels/_pdl.py)
        PDL=pdl,
        launch_pdl=first_launch_pdl(pdl),
        num_warps=num_warps,
    )
    # pass 2 of sampling: one program per node, a few KB of the row each; 4 warps
    common2 = dict(common, launch_pdl=pdl > 0,
                   num_warps=pass2_warps or (4 if not interpreted() else num_warps))  # fmt: skip
    # the walker scans a whole block for a bonus token and subtracts the children's weights
    # from their blocks' masses ([nodes, blocks] in registers): 8 warps keep a 4,096 block or a
    # 4,096-entry tile unspilled
    big = block_v >= 4096 or pow2(N) * pow2(NCH) >= 4096
    walk_warps = 8 if big and not interpreted() else common["num_warps"]
    common_walk = dict(common, launch_pdl=pdl > 0, num_warps=walk_warps)
    return _Plan(S, chunk, NCH, n_f, n_i, B * N * CAP if trunc else 1, common, common2,
                 common_walk)  # fmt: skip


def accept_launch(
    tree: Tree,
    target_logits: torch.Tensor,
    *,
    temperature: torch.Tensor | None = None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    uniforms: torch.Tensor | None = None,
    stop_ids: torch.Tensor | None = None,
    max_new_tokens: torch.Tensor | None = None,
    return_logprobs: bool = False,
    topk_ids: int = 0,
    out: Acceptance | None = None,
    num_splits: int | None = None,
    block_v: int | None = None,
    phase: Literal[0, 1] | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    num_pivots: int | None = None,
    cap: int | None = None,
    max_groups: int | None = None,
    num_warps: int | None = None,
    ahead: int | None = None,
    vector_loads: bool = True,
    reread: int | None = None,
    pass2_warps: int | None = None,
    exact_tile: int | None = None,
) -> Acceptance:
    """Launch the acceptance kernels (greedy when ``uniforms`` is None). Inputs are assumed
    validated by ``treeops.accept``.

    ``phase``: 0 lets the last program per request walk the tree after an arrival counter, one
    launch; 1 launches the walk separately (one program per request), a fallback that needs no
    inter-program ordering. Greedy takes 0 by default. Sampling takes three launches (pass 1,
    pass 2, the walk; the module docstring) whatever ``phase``, or without ``top_k`` and
    ``top_p`` tensors (no request truncates) no pass 2: ``PLAIN_SAMPLING_PHASE`` by default,
    0 only where pass 1's blocks are 2,048 logits or fewer (else 1). ``num_splits`` and
    ``block_v`` override the defaults (tests use small ones to exercise the split and block
    loops); ``num_warps`` overrides pass 1's warps, ``ahead`` (1 or 2; None:
    ``default_ahead``) its blocks in flight a program, and ``vector_loads=False`` makes its
    logits loads one element each; ``reread`` (tokens, a power of two) is the tile in which
    pass 2 rereads candidate groups and ``pass2_warps`` pass 2's warps, ``exact_tile`` and
    ``num_pivots`` the exact search's tokens an iteration and pivots a pass (default
    ``EXACT_TILE``, ``EXACT_PIVOTS``; the benchmark's sweeps).
    ``workspace``:
    ``(float32, int32, counters)`` buffers to use instead of the per-device cached scratch and
    counters (``_scratch``, ``arrival_counters``), for launches on concurrent streams.

    Sizes, tiles and constexprs depend on shapes, flags and the device only and are computed once
    per such key."""
    if phase not in (0, 1, None):
        raise ValueError(f"Invalid value of phase: expected 0, 1 or None, got {phase!r}")
    if ahead not in (1, 2, None):
        raise ValueError(f"Invalid value of ahead: expected 1, 2 or None, got {ahead!r}")
    if reread is not None and (reread < 1 or reread & (reread - 1)):
        raise ValueError(f"Invalid value of reread: expected a power of two, got {reread!r}")
    for name, v in (("exact_tile", exact_tile), ("num_pivots", num_pivots)):
        if v is not None and (v < 1 or v & (v - 1)):
            raise ValueError(f"Invalid value of {name}: expected a power of two, got {v!r}")
    if pass2_warps not in (None, 1, 2, 4, 8, 16):
        raise ValueError(f"Invalid value of pass2_warps: expected 1-16, a power of two, got "
                         f"{pass2_warps!r}")  # fmt: skip
    B, N, V = target_logits.shape
    dev = target_logits.device
    sample = uniforms is not None
    K = int(topk_ids)
    return_logprobs = bool(return_logprobs)
    has_stop = stop_ids is not None
    n_stop = stop_ids.shape[-1] if has_stop else 0
    has_budget = max_new_tokens is not None
    has_topk, has_topp = top_k is not None, top_p is not None
    key = (B, N, V, dev, sample, K, return_logprobs, n_stop, has_stop, has_budget, num_splits,
           block_v, num_pivots or EXACT_PIVOTS, cap, max_groups, num_warps, ahead,
           bool(vector_loads), has_topk, has_topp, reread, pass2_warps,
           exact_tile or EXACT_TILE)  # fmt: skip
    plan = _PLANS.get(key)
    if plan is None:
        plan = _plan(*key)
        if len(_PLANS) >= 256:
            _PLANS.clear()
        _PLANS[key] = plan
    if out is None:
        out = Acceptance(
            torch.empty(B, N, dtype=torch.int32, device=dev),
            torch.empty(B, dtype=torch.int32, device=dev),
            torch.empty(B, dtype=torch.int64, device=dev),
            torch.empty(B, N, dtype=torch.float32, device=dev) if return_logprobs else None,
            torch.empty(B, N, K, dtype=torch.int32, device=dev) if K else None,
        )
    if workspace is None:
        count = arrival_counters(dev, B)
        ws = _scratch(dev, sum(plan.n_f), sum(plan.n_i), plan.n_cand)
        hit = _VIEWS.get(key)
        if hit is not None and hit[0] is ws:
            views = hit[1]
        else:  # first launch of this key, or the scratch grew since
            views = _split_views(plan, ws)
            if len(_VIEWS) >= 256:
                _VIEWS.clear()
            _VIEWS[key] = (ws, views)
    else:
        ws_f, ws_i, count = workspace
        w_cand = torch.empty(plan.n_cand, dtype=torch.int64, device=dev)
        views = _split_views(plan, (ws_f, ws_i, w_cand))
    w_max, w_se, w_tkv, w_cs, w_cm, w_gm, w_z, w_arg, w_tki, w_thr, w_cut, w_sel, w_cand = views
    dummy_f = w_se
    s_sb = (stop_ids.stride(0) if stop_ids.dim() == 2 else 0) if has_stop else 0
    tk, tp = tree.tokens, tree.parents
    args = [
        target_logits,
        *target_logits.stride(),
        tk,
        tk.stride(0),
        tp,
        tp.stride(0),
        tree.num_nodes,
        temperature if sample else dummy_f,
        top_k if has_topk else w_arg,
        top_p if has_topp else dummy_f,
        uniforms if sample else dummy_f,
        uniforms.stride(0) if sample else 0,
        stop_ids if has_stop else w_arg,
        s_sb,
        n_stop,
        max_new_tokens if has_budget else w_arg,
        w_max,
        w_arg,
        w_se,
        w_tkv,
        w_tki,
        w_thr,
        w_cut,
        w_cs,
        w_cm,
        w_gm,
        w_cand,
        w_z,
        w_sel,
        count,
        out.accepted,
        out.accept_len,
        out.bonus,
        out.logprobs if return_logprobs else dummy_f,
        out.topk if K else w_arg,
        B,
        N,
        V,
        plan.chunk,
        plan.NCH,
    ]
    assert tk.stride(1) == 1 and tp.stride(1) == 1, "tree fields are contiguous along N"
    S = plan.S
    kern = direct(_accept_kernel)
    if not sample:
        if phase in (0, None):
            kern.launch((B * N * S,), *args, PHASE=0, **plan.common)
        else:
            kern.launch((B * N * S,), *args, PHASE=1, **plan.common)
            kern.launch((B,), *args, PHASE=2, **plan.common)
        return out
    if not plan.common["TRUNC"]:
        # no top-k / top-p tensor: no kept sets to find. Pass 1's last program of each request
        # walks, as greedy's does, where pass 1's warps can hold the walker's block scan
        # (blocks of 2,048 logits or fewer: 4 warps); else pass 1, then the walk
        phase = PLAIN_SAMPLING_PHASE if phase is None else phase
        if phase == 0 and plan.common["BLOCK_V"] <= 2048:
            kern.launch((B * N * S,), *args, PHASE=0, **plan.common)
        else:
            kern.launch((B * N * S,), *args, PHASE=1, **plan.common)
            kern.launch((B,), *args, PHASE=2, **plan.common_walk)
        return out
    # sampling: pass 1 (statistics over vocabulary splits), pass 2 (each node's kept set), the
    # walk (one program per request)
    kern.launch((B * N * S,), *args, PHASE=1, **plan.common)
    kern.launch((B * N,), *args, PHASE=5, **plan.common2)
    kern.launch((B,), *args, PHASE=2, **plan.common_walk)
    return out


def _split_views(plan: _Plan, ws: tuple) -> tuple:
    """The workspace parts as the kernel's arguments: float32 parts, int32 parts, candidates."""
    ws_f, ws_i, w_cand = ws
    f = ws_f[: sum(plan.n_f)].split_with_sizes(plan.n_f)
    i = ws_i[: sum(plan.n_i)].split_with_sizes(plan.n_i)
    return (*f, *i, w_cand[: plan.n_cand])

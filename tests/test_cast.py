"""CAST's Algorithm 1 (reference and kernels) against independent computations (exact
arithmetic); the cost table is tested in test_cost_table.py."""

from __future__ import annotations

from collections import deque
from fractions import Fraction

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import treeops
from helpers import brute_utilities
from treeops.reference import cast as ref


# ------------------------------------------------------------------------------ brute force
def brute_select(u: list[Fraction], c: list[Fraction], C: Fraction, cap: int | None = None) -> int:
    """Largest k in [1, min(K, cap)] maximising u_k - C c_k, in exact rational arithmetic."""
    best, arg = None, 0
    for k in range(1, min(len(u), len(u) if cap is None else max(cap, 1)) + 1):
        v = u[k - 1] - C * c[k - 1]
        if best is None or v >= best:
            best, arg = v, k
    return arg


def fr(x: float) -> Fraction:
    return Fraction(float(x))


def brute_available(scores: list[list[float]], active: list[bool], root: bool = False) -> int:
    """The cap of CAST's k: the most candidates (score >= 0) of an active request, + 1 with the
    root, at least 1."""
    have = [sum(v >= 0 for v in row) for row, a in zip(scores, active, strict=True) if a]
    return max(max(have, default=0) + int(root), 1)


@st.composite
def dyadic_batches(draw, max_b=64, max_m=12):
    """Scores that are multiples of 1/64 (sums and batch means stay exact in float32 for B a
    power of two; for other B the reference's float64 is still exact enough to be checked against
    Fractions up to the final comparison, so we keep B a power of two)."""
    B = draw(st.sampled_from([1, 2, 4, 8, 16, 32, 64][: max(1, max_b.bit_length())]))
    M = draw(st.integers(1, max_m))
    vals = st.integers(0, 64).map(lambda v: v / 64)
    scores = [[draw(vals) for _ in range(M)] for _ in range(B)]
    active = [draw(st.booleans()) for _ in range(B)]
    if not any(active):
        active[0] = True
    return scores, active


def dyadic_costs(draw, K, plateaus=True):
    """Non-decreasing costs, multiples of 1/16, with plateaus."""
    c, v = [], draw(st.integers(1, 16))
    for _ in range(K):
        if not plateaus or draw(st.booleans()):
            v += draw(st.integers(0, 8))
        c.append(v / 16)
    return c


# ------------------------------------------------------------------------------ Algorithm 1
@given(st.data())
def test_select_matches_brute_force(data):
    K = data.draw(st.integers(1, 20))
    u = sorted(data.draw(st.lists(st.integers(0, 256), min_size=K, max_size=K)))
    c = dyadic_costs(data.draw, K)
    C = data.draw(st.integers(0, 64)) / 8
    got = int(treeops.cast_select(torch.tensor([x / 64 for x in u]), torch.tensor(c), C))
    assert got == brute_select([Fraction(x, 64) for x in u], [fr(x) for x in c], fr(C))


def test_select_ties_take_the_largest_k():
    u = torch.tensor([1.0, 2.0, 3.0, 3.0])
    c = torch.tensor([0.0, 1.0, 2.0, 2.0])
    assert int(treeops.cast_select(u, c, 1.0)) == 4  # u - c = 1, 1, 1, 1
    assert int(treeops.cast_select(u, c, 2.0)) == 1  # 1, 0, -1, -1


@given(dyadic_batches(), st.data())
def test_width_matches_brute_force(batch, data):
    scores, active = batch
    K = data.draw(st.integers(1, 12))
    c = dyadic_costs(data.draw, K)
    C1 = data.draw(st.integers(0, 64)) / 16
    got = int(
        treeops.cast_width(torch.tensor(scores), torch.tensor(c), C1, active=torch.tensor(active))
    )
    cap = brute_available(scores, active)
    want = brute_select(brute_utilities(scores, K, active), [fr(x) for x in c], fr(C1), cap)
    assert got == want
    assert 1 <= got <= min(K, cap)


@given(dyadic_batches(), st.data())
def test_rerank_matches_brute_force(batch, data):
    scores, active = batch
    K = data.draw(st.integers(1, 16))
    c = dyadic_costs(data.draw, K)
    C3 = data.draw(st.integers(0, 64)) / 16
    got = int(
        treeops.cast_rerank(torch.tensor(scores), torch.tensor(c), C3, active=torch.tensor(active))
    )
    cap = brute_available(scores, active, root=True)
    u = brute_utilities(scores, K, active, root=True)
    want = brute_select(u, [fr(x) for x in c], fr(C3), cap)
    assert got == want
    assert 1 <= got <= min(K, cap)


@given(dyadic_batches(max_m=14), st.data())
def test_theorem_4_1(batch, data):
    """c_k = lam*k + delta and C1 = sum_b v_b(K) / (B lam): width = K exactly when the batch-mean
    (K+1)-th score is strictly below the K-th (docs/design.md op 5, "Check")."""
    scores, _ = batch
    B, M = len(scores), len(scores[0])
    if M < 2:
        return
    K = data.draw(st.integers(1, M - 1))
    Kmax = data.draw(st.integers(K + 1, M))
    lam = data.draw(st.sampled_from([0.25, 0.5, 1.0, 2.0]))
    delta = data.draw(st.integers(0, 8)) / 4
    srt = [sorted(r, reverse=True) for r in scores]
    vK = sum(r[K - 1] for r in srt)
    vK1 = sum(r[K] for r in srt)
    C1 = vK / (B * lam)
    costs = torch.tensor([lam * k + delta for k in range(1, Kmax + 1)])
    got = int(treeops.cast_width(torch.tensor(scores), costs, C1))
    if vK1 < vK:
        assert got == K
    else:  # equal means: ties, the largest k of the plateau wins, so at least K + 1
        assert got > K


def test_theorem_4_1_three_requests_exact_tie():
    """B = 3 (not a power of two): the batch mean of dyadic sums is not dyadic, so Algorithm 1 must
    compare the sums with C1 * n_act, not the rounded means. Here u_1 - C1 c_1 = u_2 - C1 c_2 =
    1/48 exactly and the (K+1)-th mean score is below the K-th, so width = K = 2."""
    scores = torch.tensor([[0.75, 0.75, 0.3125], [0.0, 0.75, 0.6875], [0.4375, 0.4375, 0.125]])
    costs = torch.tensor([1.0, 2.0, 3.0])  # lam = 1, delta = 0
    srt = torch.sort(scores, dim=1, descending=True).values
    C1 = float(srt[:, 1].sum()) / 3  # 1.875 / 3 = 0.625, exact
    assert C1 == 0.625
    assert int(treeops.cast_width(scores, costs, C1)) == 2
    # the same batch with a fourth, inactive request
    s4 = torch.cat([scores, torch.rand(1, 3)])
    active = torch.tensor([True, True, True, False])
    assert int(treeops.cast_width(s4, costs, C1, active=active)) == 2


@given(dyadic_batches(), st.data())
def test_raising_C1_or_draft_costs_never_widens(batch, data):
    scores, active = batch
    K = data.draw(st.integers(1, 12))
    c = torch.tensor(dyadic_costs(data.draw, K))
    s, a = torch.tensor(scores), torch.tensor(active)
    Cs = sorted(data.draw(st.lists(st.integers(0, 64), min_size=2, max_size=6)))
    widths = [int(treeops.cast_width(s, c, C / 16, active=a)) for C in Cs]
    assert widths == sorted(widths, reverse=True)
    scales = [1.0, 1.5, 2.0, 4.0]
    C1 = data.draw(st.integers(1, 64)) / 16
    widths = [int(treeops.cast_width(s, c * f, C1, active=a)) for f in scales]
    assert widths == sorted(widths, reverse=True)


@given(dyadic_batches(), st.integers(1, 12), st.integers(0, 64))
def test_equal_costs_take_all_K(batch, K, C1):
    """Equal costs: every candidate that exists is worth taking, so the width is K, or the most
    candidates of an active request when fewer exist (every score here is >= 0: M of them)."""
    scores, active = batch
    got = int(
        treeops.cast_width(
            torch.tensor(scores), torch.full((K,), 0.75), C1 / 8, active=torch.tensor(active)
        )
    )
    assert got == min(K, len(scores[0]))


def test_plateau_in_costs_ends_at_the_plateau_end():
    # strictly increasing utilities: on a plateau of costs the width goes to the plateau's end
    scores = torch.tensor([[0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625]])
    costs = torch.tensor([1.0, 1.0, 1.0, 1.0, 9.0, 9.0])
    assert int(treeops.cast_width(scores, costs, C1=0.5)) == 4
    assert int(treeops.cast_width(scores, costs, C1=0.0)) == 6
    assert int(treeops.cast_width(scores, costs, C1=100.0)) == 4


def test_inactive_rows_do_not_count():
    s = torch.tensor([[0.5, 0.5, 0.5], [0.9, 0.1, 0.0]])
    c = torch.tensor([1.0, 2.0, 3.0])
    only0 = int(treeops.cast_width(s[:1], c, 0.4))
    assert int(treeops.cast_width(s, c, 0.4, active=torch.tensor([True, False]))) == only0
    # no active request at all: no candidate exists for the batch, so the width is 1 (the
    # cheapest plateau ends at 2, but a plateau past the candidates is not taken)
    none = torch.tensor([False, False])
    assert int(treeops.cast_width(s, torch.tensor([1.0, 1.0, 2.0]), 1.0, active=none)) == 1
    assert int(treeops.cast_rerank(s, torch.tensor([1.0, 1.0, 2.0]), 1.0, active=none)) == 1


# ------------------------------------------------------- the cap: candidates that exist (#4)
def test_issue_4_width_capped_at_the_candidates():
    """Reviewer's example: flat draft costs, K = 4, but only 2 candidates exist (the rest are
    "none", < 0). Algorithm 1 alone takes the plateau's end (4); the width is 2."""
    s = torch.tensor([[0.5, 0.25, -1.0, -1.0]])
    flat = torch.full((4,), 0.5)
    U, n_act = ref.cast_utility_sums(s, 4)
    assert int(ref.cast_select(U, flat, 1.0 * n_act)) == 4  # the bug, uncapped
    assert int(treeops.cast_width(s, flat, 1.0)) == 2
    assert int(ref.cast_width(s, flat, 1.0)) == 2
    # the cap is the max over *active* requests: a second request with 3 candidates raises it
    s2 = torch.tensor([[0.5, 0.25, -1.0, -1.0], [0.5, 0.25, 0.125, -1.0]])
    assert int(treeops.cast_width(s2, flat, 0.0)) == 3
    assert int(treeops.cast_width(s2, flat, 0.0, active=torch.tensor([True, False]))) == 2


def test_issue_4_verify_count_capped_at_the_nodes():
    """Reviewer's example: flat target costs over N = 16, but only 6 candidates exist (a tree
    of 7 nodes); the verify count is 7, not 16."""
    s = torch.tensor([[0.5, 0.25, 0.25, 0.125, 0.0625, 0.0] + [-1.0] * 10])
    flat = torch.ones(16)
    U, n_act = ref.cast_utility_sums(s, 16, root=True)
    assert int(ref.cast_select(U, flat, 0.5 * n_act)) == 16  # the bug, uncapped
    assert int(treeops.cast_rerank(s, flat, 0.5)) == 7  # the zero score is a candidate too
    assert int(ref.cast_rerank(s, flat, 0.5)) == 7


@st.composite
def sparse_batches(draw, max_b=8, max_m=12):
    """Dyadic scores with "no candidate" entries (-1): ragged candidate counts per request."""
    scores, active = draw(dyadic_batches(max_b=max_b, max_m=max_m))
    holes = st.booleans() if draw(st.booleans()) else st.just(False)
    scores = [[-1.0 if draw(holes) else v for v in row] for row in scores]
    return scores, active


def flat_costs(draw, K):
    """Plateau costs: one value, or a few long plateaus (multiples of 1/16)."""
    if draw(st.booleans()):
        return [draw(st.integers(1, 32)) / 16] * K
    c, v = [], draw(st.integers(1, 16))
    for _ in range(K):
        if draw(st.integers(0, 5)) == 0:
            v += draw(st.integers(1, 8))
        c.append(v / 16)
    return c


@given(sparse_batches(), st.data())
def test_width_and_verify_count_never_exceed_the_candidates(batch, data):
    """With plateau costs (where the uncapped rule runs past the candidates), width <= the most
    candidates of an active request and verify count <= 1 + that; both equal min(uncapped, cap)
    (non-decreasing costs, C >= 0) and the capped brute force."""
    scores, active = batch
    s, a = torch.tensor(scores), torch.tensor(active)
    have = max(sum(v >= 0 for v in r) for r, x in zip(scores, active, strict=True) if x)
    K = data.draw(st.integers(1, 16))
    c = flat_costs(data.draw, K)
    C = data.draw(st.integers(0, 64)) / 16
    for root, fn in ((False, treeops.cast_width), (True, treeops.cast_rerank)):
        got = int(fn(s, torch.tensor(c), C, active=a))
        cap = max(have + int(root), 1)
        assert 1 <= got <= min(K, cap)
        u = brute_utilities(scores, K, active, root=root)
        uncapped = brute_select(u, [fr(x) for x in c], fr(C))
        assert got == min(uncapped, cap) == brute_select(u, [fr(x) for x in c], fr(C), cap)


# ----------------------------------------------------------------------------------- depth
def brute_depth(u: list[float], c: float, C2: float, R: int) -> bool:
    fifo = deque([Fraction(1)], maxlen=R)
    for j in range(len(u) - 1):
        fifo.append(fr(u[j + 1]) / fr(u[j]) if u[j] > 0 else Fraction(0))
    alpha = sum(fifo) / len(fifo)
    if c == 0:
        return alpha * fr(u[-1]) > 0 or C2 <= 0
    return alpha * fr(u[-1]) / fr(c) >= fr(C2)


@given(st.data())
def test_depth_matches_a_fifo_simulation(data):
    n = data.draw(st.integers(1, 10))
    u = [data.draw(st.sampled_from([0.0, 1.0, 0.5, 0.25, 0.75, 2.0, 0.125])) for _ in range(n)]
    R = data.draw(st.integers(1, 6))
    c = data.draw(st.sampled_from([0.25, 0.5, 1.0, 2.0, 4.0]))
    C2 = data.draw(st.sampled_from([0.0, 0.125, 0.25, 0.5, 1.0, 2.0]))
    got = bool(
        treeops.cast_depth(
            torch.tensor(u, dtype=torch.float64), torch.tensor(c, dtype=torch.float64), C2, R
        )
    )
    assert got == brute_depth(u, c, C2, R)


def test_depth_fifo_forgets_beyond_R():
    u = torch.tensor([1.0, 0.25, 0.25, 0.25])  # ratios 1/4, 1, 1
    c = torch.tensor(1.0)
    # R = 2: FIFO {1, 1} -> alpha 1 -> 0.25 >= 0.25
    assert bool(treeops.cast_depth(u, c, 0.25, 2))
    # R = 4: FIFO {1, 1/4, 1, 1} -> alpha 13/16 -> 13/64 < 0.25
    assert not bool(treeops.cast_depth(u, c, 0.25, 4))


# ----------------------------------------------------------------------------- bad input
def test_nan_and_negative_scores_rejected():
    c = torch.tensor([1.0, 2.0])
    with pytest.raises(
        ValueError,
        match=r"Invalid value in scores: expected finite numbers, "
        r"got NaN or inf",
    ):
        treeops.cast_width(torch.tensor([[0.5, float("nan")]]), c, 1.0, validate=True)
    with pytest.raises(
        ValueError,
        match=r"Invalid value in scores: expected non-negative "
        r"numbers, got -0.5",
    ):
        treeops.cast_rerank(torch.tensor([[0.5, -0.5]]), c, 1.0, validate=True)
    with pytest.raises(ValueError, match=r"Invalid value in costs: expected finite"):
        treeops.cast_width(torch.tensor([[0.5]]), torch.tensor([float("inf")]), 1.0, validate=True)
    with pytest.raises(ValueError, match=r"Invalid value in u_hist: expected non-negative"):
        treeops.cast_depth(torch.tensor([-1.0]), torch.tensor(1.0), 1.0, 2, validate=True)


def test_bad_shapes_and_dtypes_rejected():
    s, c = torch.tensor([[0.5, 0.25]]), torch.tensor([1.0, 2.0])
    with pytest.raises(ValueError, match=r"Invalid shape of scores: expected \[B, M\], got \[2\]"):
        treeops.cast_width(s[0], c, 1.0)
    with pytest.raises(ValueError, match=r"Invalid dtype of costs: expected one of"):
        treeops.cast_width(s, c.to(torch.int64), 1.0)
    with pytest.raises(ValueError, match=r"Invalid shape of active: expected \[1\], got \[2\]"):
        treeops.cast_rerank(s, c, 1.0, active=torch.tensor([True, True]))
    with pytest.raises(ValueError, match=r"Invalid dtype of active: expected torch.bool"):
        treeops.cast_rerank(s, c, 1.0, active=torch.tensor([1]))
    with pytest.raises(ValueError, match=r"Invalid shape of costs: expected \[K\] or \[MC, K\]"):
        treeops.cast_width(s, c[:0], 1.0)
    with pytest.raises(ValueError, match=r"Invalid value of C1: expected a number"):
        treeops.cast_width(s, c, float("nan"))
    with pytest.raises(ValueError, match=r"Invalid value of R: expected a positive int, got 0"):
        treeops.cast_depth(torch.tensor([1.0]), torch.tensor(1.0), 1.0, 0)
    with pytest.raises(ValueError, match=r"Invalid shape of c: expected \[\], got \[1\]"):
        treeops.cast_depth(torch.tensor([1.0]), torch.tensor([1.0]), 1.0, 2)
    with pytest.raises(ValueError, match=r"Invalid shape of c: expected \[3\], got \[2\]"):
        treeops.cast_select(torch.zeros(3), torch.zeros(2), 1.0)


# ------------------------------------------------------------------ torch.ops.treeops (opcheck)
def test_opcheck_cast_ops():
    """``torch.library.opcheck`` of the four CAST ops on CPU: two requests of 50 candidate
    scores (one inactive), 8 costs; the fakes give 0-d int32 (counts) and bool (depth)."""
    g = torch.Generator().manual_seed(2)
    scores = torch.rand(2, 50, generator=g) ** 2
    scores[1, 30:] = -1.0  # no candidate
    costs = torch.cumsum(torch.rand(8, generator=g) + 0.5, 0)
    active = torch.tensor([True, False])
    u = torch.cumsum(torch.rand(8, generator=g, dtype=torch.float64), 0)
    table = torch.cumsum(torch.rand(3, 8, generator=g) + 0.5, 1)  # per context bucket
    seq = torch.tensor([300, 40], dtype=torch.int32)
    no_table = (None, 0, None)
    cases = [
        (torch.ops.treeops.cast_select.default, (u, costs.double(), 0.25)),
        (torch.ops.treeops.cast_width.default, (scores, costs, 0.125, None, *no_table)),
        (torch.ops.treeops.cast_width.default, (scores, costs, 0.125, active, *no_table)),
        (torch.ops.treeops.cast_width.default, (scores, table, 0.125, active, seq, 128, None)),
        (torch.ops.treeops.cast_depth.default, (torch.tensor([1.0, 0.5, 0.375]),
                                                torch.tensor(0.25), 1.0, 2, *no_table, None)),
        (torch.ops.treeops.cast_depth.default, (torch.tensor([1.0, 0.5, 0.375]), table, 1.0, 2,
                                                seq, 128, table[:, 1], torch.tensor(3))),
        (torch.ops.treeops.cast_rerank.default, (scores.bfloat16(), costs, 0.01, None,
                                                 *no_table)),
        (torch.ops.treeops.cast_rerank.default, (scores, costs.double(), 0.01, active,
                                                 *no_table)),
        (torch.ops.treeops.cast_rerank.default, (scores, table, 0.01, None, seq.long(), 64,
                                                 table[:, 0])),
    ]  # fmt: skip
    for op, args in cases:
        res = torch.library.opcheck(op, args)
        assert set(res.values()) == {"SUCCESS"}, (op, res)
    assert int(treeops.cast_width(scores, costs, 0.125)) == int(cases[1][0](*cases[1][1]))


# --------------------------------------------------- the Triton kernels (treeops.kernels.cast)
# Each launcher under the interpreter against the reference (float64), on dyadic values whose
# sums and scaled thresholds are exact in the kernels' float32: the results must be equal.
from treeops import cast as _cast_mod  # noqa: E402
from treeops.kernels import cast as kcast  # noqa: E402
from treeops.testing import NoHostSync  # noqa: E402

SCORE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@st.composite
def kernel_batches(draw, max_b=40, max_m=20):
    """Scores [B, M] (multiples of 1/64 in [0, 1], -1 or -1/64 = no candidate), any B (several
    row tiles under the interpreter), rows without candidates, inactive rows (or None),
    a score dtype, and sometimes a non-contiguous view."""
    B = draw(st.integers(1, max_b))
    M = draw(st.integers(1, max_m))
    none_p = draw(st.sampled_from([0, 1, 3, 10]))  # in tenths: how often a score is "none"
    rows = []
    for _ in range(B):
        if draw(st.integers(0, 7)) == 0:
            rows.append([-1.0] * M)  # no candidate at all
            continue
        rows.append(
            [
                draw(st.sampled_from([-1.0, -1 / 64]))
                if draw(st.integers(0, 9)) < none_p
                else draw(st.integers(0, 64)) / 64
                for _ in range(M)
            ]
        )
    dtype = draw(st.sampled_from(SCORE_DTYPES))
    scores = torch.tensor(rows, dtype=dtype)
    if draw(st.booleans()):
        scores = scores.t().contiguous().t()  # column-major: strides (1, B)
    mode = draw(st.sampled_from(["none", "all", "some", "off"]))
    active = None
    if mode != "none":
        flags = [mode == "all" or (mode == "some" and draw(st.booleans())) for _ in range(B)]
        active = torch.tensor(flags)
    return scores, active


def kernel_costs(draw, K):
    """[K] costs, multiples of 1/16: non-decreasing with plateaus, flat, or unordered."""
    kind = draw(st.sampled_from(["plateaus", "flat", "unordered"]))
    if kind == "plateaus":
        c = dyadic_costs(draw, K)
    elif kind == "flat":
        c = [draw(st.integers(0, 32)) / 16] * K
    else:
        c = [draw(st.integers(0, 64)) / 16 for _ in range(K)]
    return torch.tensor(c, dtype=draw(st.sampled_from([torch.float32, torch.float64])))


def _launch_count(launch, *args):
    out = torch.empty((), dtype=torch.int32)
    launch(*args, out)
    return int(out)


@pytest.mark.parametrize("root", [False, True], ids=["width", "rerank"])
@given(batch=kernel_batches(), data=st.data())
def test_kernel_width_and_rerank_match_the_reference(root, batch, data):
    scores, active = batch
    K = data.draw(st.integers(1, 28))  # often more than the candidates (and than M)
    costs = kernel_costs(data.draw, K)
    C = data.draw(st.integers(0, 64)) / 16
    launch, rule = (
        (kcast.cast_rerank_launch, ref.cast_rerank)
        if root
        else (kcast.cast_width_launch, ref.cast_width)
    )
    got = _launch_count(launch, scores, costs, C, active)
    assert got == int(rule(scores, costs, C, active))
    # the CUDA backend as the op calls it (here on CPU tensors)
    backend = _cast_mod._utility_cuda(launch, rule, root)
    assert int(backend(scores, costs, C, active)) == got


@pytest.mark.parametrize("root", [False, True], ids=["width", "rerank"])
@given(batch=kernel_batches(max_b=12), data=st.data())
def test_kernel_context_table_lookup_matches_the_reference(root, batch, data):
    """Costs as a per-context table [MC, K] looked up in the launch (the row of the longest
    active context, divided by its unit): the kernel equals the reference, which equals the
    vector rule on the row ``cast_context_costs`` picks. Dyadic entries, power-of-two units
    (exact in float32); contexts on both sides of every row boundary and past the last row."""
    scores, active = batch
    B = scores.shape[0]
    K = data.draw(st.integers(1, 20))
    MC = data.draw(st.integers(1, 4))
    L = data.draw(st.sampled_from([1, 16, 128]))
    table = torch.stack([kernel_costs(data.draw, K).double() for _ in range(MC)])
    dt = data.draw(st.sampled_from([torch.float32, torch.float64]))
    table = table.to(dt)
    unit = None
    if data.draw(st.booleans()):
        unit = torch.tensor([2.0 ** data.draw(st.integers(-2, 3)) for _ in range(MC)], dtype=dt)
    elif bool((table[:, 0] == 0).any()):
        table[:, 0] = 1.0  # the default unit (column 0) must not be 0
    seq = torch.tensor([data.draw(st.integers(0, L * (MC + 1))) for _ in range(B)],
                       dtype=data.draw(st.sampled_from([torch.int32, torch.int64])))  # fmt: skip
    C = data.draw(st.integers(0, 64)) / 16
    launch, rule = (
        (kcast.cast_rerank_launch, ref.cast_rerank)
        if root
        else (kcast.cast_width_launch, ref.cast_width)
    )
    out = torch.empty((), dtype=torch.int32)
    launch(scores, table, C, active, out, seq, L, unit)
    want = int(rule(scores, table, C, active, seq, L, unit))
    assert int(out) == want
    row = ref.cast_context_costs(table, seq, L, unit, active)
    assert want == int(rule(scores, row, C, active))


@given(data=st.data())
def test_kernel_depth_context_table_lookup_matches_the_reference(data):
    """The depth flag with a per-context table and the width: kernel = reference = the scalar
    rule on the looked-up entry."""
    n = data.draw(st.integers(1, 6))
    u = torch.tensor([data.draw(st.integers(0, 32)) / 16 for _ in range(n)])
    K, MC, L = data.draw(st.integers(1, 8)), data.draw(st.integers(1, 4)), 32
    table = torch.tensor([[data.draw(st.integers(1, 64)) / 16 for _ in range(K)]
                          for _ in range(MC)])  # fmt: skip
    unit = torch.tensor([2.0 ** data.draw(st.integers(-2, 2)) for _ in range(MC)])
    B = data.draw(st.integers(1, 20))  # several tiles of the context scan under the interpreter
    seq = torch.tensor([data.draw(st.integers(0, L * (MC + 1))) for _ in range(B)])
    width = torch.tensor(data.draw(st.integers(1, K)), dtype=torch.int32)
    C2, R = data.draw(st.integers(0, 32)) / 16, data.draw(st.integers(1, 4))
    out = torch.empty((), dtype=torch.bool)
    kcast.cast_depth_launch(u, table, C2, R, out, seq, L, unit, width)
    want = bool(ref.cast_depth(u, table, C2, R, seq, L, unit, width))
    assert bool(out) == want
    c = ref.cast_context_costs(table, seq, L, unit)[int(width) - 1]
    assert want == bool(ref.cast_depth(u, c, C2, R))
    assert want == bool(treeops.cast_depth(u, table, C2, R, seq_lens=seq, context_len=L,
                                           unit=unit, width=width))  # fmt: skip


def test_context_table_arguments_checked():
    s = torch.rand(2, 5)
    table = torch.ones(3, 4)
    seq = torch.tensor([10, 20], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"Invalid shape of costs: expected \[K\], or"):
        treeops.cast_width(s, table, 0.5)
    with pytest.raises(ValueError, match="Invalid value of context_len"):
        treeops.cast_width(s, table, 0.5, seq_lens=seq)
    with pytest.raises(ValueError, match="Invalid value of seq_lens: only with a per-context"):
        treeops.cast_rerank(s, torch.ones(4), 0.5, seq_lens=seq)
    with pytest.raises(ValueError, match=r"Invalid shape of seq_lens: expected \[2\]"):
        treeops.cast_width(s, table, 0.5, seq_lens=seq[:1], context_len=8)
    with pytest.raises(ValueError, match=r"Invalid shape of unit: expected \[3\]"):
        treeops.cast_rerank(s, table, 0.5, seq_lens=seq, context_len=8, unit=torch.ones(2))
    with pytest.raises(ValueError, match="Invalid value of width"):
        treeops.cast_depth(torch.ones(2), table, 1.0, 2, seq_lens=seq, context_len=8)
    with pytest.raises(ValueError, match="Invalid value of width: only with"):
        treeops.cast_depth(torch.ones(2), torch.tensor(1.0), 1.0, 2, width=torch.tensor(1))
    # a table at the batch's context: row 1 (longest active context 20 // 16)
    t = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 4.0, 8.0, 16.0], [1.0, 1.0, 1.0, 1.0]])
    sc = torch.tensor([[0.5, 0.25, 0.125, 0.0625], [0.5, 0.25, 0.125, 0.0625]])
    assert int(treeops.cast_width(sc, t, 0.0625, seq_lens=seq, context_len=16)) == 2
    assert int(treeops.cast_width(sc, t, 0.0625, seq_lens=seq * 3, context_len=16)) == 4


def test_kernel_width_and_rerank_fixed_cases():
    """The module's examples and the issue-4 caps, through the launchers."""
    s = torch.tensor([[0.5, 0.25, 0.125, 0.0625]])
    ones = torch.ones(4)
    assert _launch_count(kcast.cast_width_launch, s, ones, 1.0, None) == 4
    assert _launch_count(kcast.cast_width_launch, s[:, :2], ones, 1.0, None) == 2
    s3 = torch.tensor([[0.5, 0.25, 0.125]])
    assert _launch_count(kcast.cast_rerank_launch, s3, torch.tensor([1.0, 1.25, 1.5, 1.75]),
                         1.0, None) == 3  # fmt: skip
    assert _launch_count(kcast.cast_rerank_launch, s3, torch.ones(8), 1.0, None) == 4
    s2 = torch.tensor([[0.5, 0.25, -1.0, -1.0], [0.5, 0.25, 0.125, -1.0]])
    flat = torch.full((4,), 0.5)
    assert _launch_count(kcast.cast_width_launch, s2, flat, 0.0, None) == 3
    assert _launch_count(kcast.cast_width_launch, s2, flat, 0.0, torch.tensor([True, False])) == 2
    # no active request: width and count 1
    none = torch.tensor([False, False])
    c = torch.tensor([1.0, 1.0, 2.0])
    assert _launch_count(kcast.cast_width_launch, s2[:, :3], c, 1.0, none) == 1
    assert _launch_count(kcast.cast_rerank_launch, s2[:, :3], c, 1.0, none) == 1
    # B = 3, an exact tie that a rounded mean would break (test_theorem_4_1_three_requests...)
    s3r = torch.tensor([[0.75, 0.75, 0.3125], [0.0, 0.75, 0.6875], [0.4375, 0.4375, 0.125]])
    assert _launch_count(kcast.cast_width_launch, s3r, torch.tensor([1.0, 2.0, 3.0]), 0.625,
                         None) == 2  # fmt: skip
    # no score column at all
    assert _launch_count(kcast.cast_width_launch, torch.zeros(2, 0), c, 1.0, None) == 1


@given(st.data())
def test_kernel_select_matches_the_reference(data):
    K = data.draw(st.integers(1, 40))  # several tiles under the interpreter
    u = torch.tensor([data.draw(st.integers(0, 256)) / 64 for _ in range(K)])
    if data.draw(st.booleans()):
        u = torch.sort(u).values
    c = kernel_costs(data.draw, K)
    u = u.to(data.draw(st.sampled_from([torch.float32, torch.float64])))
    if data.draw(st.booleans()):
        u = torch.stack([u, u], dim=1)[:, 0]  # stride 2
    C = data.draw(st.integers(0, 64)) / 8
    got = _launch_count(kcast.cast_select_launch, u, c, C)
    assert got == int(ref.cast_select(u, c, C))
    assert int(_cast_mod._select_cuda(u, c, C)) == got


def _launch_flag(u, c, C2, R):
    out = torch.empty((), dtype=torch.bool)
    kcast.cast_depth_launch(u, c, C2, R, out)
    return bool(out)


@pytest.mark.filterwarnings("ignore:.*encountered in divide:RuntimeWarning")  # c = 0 (inf, NaN)
@given(st.data())
def test_kernel_depth_matches_the_reference(data):
    """Powers of two and 0 (every ratio exact), any FIFO length, a zero cost too."""
    n = data.draw(st.integers(1, 12))
    vals = [0.0, 0.125, 0.25, 0.5, 1.0, 2.0, 4.0]
    dtype = data.draw(st.sampled_from([torch.float32, torch.float64]))
    u = torch.tensor([data.draw(st.sampled_from(vals)) for _ in range(n)], dtype=dtype)
    if data.draw(st.booleans()):
        u = torch.stack([u, u], dim=1)[:, 1]  # stride 2
    R = data.draw(st.integers(1, 9))
    c = torch.tensor(data.draw(st.sampled_from([0.0, 0.25, 0.5, 1.0, 2.0])), dtype=dtype)
    C2 = data.draw(st.sampled_from([0.0, 0.125, 0.25, 0.5, 1.0, 2.0, 3.0]))
    got = _launch_flag(u, c, C2, R)
    assert got == bool(ref.cast_depth(u, c, C2, R))
    assert bool(_cast_mod._depth_cuda(u, c, C2, R)) == got


def test_kernel_depth_fifo_forgets_beyond_R():
    u, c = torch.tensor([1.0, 0.25, 0.25, 0.25]), torch.tensor(1.0)
    assert _launch_flag(u, c, 0.25, 2) and not _launch_flag(u, c, 0.25, 4)


def test_kernel_launchers_have_no_host_sync():
    """The call a CUDA graph would capture (the second, after a warm-up): no host read, no
    value-dependent shape, no host data copied in (launcher code and the ops' CUDA backends)."""
    g = torch.Generator().manual_seed(3)
    scores = torch.rand(5, 12, generator=g)
    scores[1, 4:] = -1.0
    costs = torch.cumsum(torch.rand(8, generator=g) + 0.5, 0)
    active = torch.tensor([True, False, True, True, False])
    u, c = torch.cumsum(torch.rand(8, generator=g), 0), torch.tensor(0.5)
    calls = [
        lambda: _cast_mod._select_cuda(u, costs, 0.25),
        lambda: _cast_mod._utility_cuda(kcast.cast_width_launch, ref.cast_width, False)(
            scores, costs, 0.125, active
        ),
        lambda: _cast_mod._utility_cuda(kcast.cast_rerank_launch, ref.cast_rerank, True)(
            scores, costs, 0.125, None
        ),
        lambda: _cast_mod._depth_cuda(u, c, 1.0, 3),
    ]
    for call in calls:
        first = call()  # warm-up (compiles)
        with NoHostSync() as check:
            again = call()
        assert check.ops_checked > 0 and int(again) == int(first)
    # the reference does sync: the check can see it
    with pytest.raises(AssertionError, match="host sync"), NoHostSync():
        ref.cast_width(scores, costs, 0.125, active)


def test_kernel_tiling_is_from_shapes():
    for B, M, K, root in [(1, 1, 1, False), (64, 800, 64, True), (8, 100, 10, False),
                          (3, 5, 40, True)]:  # fmt: skip
        BB, KP, CW, warps = kcast.cast_tiling(B, M, K, root)
        assert KP == max(2, treeops._runtime.pow2(min(K, M + root))) and CW >= KP and BB >= 1
        assert kcast.cast_tiling(B, M, K, root) == (BB, KP, CW, warps)


def test_cuda_backend_falls_back_beyond_the_tile():
    """K and M both past ``MAX_TILE``: the backend runs the reference (same answer)."""
    s = torch.rand(1, kcast.MAX_TILE + 1)
    costs = torch.linspace(1.0, 2.0, kcast.MAX_TILE + 1)
    got = _cast_mod._utility_cuda(kcast.cast_width_launch, ref.cast_width, False)(
        s, costs, 0.01, None
    )
    assert int(got) == int(ref.cast_width(s, costs, 0.01))

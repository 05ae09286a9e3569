"""CAST: the cost table and Algorithm 1 against independent computations (exact arithmetic)."""

from __future__ import annotations

import json
import random
from collections import deque
from fractions import Fraction

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import treeops
from treeops.reference import cast as ref


# ------------------------------------------------------------------------------ brute force
def brute_select(u: list[Fraction], c: list[Fraction], C: Fraction) -> int:
    """Largest k in [1, K] maximising u_k - C c_k, in exact rational arithmetic."""
    best, arg = None, 0
    for k in range(1, len(u) + 1):
        v = u[k - 1] - C * c[k - 1]
        if best is None or v >= best:
            best, arg = v, k
    return arg


def fr(x: float) -> Fraction:
    return Fraction(float(x))


def brute_utilities(scores: list[list[float]], K: int, active: list[bool], root: bool = False):
    rows = []
    for b, row in enumerate(scores):
        if not active[b]:
            continue
        s = sorted((fr(max(v, 0.0)) for v in row), reverse=True)
        if root:
            s = [Fraction(1)] + s
        s = (s + [Fraction(0)] * K)[:K]
        acc, cum = Fraction(0), []
        for v in s:
            acc += v
            cum.append(acc)
        rows.append(cum)
    if not rows:
        return [Fraction(0)] * K
    return [sum(r[k] for r in rows) / len(rows) for k in range(K)]


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
    want = brute_select(brute_utilities(scores, K, active), [fr(x) for x in c], fr(C1))
    assert got == want


@given(dyadic_batches(), st.data())
def test_rerank_matches_brute_force(batch, data):
    scores, active = batch
    K = data.draw(st.integers(1, 16))
    c = dyadic_costs(data.draw, K)
    C3 = data.draw(st.integers(0, 64)) / 16
    got = int(
        treeops.cast_rerank(torch.tensor(scores), torch.tensor(c), C3, active=torch.tensor(active))
    )
    want = brute_select(brute_utilities(scores, K, active, root=True), [fr(x) for x in c], fr(C3))
    assert got == want
    assert 1 <= got <= K


@given(dyadic_batches(max_m=14), st.data())
def test_theorem_4_1(batch, data):
    """c_k = lam*k + delta and C1 = sum_b v_b(K) / (B lam): width = K exactly when the batch-mean
    (K+1)-th score is strictly below the K-th (DESIGN.md op 5, "Check")."""
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
    scores, active = batch
    got = int(
        treeops.cast_width(
            torch.tensor(scores), torch.full((K,), 0.75), C1 / 8, active=torch.tensor(active)
        )
    )
    assert got == K


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
    # no active request at all: every utility is 0; the cheapest-plateau end wins
    assert (
        int(
            treeops.cast_width(
                s, torch.tensor([1.0, 1.0, 2.0]), 1.0, active=torch.tensor([False, False])
            )
        )
        == 2
    )


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
    with pytest.raises(ValueError, match=r"Invalid shape of costs: expected \[K\] with K >= 1"):
        treeops.cast_width(s, c[:0], 1.0)
    with pytest.raises(ValueError, match=r"Invalid value of C1: expected a number"):
        treeops.cast_width(s, c, float("nan"))
    with pytest.raises(ValueError, match=r"Invalid value of R: expected a positive int, got 0"):
        treeops.cast_depth(torch.tensor([1.0]), torch.tensor(1.0), 1.0, 0)
    with pytest.raises(ValueError, match=r"Invalid shape of c: expected \[\], got \[1\]"):
        treeops.cast_depth(torch.tensor([1.0]), torch.tensor([1.0]), 1.0, 2)
    with pytest.raises(ValueError, match=r"Invalid shape of c: expected \[3\], got \[2\]"):
        treeops.cast_select(torch.zeros(3), torch.zeros(2), 1.0)


# ------------------------------------------------------------------------------ cost table
def table(**kw):
    kw.setdefault("batch_sizes", [1, 4, 16])
    return treeops.CostTable.from_functions(
        lambda B, c, n: 100 + c / 1024 + max(0, n - 8) * B,
        lambda B, c, n: 10 + c / 4096 + n * B / 8,
        L=kw.pop("L", 1024),
        M=kw.pop("M", 4),
        n_max=kw.pop("n_max", 32),
        **kw,
    )


@given(st.integers(0, 10**6), st.integers(1, 4096), st.integers(1, 40))
def test_select_formula(c, L, M):
    t = treeops.CostTable([1], L, torch.ones(1, M, 2), torch.ones(1, M, 2))
    want = L * (min(c // L, M - 1) + 1)
    assert t.select(c) == want
    assert t.select(c) % L == 0 and L <= t.select(c) <= L * M
    if c >= L and c < L * M:
        assert t.select(c) > c - L  # the bucket's grid point is within one step above


def test_batch_between_measured_uses_next_larger():
    t = table(batch_sizes=[1, 2, 4, 8, 16, 32, 64])
    assert [t.batch_index(B) for B in (1, 2, 3, 5, 8, 9, 33, 64, 65)] == [0, 1, 2, 3, 3, 4, 6, 6, 6]
    assert torch.equal(t.S_T(3, 2047), t.target[2, 1])  # select(2047) = 2048 = 2L
    assert torch.equal(t.S_D(7, 99999), t.draft[3, 3])


def test_costs_are_normalised_by_the_target_single_token():
    t = table()
    wc = t.width_costs(4, 2100, 10)
    assert torch.allclose(wc, t.draft[1, 2, :10] / t.target[1, 2, 0])
    rc = t.rerank_costs(4, 2100, 32)
    assert float(rc[0]) == 1.0 and torch.allclose(rc, t.target[1, 2] / t.target[1, 2, 0])
    with pytest.raises(ValueError, match=r"Invalid value of N: expected 1 <= N <= n_max = 32"):
        t.rerank_costs(4, 0, 33)


def test_stored_non_decreasing_in_n():
    g = torch.Generator().manual_seed(1)
    noisy = 100 + torch.rand(2, 3, 50, generator=g) * 5
    t = treeops.CostTable([1, 8], 512, noisy, noisy / 10)
    assert (t.target[:, :, 1:] >= t.target[:, :, :-1]).all()
    assert (t.draft[:, :, 1:] >= t.draft[:, :, :-1]).all()
    assert torch.equal(t.target, torch.cummax(noisy.double(), dim=2).values)


def test_save_load_roundtrip(tmp_path):
    t = table()
    t.meta.update({"gpu": "NVIDIA H200", "target": "llama-8b-shape", "versions": {"torch": "x"}})
    p = tmp_path / "t.json"
    t.save(p)
    u = treeops.CostTable.load(p)
    assert u.batch_sizes == t.batch_sizes and u.L == t.L and u.meta == t.meta
    assert torch.equal(u.target, t.target) and torch.equal(u.draft, t.draft)
    d = json.loads(p.read_text())
    assert d["format"] == "treeops.CostTable/1" and d["units"] == "microseconds"
    d["format"] = "other"
    p.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"expected format 'treeops.CostTable/1', got 'other'"):
        treeops.CostTable.load(p)


def test_calibrate_interpolates_and_records_metadata(monkeypatch):
    calls = []

    def fake_measure(fn, B, c, n, **kw):
        calls.append((fn.__name__, B, c, n))
        return float(100 * B + c / 1000 + (n if n != 9 else 50))  # a noisy spike at n = 9

    monkeypatch.setattr(treeops.CostTable, "measure", staticmethod(fake_measure))

    def target(B, c, n):
        return None

    def draft(B, c, n):
        return None

    t = treeops.CostTable.calibrate(
        target, draft, [1, 2], L=1000, M=2, n_max=17, ns=[1, 9, 17], meta={"target": "toy"}
    )
    assert len(calls) == 2 * 2 * 2 * 3
    assert {c for _, _, c, _ in calls} == {1000, 2000}
    row = t.target[0, 1].tolist()  # B=1, c=2000: 103 at n=1, 152 at n=9, 119 at n=17
    assert row[0] == 103 and row[8] == 152
    assert row[4] == pytest.approx(103 + 0.5 * 49)  # interpolated between n = 1 and 9
    assert all(v == 152 for v in row[9:])  # running max flattens the spike's far side
    for key in ("gpu", "versions", "created", "measured_ns"):
        assert key in t.meta
    assert t.meta["target"] == "toy"


def test_measure_runs_the_callable_on_cpu():
    hits = []
    us = treeops.CostTable.measure(
        lambda B, c, n: hits.append((B, c, n)), 2, 64, 3, warmup=2, iters=5, device="cpu"
    )
    assert len(hits) == 7 and hits[0] == (2, 64, 3) and us >= 0


def test_table_rejects_bad_input():
    with pytest.raises(ValueError, match=r"Invalid value of batch_sizes: expected increasing"):
        treeops.CostTable([4, 2], 8, torch.ones(2, 1, 1), torch.ones(2, 1, 1))
    with pytest.raises(ValueError, match=r"Invalid shape of draft: expected \[1, M, n_max\]"):
        treeops.CostTable([1], 8, torch.ones(1, 1, 1), torch.ones(2, 1, 1))
    with pytest.raises(ValueError, match=r"Invalid value in target: expected finite non-negative"):
        treeops.CostTable([1], 8, torch.full((1, 1, 1), float("nan")), torch.ones(1, 1, 1))
    with pytest.raises(ValueError, match=r"expected S_T\(B\)\[c\]\[1\] > 0"):
        treeops.CostTable([1], 8, torch.zeros(1, 1, 2), torch.ones(1, 1, 2))


def test_device_tables_are_float32_rows():
    t = table()
    tt, dd = t.device_tables(5, "cpu")
    assert tt.dtype == torch.float32 and tt.shape == (4, 32)
    assert torch.equal(tt, t.target[2].float()) and torch.equal(dd, t.draft[2].float())
    assert t.device_tables(16, "cpu")[0] is tt  # cached


def test_reference_module_is_the_public_one():
    assert treeops.CostTable is ref.CostTable
    r = random.Random(0)
    s = torch.tensor([[r.randrange(64) / 64 for _ in range(5)] for _ in range(3)])
    c = torch.tensor([1.0, 1.0, 2.0, 2.0, 3.0])
    assert int(treeops.cast_width(s, c, 0.5)) == int(ref.cast_width(s, c, 0.5))

"""Tree build: the reference against a brute-force step, the Triton kernels against the reference
(interpreter; exact integer outputs), and bad input."""

from __future__ import annotations

import importlib
import math
import random
from fractions import Fraction
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import treeops
from helpers import assert_close, brute_utilities
from treeops.reference import build_tree as ref

# the interpreter converts loop bounds with a NumPy call that NumPy >= 1.25 deprecates
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array:DeprecationWarning")


# ----------------------------------------------------------------------------- brute force
def f32(x: float) -> float:
    return float(np.float32(x))


def brute_select(u, c, C, cap=None) -> int:
    """Largest k in [1, min(K, cap)] maximising u_k - C c_k."""
    best, arg = None, 0
    for k in range(1, (len(u) if cap is None else min(len(u), max(cap, 1))) + 1):
        v = u[k - 1] - C * c[k - 1]
        if best is None or v >= best:
            best, arg = v, k
    return arg


class Brute:
    """One decoding step computed independently of the reference: Python lists, math.exp."""

    def __init__(self, policy, root_tokens, seq_lens, active):
        self.p = policy
        self.B = len(root_tokens)
        self.root = root_tokens
        self.seq = seq_lens
        self.active = active
        self.cands: list[list[tuple[int, float, int, int]]] = [[] for _ in range(self.B)]
        # frontier rows: (candidate index or -1 for the root, score, token)
        self.frontier = [[(-1, 1.0, root_tokens[b])] if active[b] else [] for b in range(self.B)]
        self.widths: list[int] = []
        self.flags: list[int] = []
        self.u_hist: list[Fraction] = []

    def costs(self, ctx: int, kind: str, n: int) -> list[Fraction]:
        t = self.p.cost_table
        tt, dd = t.device_tables(self.B, "cpu")
        k = min(ctx // t.L, t.M - 1)
        row = dd[k] if kind == "draft" else tt[k]
        return [Fraction(float(row[j])) / Fraction(float(tt[k, 0])) for j in range(n)]

    def max_ctx(self) -> int:
        s = [self.seq[b] for b in range(self.B) if self.active[b]]
        return max(s) if s else 0

    def expand(self, logits: torch.Tensor) -> None:
        i = len(self.widths)
        W, K = self.p.max_width, self.p.topk
        C = W * K
        layer: list[list[tuple[int, float, int, int]]] = []
        for b in range(self.B):
            here = []
            for r, (parent, ps, _) in enumerate(self.frontier[b]):
                xs = logits[b, r].double().tolist()
                m = max(xs)
                s = sum(math.exp(x - m) for x in xs)
                order = sorted(range(len(xs)), key=lambda t: (-xs[t], t))[:K]
                for j, tok in enumerate(order):
                    p = f32(math.exp(xs[tok] - m) / s)
                    score = float(np.float32(ps) * np.float32(p))
                    here.append((i * C + r * K + j, score, tok, parent))
            layer.append(here)
            self.cands[b] += here
        if self.p.is_cast:
            ctx = self.max_ctx() + sum(self.widths)
            c = self.costs(ctx, "draft", W)
            u = brute_utilities(
                [[s for _, s, _, _ in layer[b]] for b in range(self.B) if self.active[b]],
                W,
                root=False,
            )
            # k capped at the most candidates of an active request (issue #4)
            cap = max([len(layer[b]) for b in range(self.B) if self.active[b]] + [1])
            n = brute_select(u, c, Fraction(self.p.C1), cap)
            self.u_hist.append(u[n - 1])
            fifo = [Fraction(1)] + [
                (self.u_hist[j + 1] / self.u_hist[j] if self.u_hist[j] > 0 else Fraction(0))
                for j in range(len(self.u_hist) - 1)
            ]
            fifo = fifo[-self.p.R :]
            alpha = sum(fifo) / len(fifo)
            flag = alpha * u[n - 1] / c[n - 1] >= Fraction(self.p.C2) and i + 1 < self.p.max_depth
        else:
            n = W
            flag = i + 1 < self.p.max_depth
        self.widths.append(n)
        self.flags.append(int(flag))
        for b in range(self.B):
            best = sorted(layer[b], key=lambda c: (-c[1], c[0]))[:n]
            self.frontier[b] = [(idx, s, tok) for idx, s, tok, _ in best]

    def emit(self):
        N = self.p.capacity
        if self.p.is_cast:
            c = self.costs(self.max_ctx(), "target", N)
            u = brute_utilities(
                [[s for _, s, _, _ in self.cands[b]] for b in range(self.B) if self.active[b]],
                N,
                root=True,
            )
            # k capped at 1 + the most candidates of an active request (issue #4)
            cap = 1 + max([len(self.cands[b]) for b in range(self.B) if self.active[b]] + [0])
            n = brute_select(u, c, Fraction(self.p.C3), cap)
        else:
            n = N
        trees = []
        for b in range(self.B):
            if not self.active[b]:
                trees.append(None)
                continue
            chosen = sorted(self.cands[b], key=lambda c: (-c[1], c[0]))[: n - 1]
            pos = {c[0]: j + 1 for j, c in enumerate(chosen)}
            par = [-1] + [0 if c[3] < 0 else pos[c[3]] for c in chosen]  # KeyError: not closed
            toks = [self.root[b]] + [c[2] for c in chosen]
            scores = [1.0] + [c[1] for c in chosen]
            trees.append((par, toks, scores))
        return n, trees


# ---------------------------------------------------------------------------------- inputs
def cost_table(seed: int, n_max: int) -> treeops.CostTable:
    """Dyadic costs (exact in float32) with plateaus; S_T[1] a power of two so c_k is exact."""
    r = random.Random(seed)
    t = torch.empty(2, 3, n_max, dtype=torch.float64)
    d = torch.empty(2, 3, n_max, dtype=torch.float64)
    for i in range(2):
        for k in range(3):
            v, w = 64.0 * (k + 1), 4.0 + r.randrange(8)
            for n in range(n_max):
                if n and r.random() < 0.4:
                    v += r.randrange(1, 16)
                if r.random() < 0.5:
                    w += r.randrange(0, 4) / 4
                t[i, k, n], d[i, k, n] = v, w
    return treeops.CostTable([4, 64], 16, t, d, {"gpu": "test"})


def flat_cost_table(seed: int, n_max: int) -> treeops.CostTable:
    """Plateau costs (issue #4): every row flat in n, or flat with one or two steps; dyadic."""
    r = random.Random(seed)
    t = torch.empty(2, 3, n_max, dtype=torch.float64)
    d = torch.empty(2, 3, n_max, dtype=torch.float64)
    for i in range(2):
        for k in range(3):
            steps_t = {r.randrange(1, n_max + 1) for _ in range(r.randrange(0, 3))}
            steps_d = {r.randrange(1, n_max + 1) for _ in range(r.randrange(0, 3))}
            v, w = 64.0 * (k + 1), 4.0 + r.randrange(8)
            for n in range(n_max):
                v += 16.0 * (n in steps_t)
                w += 2.0 * (n in steps_d)
                t[i, k, n], d[i, k, n] = v, w
    return treeops.CostTable([4, 64], 16, t, d, {"gpu": "test"})


@st.composite
def steps(
    draw,
    max_batch=64,
    max_vocab=40,
    max_w=4,
    max_k=4,
    max_depth=4,
    max_n=32,
    dtypes=(torch.float32, torch.bfloat16),
    flat=False,
):
    """A policy, a batch (ragged activity), and the draft logits of every layer. ``flat``: CAST
    only, with plateau cost tables (``flat_cost_table``)."""
    B = draw(st.integers(1, max_batch))
    K = draw(st.integers(1, max_k))
    W = draw(st.integers(1, max_w))
    D = draw(st.integers(1, max_depth))
    V = draw(st.integers(max(K, 2), max_vocab))
    N = draw(st.integers(max(W, 1), max_n))
    kind = "cast" if flat else draw(st.sampled_from(["eagle", "cast"]))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = random.Random(seed)
    if kind == "eagle":
        policy = treeops.EagleStatic(depth=D, topk=W, budget=N) if W == K else None
        if policy is None:  # EAGLE's frontier width equals its top-k
            K = W
            V = max(V, K)
            policy = treeops.EagleStatic(depth=D, topk=W, budget=N)
    else:
        policy = treeops.Cast(
            C1=draw(st.sampled_from([0.0, 0.03125, 0.125, 0.5, 2.0])),
            C2=draw(st.sampled_from([0.0, 0.0625, 0.25, 1.0, 64.0])),
            C3=draw(st.sampled_from([0.0, 0.001, 0.01, 0.05, 1.0])), R=draw(st.integers(1, 4)),
            cost_table=(flat_cost_table if flat else cost_table)(seed, max(N, W)), topk=K,
            max_width=W, max_depth=D, capacity=N,
        )  # fmt: skip
    ties = draw(st.booleans())
    dtype = draw(st.sampled_from(dtypes))
    g = torch.Generator().manual_seed(seed)
    if ties:  # probabilities 1/count or 0, exact everywhere: equal scores across rows and layers
        logits = torch.where(torch.rand(D, B, W, V, generator=g) < 0.3, 0.0, -1000.0)
    else:
        logits = torch.randn(D, B, W, V, generator=g) * 3
    logits = logits.to(dtype)
    active = [rng.random() < 0.85 for _ in range(B)]
    if not any(active) and rng.random() < 0.7:
        active[0] = True
    roots = [rng.randrange(V) for _ in range(B)]
    seq = [rng.randrange(0, 60) for _ in range(B)]
    return policy, logits, roots, seq, active


def start(policy, roots, seq, active, device="cpu"):
    return treeops.DraftState.new(
        policy,
        torch.tensor(roots, device=device),
        torch.tensor(seq, device=device),
        torch.tensor(active, device=device),
    )


# ------------------------------------------------------------------- reference vs brute force
def check_layer(state, brute, i):
    B = state.active.shape[0]
    W, K = brute.p.max_width, brute.p.topk
    assert int(state.widths[i]) == brute.widths[i]
    assert int(state.flags[i]) == brute.flags[i]
    for b in range(B):
        got = {}
        for slot in range(W * K):
            s = float(state.cand_scores[b, i, slot])
            if s >= 0:
                got[i * W * K + slot] = (
                    s,
                    int(state.cand_tokens[b, i, slot]),
                    int(state.cand_parents[b, i, slot]),
                )
        want = {c[0]: c[1:] for c in brute.cands[b] if c[0] // (W * K) == i}
        assert got.keys() == want.keys()
        for k in want:
            assert got[k][1:] == want[k][1:]
            assert got[k][0] == pytest.approx(want[k][0], rel=1e-6, abs=1e-30)
        f = [
            (int(state.frontier[b, r]), int(state.frontier_tokens[b, r]))
            for r in range(W)
            if float(state.frontier_scores[b, r]) >= 0
        ]
        assert f == [(idx, tok) for idx, _, tok in brute.frontier[b]]


def check_tree(tree, brute):
    n, trees = brute.emit()
    tree.validate()
    B = tree.batch_size
    for b in range(B):
        if trees[b] is None:
            assert int(tree.num_nodes[b]) == 0
            continue
        par, toks, scores = trees[b]
        m = int(tree.num_nodes[b])
        assert m == len(par)
        assert tree.parents[b, :m].tolist() == par
        assert tree.tokens[b, :m].tolist() == toks
        assert tree.scores[b, :m].tolist() == pytest.approx(scores, rel=1e-6, abs=1e-30)
    return n


@given(steps())
def test_reference_matches_brute_force(case):
    policy, logits, roots, seq, active = case
    state = start(policy, roots, seq, active)
    brute = Brute(policy, roots, seq, active)
    i = 0
    while state.wants_next_layer():
        ref.build_tree_expand(logits[i], state, policy)
        brute.expand(logits[i])
        check_layer(state, brute, i)
        i += 1
    tree = ref.build_tree_emit(state, policy)
    n = check_tree(tree, brute)
    assert int(state.verify[0]) == n


@given(steps(max_batch=8))
def test_rerank_is_ancestor_closed_rank_ordered_top_n(case):
    """Properties of the emitted tree checked on the tree alone: rank order (scores
    non-increasing in node index), every node's parent earlier, and the chosen set is exactly the
    brute-force top of all candidates (no better candidate left out)."""
    policy, logits, roots, seq, active = case
    state = start(policy, roots, seq, active)
    tree = treeops.build_tree(
        policy,
        lambda s: logits[s.layer],
        torch.tensor(roots),
        torch.tensor(seq),
        torch.tensor(active),
        state=state,
    )
    D = state.layer
    for b in range(tree.batch_size):
        m = int(tree.num_nodes[b])
        sc = tree.scores[b, :m].tolist()
        assert all(x >= y for x, y in zip(sc[:-1], sc[1:], strict=True))
        assert all(0 <= int(tree.parents[b, j]) < j for j in range(1, m))
        allc = sorted(
            (s for s in state.cand_scores[b, :D].flatten().tolist() if s >= 0), reverse=True
        )
        if m:
            assert sorted(sc[1:], reverse=True) == allc[: m - 1]
            if m - 1 < len(allc):
                assert m == int(state.verify[0])  # only a lack of candidates cuts a tree short


def test_reference_build_tree_is_the_public_loop():
    pol = treeops.Cast(
        C1=0.05, C2=0.1, C3=0.01, R=2, cost_table=cost_table(1, 16), topk=3, max_width=4,
        max_depth=5, capacity=16,
    )  # fmt: skip
    logits = torch.randn(5, 3, 4, 30, generator=torch.Generator().manual_seed(2)) * 2
    args = (torch.tensor([1, 2, 3]), torch.tensor([5, 50, 500]))
    a = ref.build_tree(pol, lambda s: logits[s.layer], *args)
    b = treeops.build_tree(pol, lambda s: logits[s.layer], *args)
    for f in ("tokens", "parents", "num_nodes", "anc", "first_child", "next_sibling", "scores"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f


def test_named_cases():
    # one node (depth 1, top-1), a chain (top-1, deep), a star (one layer, wide)
    for D, K, N in ((1, 1, 2), (6, 1, 7), (1, 8, 9), (3, 2, 16)):
        policy = treeops.EagleStatic(depth=D, topk=K, budget=N)
        g = torch.Generator().manual_seed(D * 100 + K)
        logits = torch.randn(D, 2, K, 50, generator=g)
        tree = treeops.build_tree(
            policy, lambda s, x=logits: x[s.layer], torch.tensor([3, 4]), torch.tensor([0, 9])
        )
        tree.validate()
        assert tree.num_nodes.tolist() == [min(N, 1 + K + (D - 1) * K * K)] * 2
        if K == 1:  # a chain: depth = index
            assert tree.depth[0, : int(tree.num_nodes[0])].tolist() == list(range(D + 1))


def test_ties_break_by_candidate_index():
    # every logit equal: all probabilities 1/V; candidates of layer 0 tie, lower index first
    policy = treeops.EagleStatic(depth=2, topk=2, budget=7)
    logits = torch.zeros(1, 2, 4)
    st_ = start(policy, [9], [5], [True])
    ref.build_tree_expand(logits, st_, policy)
    assert st_.cand_tokens[0, 0, :2].tolist() == [0, 1]
    assert st_.frontier.tolist() == [[0, 1]]
    ref.build_tree_expand(logits, st_, policy)
    tree = ref.build_tree_emit(st_, policy)
    # layer-0 candidates (score 1/4) first, then layer 1 in (row, rank) order (1/16 each)
    assert tree.parents[0].tolist() == [-1, 0, 0, 1, 1, 2, 2]
    assert tree.tokens[0].tolist() == [9, 0, 1, 0, 1, 0, 1]


def test_inactive_rows_draft_nothing():
    policy = treeops.EagleStatic(depth=2, topk=2, budget=5)
    logits = torch.randn(2, 3, 2, 10)
    st_ = start(policy, [1, 2, 3], [4, 5, 6], [True, False, True])
    tree = treeops.build_tree(
        policy, lambda s: logits[s.layer], st_.root_tokens, st_.seq_lens, st_.active, state=st_
    )
    assert tree.num_nodes.tolist() == [5, 0, 5]
    assert (st_.cand_scores[1] == -1).all()
    tree.validate()


def test_cast_prefers_small_trees_when_verification_is_expensive():
    cheap = treeops.CostTable.from_functions(
        lambda B, c, n: 100.0, lambda B, c, n: 1.0, [64], 1024, 1, 64
    )
    steep = treeops.CostTable.from_functions(
        lambda B, c, n: 100.0 * n, lambda B, c, n: 1.0 * n, [64], 1024, 1, 64
    )
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 8, 4, 64, generator=g) * 2
    sizes = []
    for table in (cheap, steep):
        pol = treeops.Cast(
            C1=0.05, C2=0.05, C3=0.05, R=3, cost_table=table, topk=4, max_width=4, max_depth=6,
            capacity=64,
        )  # fmt: skip
        tree = treeops.build_tree(
            pol, lambda s: logits[s.layer], torch.arange(8), torch.full((8,), 100)
        )
        tree.validate()
        sizes.append(int(tree.num_nodes.max()))
    assert sizes[0] > sizes[1] >= 1


# ------------------------------------------------------------------------------- bad input
def test_bad_input_rejected():
    pol = treeops.EagleStatic(depth=2, topk=2, budget=4)
    st_ = start(pol, [1], [2], [True])
    with pytest.raises(
        ValueError,
        match=r"Invalid shape of logits: expected \[1, 2, \*\], "
        r"got \[1, 3, 5\]",
    ):
        treeops.build_tree_expand(torch.zeros(1, 3, 5), st_, pol)
    with pytest.raises(ValueError, match=r"Invalid dtype of logits: expected one of"):
        treeops.build_tree_expand(torch.zeros(1, 2, 5, dtype=torch.int32), st_, pol)
    with pytest.raises(ValueError, match=r"expected vocabulary V >= topk = 2, got V = 1"):
        treeops.build_tree_expand(torch.zeros(1, 2, 1), st_, pol)
    with pytest.raises(ValueError, match=r"Invalid stride of logits"):
        treeops.build_tree_expand(torch.zeros(1, 5, 2).transpose(1, 2), st_, pol)
    with pytest.raises(ValueError, match=r"Invalid value in logits: expected numbers, got NaN"):
        treeops.build_tree_expand(torch.full((1, 2, 5), float("nan")), st_, pol, validate=True)
    with pytest.raises(ValueError, match=r"Invalid type of policy: expected treeops.EagleStatic"):
        treeops.build_tree_expand(torch.zeros(1, 2, 5), st_, "eagle")
    other = treeops.EagleStatic(depth=3, topk=2, budget=4)
    with pytest.raises(ValueError, match=r"Invalid shape of state.cand_scores"):
        treeops.build_tree_expand(torch.zeros(1, 2, 5), st_, other)
    with pytest.raises(ValueError, match=r"expected at least one expanded draft layer"):
        treeops.build_tree_emit(st_, pol)
    treeops.build_tree_expand(torch.zeros(1, 2, 5), st_, pol)
    treeops.build_tree_expand(torch.zeros(1, 2, 5), st_, pol)
    with pytest.raises(ValueError, match=r"all 2 draft layers already expanded"):
        treeops.build_tree_expand(torch.zeros(1, 2, 5), st_, pol)
    with pytest.raises(ValueError, match=r"Invalid shape of out.parents: expected \[1, 4\]"):
        treeops.build_tree_emit(st_, pol, out=treeops.Tree.empty(1, 8))
    with pytest.raises(ValueError, match=r"Invalid value of topk: expected a positive int, got 0"):
        treeops.EagleStatic(depth=2, topk=0, budget=4)
    small = treeops.CostTable([1], 8, torch.ones(1, 1, 8), torch.ones(1, 1, 8))
    with pytest.raises(
        ValueError,
        match=r"Invalid value of cost_table: expected n_max >= "
        r"max\(max_width, capacity\) = 64, got 8",
    ):
        treeops.Cast(C1=1, C2=1, C3=1, R=2, cost_table=small)
    with pytest.raises(ValueError, match=r"Invalid value of C2: expected a number, got nan"):
        treeops.Cast(C1=1, C2=float("nan"), C3=1, R=2, cost_table=small, capacity=8)
    with pytest.raises(ValueError, match=r"Invalid dtype of root_tokens: expected torch.int64"):
        treeops.DraftState.new(pol, torch.tensor([1], dtype=torch.int32), torch.tensor([2]))
    with pytest.raises(ValueError, match=r"Invalid shape of seq_lens: expected \[1\], got \[2\]"):
        st_.reset(torch.tensor([1]), torch.tensor([2, 3]))


def test_emit_into_out_and_reuse_state():
    pol = treeops.EagleStatic(depth=2, topk=3, budget=8)
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 2, 3, 20, generator=g)
    fn = lambda s: logits[s.layer]  # noqa: E731
    a = treeops.build_tree(pol, fn, torch.tensor([1, 2]), torch.tensor([3, 4]))
    out = treeops.Tree.empty(2, 8)
    st_ = start(pol, [7, 7], [0, 0], [False, False])
    b = treeops.build_tree(pol, fn, torch.tensor([1, 2]), torch.tensor([3, 4]), state=st_, out=out)
    assert b is out
    for f in ("tokens", "parents", "num_nodes", "depth", "anc", "first_child", "next_sibling"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert st_.verify_count() == 8 and st_.width(0) == 3 and not st_.wants_next_layer()


@pytest.mark.parametrize(
    "depth,topk,budget,width,active",
    [(3, 2, 6, None, [True, True]), (1, 4, 5, None, [True, False]), (4, 3, 9, 2, [False, False]),
     (2, 3, 20, 5, [True, True])],
)  # fmt: skip
def test_static_policy_decisions_known_on_the_host(depth, topk, budget, width, active):
    """A static policy's host answers (``width``, ``wants_next_layer``, ``verify_count``) come
    from its sizes without reading the device: at every point they equal what the build wrote
    there (widths W, flags but for the last layer, verify N: inactive requests and budgets past
    the candidates included), and nothing is copied to a pinned buffer."""
    from treeops.testing import NoHostSync

    pol = treeops.EagleStatic(depth=depth, topk=topk, budget=budget, width=width)
    st_ = start(pol, [3, 5], [4, 0], active)
    g = torch.Generator().manual_seed(depth + topk)
    assert st_.host_decisions is None and not st_.events
    for i in range(depth):
        treeops.build_tree_expand(torch.randn(2, pol.max_width, 13, generator=g), st_, pol)
        with NoHostSync():
            w, more = st_.width(i), st_.wants_next_layer()
        assert w == int(st_.decisions[i]) == pol.max_width
        assert more == bool(st_.decisions[depth + i]) == (i + 1 < depth)
    treeops.build_tree_emit(st_, pol)
    with NoHostSync():
        n = st_.verify_count()
    assert n == int(st_.verify[0]) == budget
    assert list(st_.static_decisions) == st_.decisions.tolist()


# ------------------------------------------------------- Triton kernels (interpreter) vs reference
def _kb():
    """The kernels' launchers, called on a DraftState as the public ops' CUDA branch does."""
    from treeops.build_tree import _launch_emit, _launch_expand

    return SimpleNamespace(_launch_expand=_launch_expand, _launch_emit=_launch_emit)


def compare_states(a, b, i, what=""):
    for f in ("cand_tokens", "cand_parents"):
        assert torch.equal(getattr(a, f)[:, i], getattr(b, f)[:, i]), f"{what} {f}"
    for f in ("frontier", "frontier_tokens"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f"{what} {f}"
    assert torch.equal(a.cand_scores[:, i] < 0, b.cand_scores[:, i] < 0), what
    assert_close(
        a.cand_scores[:, i].clamp(min=0),
        b.cand_scores[:, i].clamp(min=0),
        torch.float32,
        f"{what} scores",
    )
    assert torch.equal(a.frontier_scores < 0, b.frontier_scores < 0), what
    assert torch.equal(a.decisions, b.decisions), f"{what} decisions"


def run_both(
    policy, logits, roots, seq, active, block_v=None, split=1, states=None, root_row=False,
    **tuning,
):  # fmt: skip
    """The kernels and the reference from the same start, layer by layer (with ``root_row``,
    layer 0 from the root's row alone, [B, 1, V]), then the emitted trees: compared exactly
    (scores within float32 rounding)."""
    kb = _kb()
    sk = start(policy, roots, seq, active)
    if states is not None:  # the caller inspects the kernel's state too
        states.append(sk)
    sr = start(policy, roots, seq, active)
    i = 0
    while sr.wants_next_layer():
        x = logits[i][:, :1] if root_row and i == 0 else logits[i]
        kb._launch_expand(x, sk, policy, block_v=block_v, split=split, **tuning)
        sk.layer += 1
        ref.build_tree_expand(x, sr, policy)
        compare_states(sk, sr, i, f"layer {i}")
        i += 1
    tk = kb._launch_emit(sk, policy)
    tr = ref.build_tree_emit(sr, policy)
    assert torch.equal(sk.verify, sr.verify)
    for f in ("tokens", "parents", "num_nodes", "depth", "anc", "first_child", "next_sibling"):
        assert torch.equal(getattr(tk, f), getattr(tr, f)), f
    assert_close(tk.scores, tr.scores, torch.float32, "tree scores")
    tk.validate()
    return tk


@given(steps(max_batch=6, max_vocab=24, max_w=4, max_k=4, max_depth=3, max_n=16), st.booleans())
def test_kernels_match_reference(case, root_row):
    policy, logits, roots, seq, active = case
    # 1, 2 or 3 programs per row (chunks of V merged by the row's last program); layer 0 from
    # all W rows or the root's alone
    run_both(
        policy, logits, roots, seq, active, block_v=8, split=1 + logits.shape[-1] % 3,
        root_row=root_row,
    )  # fmt: skip


@given(
    steps(max_batch=3, max_vocab=40, max_w=3, max_k=5, max_depth=2, max_n=12),
    st.integers(2, 12),
    st.sampled_from([4, 8, 16]),
    st.sampled_from([1, 2, 4]),
    st.sampled_from([2, 3, "lanes"]),
    st.booleans(),
)
def test_streamed_expand_any_split_matches_reference(case, split, block_v, per_tile, ahead, early):
    """The two-launch expand (one-warp chunk programs, then one program per row merging them) at
    up to 12 chunks per row (rounded to whole tiles, so some chunks hold fewer than K logits or
    none past V), tiles that rarely divide V, K up to V, a max recorded per tile or per block of
    a tile (``max_block`` = block_v / per_tile; the last block of a chunk or of V partly or
    wholly past it), two or three tiles loaded ahead (``stream_ahead``) or the max and sum kept
    per vector (``stream_lanes``), the first tiles loaded before the row's state or after
    (``stream_early``: idle requests and unused frontier rows then stream tiles whose results
    nothing reads), the K best blocks re-read: the reference's states and tree."""
    policy, logits, roots, seq, active = case
    lanes = ahead == "lanes"
    run_both(
        policy, logits, roots, seq, active, block_v=block_v, split=split,
        max_block=block_v // per_tile, stream_ahead=2 if lanes else ahead, stream_lanes=lanes,
        stream_early=early,
    )  # fmt: skip


@pytest.mark.parametrize(
    "ahead, block_v, max_block, warps",
    [(2, 8, 8, 1), (3, 8, 8, 1), (3, 8, 2, 1), ("lanes", 8, 8, 1), ("lanes", 8, 4, 1),
     ("lanes", 32, 16, 2), ("lanes", 64, 16, 2)],
)  # fmt: skip
def test_streamed_expand_long_chunks_match_reference(ahead, block_v, max_block, warps):
    """Chunks of many tiles (V 300 in two chunks of up to 19 tiles of 8), so that every tile the
    stream loads ahead (``stream_ahead``, or two with ``stream_lanes``) is reduced in its turn;
    and per-vector statistics in two-warp programs (``num_warps``: the tile loaded vectors
    first, [2, 2, 8] or [2, 4, 8], and permuted to blocks first): the reference's states and
    tree."""
    lanes = ahead == "lanes"
    g = torch.Generator().manual_seed((5 if lanes else ahead) + max_block)
    pol = treeops.EagleStatic(depth=3, topk=3, budget=12)
    logits = (torch.randn(3, 2, 3, 300, generator=g) * 3).to(torch.bfloat16)
    run_both(
        pol, logits, [1, 2], [10, 20], [True, True], block_v=block_v, split=2,
        max_block=max_block, stream_ahead=2 if lanes else ahead, stream_lanes=lanes,
        num_warps=warps,
    )  # fmt: skip


def test_kernels_named_large_case():
    # the issue's shape family at interpreter scale: W = K = 4, depth 4, N = 32, V spanning blocks
    g = torch.Generator().manual_seed(11)
    pol = treeops.EagleStatic(depth=4, topk=4, budget=32)
    logits = (torch.randn(4, 3, 4, 300, generator=g) * 3).to(torch.bfloat16)
    run_both(pol, logits, [1, 2, 3], [10, 20, 30], [True, True, True], block_v=64, split=3)
    table = cost_table(7, 40)
    cast = treeops.Cast(
        C1=0.125, C2=0.0625, C3=0.01, R=2, cost_table=table, topk=3, max_width=5, max_depth=4,
        capacity=40,
    )  # fmt: skip
    logits = torch.randn(4, 3, 5, 300, generator=g) * 3
    run_both(cast, logits, [1, 2, 3], [10, 40, 5], [True, False, True], block_v=128)


def test_kernels_cast_depth_rule_over_thresholds():
    """CAST's depth rule reads the FIFO of utility ratios of every earlier layer (R = 3, up to 6
    layers): kernels and reference agree layer by layer over a range of C2 thresholds, so that
    some flags sit near the rule's boundary and a wrong earlier ratio flips them."""
    g = torch.Generator().manual_seed(21)
    logits = torch.randn(6, 3, 4, 120, generator=g) * 2
    for c2 in (0.0, 0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16):
        cast = treeops.Cast(
            C1=0.02, C2=c2, C3=0.01, R=3, cost_table=cost_table(9, 40), topk=3, max_width=4,
            max_depth=6, capacity=40,
        )  # fmt: skip
        run_both(cast, logits, [1, 2, 3], [10, 40, 5], [True, True, True])


def _root_row_policy(kind):
    if kind == "eagle":
        return treeops.EagleStatic(depth=3, topk=3, budget=12)
    return treeops.Cast(
        C1=0.05, C2=0.02, C3=0.01, R=2, cost_table=cost_table(3, 24), topk=3, max_width=4,
        max_depth=3, capacity=24,
    )  # fmt: skip


@pytest.mark.parametrize("split, block_v", [(1, None), (3, 16)])
@pytest.mark.parametrize("kind", ["eagle", "cast"])
def test_root_row_logits_at_layer_0_match_full_rows(kind, split, block_v):
    """Layer 0 from [B, 1, V] logits (the root's row alone, launched over B rows) gives exactly
    what [B, W, V] logits with that row first give, whatever their other rows hold: the kernels
    (one program per row, and the split stream) and the reference, every layer and the tree."""
    g = torch.Generator().manual_seed(5)
    pol = _root_row_policy(kind)
    B, W, V = 3, pol.max_width, 200
    logits = (torch.randn(pol.max_depth, B, W, V, generator=g) * 3).to(torch.bfloat16)
    roots, seq, active = [4, 5, 6], [10, 300, 20], [True, False, True]
    kb = _kb()
    sk, sr, sf = (start(pol, roots, seq, active) for _ in range(3))
    for state in (sk, sr, sf):  # candidates left from another step: every slot is rewritten
        state.cand_scores.fill_(0.5)
        state.cand_tokens.fill_(7)
        state.cand_parents.fill_(3)
    i = 0
    while sf.wants_next_layer():
        x = logits[i][:, :1] if i == 0 else logits[i]
        kb._launch_expand(x, sk, pol, block_v=block_v, split=split)
        sk.layer += 1
        ref.build_tree_expand(x, sr, pol)
        ref.build_tree_expand(logits[i], sf, pol)
        compare_states(sk, sf, i, f"kernel, layer {i}")
        compare_states(sr, sf, i, f"reference, layer {i}")
        i += 1
    tk, tf = kb._launch_emit(sk, pol), ref.build_tree_emit(sf, pol)
    for f in ("tokens", "parents", "num_nodes", "depth", "anc"):
        assert torch.equal(getattr(tk, f), getattr(tf, f)), f


def test_root_row_logits_only_at_layer_0():
    """The public op takes [B, 1, V] at layer 0 and refuses it later, naming the argument."""
    pol = treeops.EagleStatic(depth=2, topk=2, budget=4)
    st_ = start(pol, [1], [2], [True])
    treeops.build_tree_expand(torch.tensor([[[0.0, 2.0, 1.0]]]), st_, pol)
    assert st_.frontier_tokens.tolist() == [[1, 2]]
    with pytest.raises(
        ValueError,
        match=r"Invalid shape of logits: expected 2 rows a request at layer 1 \(one row, the "
        r"root's, only at layer 0\), got 1",
    ):
        treeops.build_tree_expand(torch.zeros(1, 1, 3), st_, pol)


def test_kernels_negative_seq_lens_price_bucket_0():
    """seq_lens < 0 (not checked by the public API): the CAST kernels clamp the context at 0
    before bucketing, as CostTable.bucket does, instead of indexing before TAB_T / TAB_D."""
    g = torch.Generator().manual_seed(13)
    cast = treeops.Cast(
        C1=0.125, C2=0.0625, C3=0.01, R=2, cost_table=cost_table(7, 40), topk=3, max_width=5,
        max_depth=4, capacity=40,
    )  # fmt: skip
    logits = torch.randn(4, 4, 5, 300, generator=g) * 3
    # B = 4 (no padding lanes), all active: the batch context is the max, -3, then -3 + widths
    run_both(cast, logits, [1, 2, 3, 4], [-50, -7, -1000, -3], [True] * 4, block_v=128)
    run_both(cast, logits, [1, 2, 3, 4], [-(2**30)] * 4, [True] * 4, block_v=128)


def linear_cast(W, K, lam, delta, C1, B):
    """A CAST policy whose width costs are exactly c_k = lam * k + delta (S_T[1] = 64)."""
    n_max = 16
    t = torch.full((1, 1, n_max), 64.0, dtype=torch.float64)
    d = torch.tensor(
        [[[64.0 * (lam * k + delta) for k in range(1, n_max + 1)]]], dtype=torch.float64
    )
    table = treeops.CostTable([B], 1024, t, d)
    return treeops.Cast(
        C1=C1, C2=0.0, C3=0.0, R=2, cost_table=table, topk=K, max_width=W, max_depth=2, capacity=16
    )


def dyadic_layer(B, W, K, V, rng):
    """Frontier scores (multiples of 1/16, descending) and logits whose rows have 1, 2 or 4 zeros
    and -1000 elsewhere: every candidate score is dyadic, so the batch means are exact."""
    fs = torch.tensor(
        [sorted((rng.randrange(1, 17) / 16 for _ in range(W)), reverse=True) for _ in range(B)]
    )
    logits = torch.full((B, W, V), -1000.0)
    for b in range(B):
        for r in range(W):
            for t in rng.sample(range(V), rng.choice([1, 2, 4])):
                logits[b, r, t] = 0.0
    return fs, logits


def expand_with(impl, policy, fs, logits):
    B, W = fs.shape
    st_ = start(policy, [0] * B, [0] * B, [True] * B)
    st_.frontier_scores.copy_(fs)  # a frontier of W nodes (all children of the root)
    if impl == "kernel":
        _kb()._launch_expand(logits, st_, policy, block_v=8)
    else:
        ref.build_tree_expand(logits, st_, policy)
    return st_


@given(st.data())
def test_kernel_theorem_4_1(data):
    rng = random.Random(data.draw(st.integers(0, 2**31 - 1)))
    B = data.draw(st.sampled_from([1, 2, 3, 4]))
    W, K, V = 4, 4, 12
    fs, logits = dyadic_layer(B, W, K, V, rng)
    ref_state = expand_with("reference", linear_cast(W, K, 1.0, 0.0, 1.0, B), fs, logits)
    scores = ref_state.cand_scores[:, 0].clamp(min=0)
    srt = torch.sort(scores, dim=1, descending=True).values
    k = data.draw(st.integers(1, W - 1))
    lam = data.draw(st.sampled_from([0.125, 0.25, 1.0]))
    delta = data.draw(st.sampled_from([0.0, 0.5, 3.0]))
    vk, vk1 = float(srt[:, k - 1].sum()), float(srt[:, k].sum())
    C1 = vk / (B * lam)
    # The theorem is about exact numbers: with B = 3 keep the draws whose C1 is exact in fp32
    # (the kernel takes C1 as fp32), so that "width = K" must hold to the last bit.
    exact = Fraction(float(np.float32(C1))) * B * Fraction(lam) == Fraction(vk)
    if not exact:
        return
    pol = linear_cast(W, K, lam, delta, C1, B)
    for impl in ("kernel", "reference"):
        n = int(expand_with(impl, pol, fs, logits).widths[0])
        assert n == k if vk1 < vk else n > k, (impl, n, k, vk, vk1)


def test_kernel_raising_C1_or_draft_costs_never_widens():
    rng = random.Random(5)
    B, W, K, V = 4, 4, 3, 16
    g = torch.Generator().manual_seed(5)
    fs, _ = dyadic_layer(B, W, K, V, rng)
    logits = torch.randn(B, W, V, generator=g) * 2
    widths = [
        int(expand_with("kernel", linear_cast(W, K, 0.25, 0.5, C1, B), fs, logits).widths[0])
        for C1 in (0.0, 0.1, 0.3, 0.6, 1.2, 4.0)
    ]
    assert widths == sorted(widths, reverse=True) and widths[0] == W and widths[-1] == 1
    widths = [
        int(
            expand_with("kernel", linear_cast(W, K, 0.25 * f, 0.5 * f, 0.3, B), fs, logits).widths[
                0
            ]
        )
        for f in (0.5, 1.0, 2.0, 4.0, 16.0)
    ]
    assert widths == sorted(widths, reverse=True)


def test_kernels_issue_extremes():
    """The issue's limits at interpreter cost: B = 64 (small trees), and top-k 10 / depth 10 /
    N = 128 (few requests); CAST with ties in the second."""
    g = torch.Generator().manual_seed(13)
    pol = treeops.EagleStatic(depth=2, topk=2, budget=5)
    logits = torch.randn(2, 64, 2, 16, generator=g) * 3
    active = [b % 7 != 3 for b in range(64)]
    run_both(pol, logits, list(range(64)), [b * 3 for b in range(64)], active, block_v=16)
    cast = treeops.Cast(
        C1=0.01, C2=0.0, C3=0.001, R=3, cost_table=cost_table(3, 128), topk=10, max_width=10,
        max_depth=10, capacity=128,
    )  # fmt: skip
    logits = torch.where(torch.rand(10, 2, 10, 40, generator=g) < 0.06, 0.0, -1000.0)
    run_both(cast, logits, [5, 6], [17, 40], [True, True], block_v=32)


# ------------------------------------------------ issue #4: CAST's k capped at what exists
def _flat_cast(W, K, D, N, C1=1.0, C2=0.0, C3=0.5):
    table = treeops.CostTable.from_functions(
        lambda B, c, n: 64.0, lambda B, c, n: 8.0, [1, 8], 1024, 1, max(W, N)
    )
    return treeops.Cast(
        C1=C1, C2=C2, C3=C3, R=2, cost_table=table, topk=K, max_width=W, max_depth=D, capacity=N
    )


def _check_caps(state, tree):
    """CAST (issue #4): every width = the most valid frontier rows of an active request after
    that layer (at least 1), and the verify count = max(num_nodes) (1 with none active)."""
    act = state.active.cpu()
    W, K = state.frontier.shape[1], state.cand_scores.shape[2] // state.frontier.shape[1]
    for i in range(state.layer):
        sc = state.cand_scores[:, i].cpu()
        rows = torch.sort(sc, dim=1, descending=True).values[:, :W] >= 0  # [B, W] fillable
        have = int((rows & act[:, None]).sum(1).max()) if bool(act.any()) else 0
        assert 1 <= int(state.widths[i]) <= max(have, 1), (i, state.widths.tolist(), have)
        if have and i + 1 < state.layer:
            # the frontier the next layer expanded had exactly width(i) rows in its widest request
            nxt = state.cand_scores[:, i + 1].cpu().view(-1, W, K)[..., 0] >= 0
            assert int((nxt & act[:, None]).sum(1).max()) == int(state.widths[i])
    nodes = tree.num_nodes.cpu()
    assert int(state.verify[0]) == (int(nodes.max()) if bool(act.any()) else 1)


def test_issue_4_reviewer_examples():
    """Flat costs, B = 1, W = 4, K = 2, N = 16: layer 0 has 2 candidates (the root's top-2), so
    the width is 2 (was 4); layer 1 has 4; the tree has 7 nodes, so the verify count is 7 (was
    16). Reference and kernel (interpreter) both."""
    pol = _flat_cast(W=4, K=2, D=2, N=16)
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 1, 4, 20, generator=g)
    for impl in ("reference", "kernel"):
        st_ = start(pol, [3], [100], [True])
        for i in range(2):
            if impl == "kernel":
                _kb()._launch_expand(logits[i], st_, pol, block_v=8)
                st_.layer += 1
            else:
                ref.build_tree_expand(logits[i], st_, pol)
        tree = _kb()._launch_emit(st_, pol) if impl == "kernel" else ref.build_tree_emit(st_, pol)
        assert st_.widths.tolist() == [2, 4], impl
        assert int(tree.num_nodes[0]) == 7, impl
        assert int(st_.verify[0]) == 7 and st_.verify_count() == 7, impl
        assert st_.width(0) == 2, impl  # the host view of the decisions carries the cap
        _check_caps(st_, tree)


def test_issue_4_public_loop_and_inactive():
    """The public loop on CPU, a ragged batch and an all-inactive batch (width 1, verify 1)."""
    pol = _flat_cast(W=4, K=3, D=3, N=16, C1=0.0, C3=0.0)
    g = torch.Generator().manual_seed(8)
    logits = torch.where(torch.rand(3, 3, 4, 12, generator=g) < 0.15, 0.0, -1000.0)
    for active in ([True, False, True], [False, False, False]):
        st_ = start(pol, [1, 2, 3], [5, 6, 7], active)
        tree = treeops.build_tree(
            pol, lambda s: logits[s.layer], st_.root_tokens, st_.seq_lens, st_.active, state=st_
        )
        _check_caps(st_, tree)
        if not any(active):
            assert st_.widths[: st_.layer].tolist() == [1] * st_.layer
            assert st_.verify_count() == 1


@given(steps(max_batch=6, max_vocab=24, max_w=4, max_k=4, max_depth=3, max_n=16, flat=True))
def test_cast_caps_on_plateau_costs_kernel_and_reference(case):
    """Property (issue #4) on plateau cost tables: width <= the candidates that exist and verify
    count <= the nodes that exist, for the kernels (interpreter) and the reference, which agree
    exactly (``run_both``); the reference also matches the capped brute force."""
    policy, logits, roots, seq, active = case
    sks: list = []
    split = 1 + logits.shape[-1] % 3
    tk = run_both(policy, logits, roots, seq, active, block_v=8, split=split, states=sks)
    _check_caps(sks[0], tk)
    sr = start(policy, roots, seq, active)
    brute = Brute(policy, roots, seq, active)
    i = 0
    while sr.wants_next_layer():
        ref.build_tree_expand(logits[i], sr, policy)
        brute.expand(logits[i])
        check_layer(sr, brute, i)
        i += 1
    tr = ref.build_tree_emit(sr, policy)
    assert int(sr.verify[0]) == check_tree(tr, brute)
    _check_caps(sr, tr)


def test_draft_state_to_is_an_independent_copy():
    """``DraftState.to`` clones every tensor (workspace included) and drops the pinned decision
    buffer: expanding the copy leaves the original untouched, and both expand alike."""
    pol = treeops.EagleStatic(depth=3, topk=2, budget=6)
    st = start(pol, [3, 5], [4, 0], [True, True])
    logits = torch.randn(2, pol.max_width, 11)
    c = st.to("cpu")
    before = st.cand_scores.clone()
    treeops.build_tree_expand(logits, c, pol)
    assert torch.equal(st.cand_scores, before) and c.host_decisions is None and not c.events
    treeops.build_tree_expand(logits, st, pol)
    for f in ("cand_scores", "cand_tokens", "cand_parents", "frontier", "decisions"):
        assert torch.equal(getattr(st, f), getattr(c, f)), f


# ------------------------------------------------------------------ torch.ops.treeops (opcheck)
def _expand_args(logits, st_, pol):
    """``treeops::build_tree_expand``'s arguments for one draft layer of ``st_``."""
    cast = (None, None, 0.0, 0.0, 1, 1)
    if pol.is_cast:
        tt, dd = pol.cost_table.device_tables(st_.active.shape[0], "cpu")
        cast = (tt, dd, float(pol.C1), float(pol.C2), pol.R, pol.cost_table.L)
    ws = st_.workspace
    return (
        logits, st_.layer, pol.topk, st_.active, st_.seq_lens, st_.frontier, st_.frontier_tokens,
        st_.frontier_scores, st_.cand_tokens, st_.cand_scores, st_.cand_parents, st_.decisions,
        st_.u_hist, ws["counters"], ws["cum"], None, None, None, *cast,
    )  # fmt: skip


def _emit_args(st_, pol, out):
    """``treeops::build_tree_emit``'s arguments, writing into ``out``."""
    cast = (None, 0.0, 1)
    if pol.is_cast:
        tt, _ = pol.cost_table.device_tables(st_.active.shape[0], "cpu")
        cast = (tt, float(pol.C3), pol.cost_table.L)
    ws = st_.workspace
    return (
        st_.layer, st_.active, st_.seq_lens, st_.root_tokens, st_.cand_tokens, st_.cand_scores,
        st_.cand_parents, st_.decisions, ws["sel"], ws["pos"], ws["cum"], *cast, *out.tensors(),
    )  # fmt: skip


@pytest.mark.parametrize("kind", ["eagle", "cast"])
def test_opcheck_build_tree_ops(kind):
    """``torch.library.opcheck`` of expand (first and second layer) and emit on CPU: two
    requests (one inactive in the CAST case), V = 50; the schemas declare every buffer written."""
    V = 50
    if kind == "eagle":
        pol = treeops.EagleStatic(depth=3, topk=3, budget=8)
        active = [True, True]
    else:
        pol = treeops.Cast(C1=0.125, C2=0.0625, C3=0.01, R=2, cost_table=cost_table(3, 16),
                           topk=3, max_width=4, max_depth=3, capacity=16)  # fmt: skip
        active = [True, False]
    st_ = start(pol, [4, 9], [17, 40], active)
    g = torch.Generator().manual_seed(11)
    for _ in range(2):
        logits = torch.randn(2, pol.max_width, V, generator=g) * 3
        res = torch.library.opcheck(
            torch.ops.treeops.build_tree_expand.default, _expand_args(logits, st_, pol)
        )
        assert set(res.values()) == {"SUCCESS"}, res
        treeops.build_tree_expand(logits, st_, pol)  # the next layer's state
    out = treeops.Tree.empty(2, pol.capacity)
    res = torch.library.opcheck(
        torch.ops.treeops.build_tree_emit.default, _emit_args(st_, pol, out)
    )
    assert set(res.values()) == {"SUCCESS"}, res
    # opcheck runs on copies; called directly, the op writes the reference's tree into out
    torch.ops.treeops.build_tree_emit.default(*_emit_args(st_, pol, out))
    tree = ref.build_tree_emit(st_.to("cpu"), pol)
    tree.validate()
    for f in treeops.Tree.FIELDS:
        assert torch.equal(getattr(out, f), getattr(tree, f)), f


def test_expand_op_split_workspace_is_the_launchers(monkeypatch):
    """The public expand sizes the split-V buffers (op arguments) as the launcher would: with a
    pretend GPU split of 3, ``_split_workspace`` builds the buffers ``_launch_expand`` builds."""
    tb = importlib.import_module("treeops.build_tree")  # treeops.build_tree is the function

    monkeypatch.setattr(tb._tiling, "_default_split", lambda rows, V, block_v, dev: 3)
    pol = treeops.EagleStatic(depth=2, topk=3, budget=6)
    logits = torch.randn(2, 3, 600)  # 3 chunks of one 256-token tile (the interpreter's)
    a, b = start(pol, [1, 2], [3, 4], [True, True]), start(pol, [1, 2], [3, 4], [True, True])
    got = tb._split_workspace(logits, a, pol.topk)
    tb._launch_expand(logits, b, pol)
    assert b.workspace["part_m"].numel() == 2 * 3 * 3  # B x W x split
    for name, t in zip(("part_m", "part_s", "part_t"), got, strict=True):
        assert t is a.workspace[name] and t.shape == b.workspace[name].shape, name
    # B x W rows, a max per 16-token block (expand_max_block: at most 256 blocks, >= 16 tokens)
    assert b.workspace["part_t"].shape == (2 * 3 * 38,)
    assert tb._split_workspace(logits, a, pol.topk)[1] is got[1]  # reused, not rebuilt
    # the op takes them (the CPU backend, the reference, leaves them alone)
    args = list(_expand_args(logits, a, pol))
    args[15:18] = got
    res = torch.library.opcheck(torch.ops.treeops.build_tree_expand.default, tuple(args))
    assert set(res.values()) == {"SUCCESS"}, res
    c = start(pol, [1, 2], [3, 4], [True, True])
    treeops.build_tree_expand(logits, a, pol)
    ref.build_tree_expand(logits, c, pol)
    for f in ("frontier", "frontier_tokens", "cand_tokens", "cand_parents", "decisions"):
        assert torch.equal(getattr(a, f), getattr(c, f)), f


@pytest.mark.parametrize(
    "cand_cap, cand_tiles, block_v, topks",
    [(32, 1, 16, ()), (64, 2, 16, ()), (16, 4, 16, ()), (0, 2, 16, ()), (32, 16, 16, ()),
     (32, 4, 64, ()), (0, 1, 64, ()), (32, 4, 16, ("blocks_topk", "rank_topk")),
     (16, 1, 64, ("blocks_topk",)), (64, 2, 16, ("rank_topk",)), (32, 4, 16, ("defaults",)),
     (32, 1, 16, ("cand_ahead",)), (32, 2, 64, ("cand_ahead", "blocks_topk", "rank_topk"))],
)  # fmt: skip
def test_streamed_expand_ranked_candidates_match_reference(cand_cap, cand_tiles, block_v, topks):
    """The split expand's top-K at a realistic tile count (V / block_v = 94 tiles): the logits
    of the K best tiles at or above the K-th tile's max ranked at once, read one, two, four or
    all K (16, clamped to pow2(K)) tiles at a time; rows with many equal logits (more
    candidates than ``cand_cap``: the tile-by-tile merge), a row of one value, a row whose best
    values share one tile; ``cand_cap`` = 0: always the merge; 64-token tiles streamed with a
    max per 16-token block (``max_block``); the K best blocks and the ranked candidates also by
    one ``tl.topk`` each (``blocks_topk``, ``rank_topk``; off unless named), and the launcher's
    defaults for them (``defaults``); each read of the candidates' tiles issued one ahead
    (``cand_ahead``). Each the reference's states and tree."""
    g = torch.Generator().manual_seed(17)
    pol = treeops.EagleStatic(depth=2, topk=5, budget=20)
    D, B, W, V = 2, 2, pol.max_width, 1500
    logits = torch.randn(D, B, W, V, generator=g) * 3
    logits[0, 0, 1] = (logits[0, 0, 1] * 2).round() / 2  # many ties across tiles
    logits[0, 1, 0] = 0.25  # one value: every logit a candidate
    logits[1, 0, 0, 640:656] += 30.0  # the row's best 16 in one tile
    logits[1, 1] = (logits[1, 1] * 4).round() / 4
    kw = {} if "defaults" in topks else {k: k in topks for k in ("blocks_topk", "rank_topk")}
    kw["cand_ahead"] = "cand_ahead" in topks
    run_both(
        pol, logits, [1, 2], [5, 6], [True, True], block_v=block_v, split=4, cand_cap=cand_cap,
        cand_tiles=cand_tiles, max_block=16, **kw,
    )  # fmt: skip


def test_expand_launcher_refuses_logits_rows_other_than_w_or_1():
    """The launcher itself (below the public op's checks) takes W logits rows a request or the
    root's one: any other count is refused naming logits, before a kernel indexes the frontier
    with it."""
    pol = treeops.EagleStatic(depth=1, topk=2, budget=4, width=3)
    st = start(pol, [1], [5], [True])
    with pytest.raises(
        ValueError,
        match=r"Invalid shape of logits: expected 3 rows a request, or 1 \(the root's\), got 2",
    ):
        _kb()._launch_expand(torch.randn(1, 2, 40), st, pol)


@pytest.mark.parametrize(
    "tuning, message",
    [
        (dict(cand_cap=24), "cand_cap must be 0 or a power of two >= 16, got 24"),
        (dict(cand_cap=8), "cand_cap must be 0 or a power of two >= 16, got 8"),
        (dict(cand_tiles=3), "cand_tiles must be a power of two, got 3"),
        (dict(cand_tiles=0), "cand_tiles must be a power of two, got 0"),
        (dict(max_block=3), r"max_block must be a power of two <= block_v \(64\): 3"),
        (dict(max_block=128), r"max_block must be a power of two <= block_v \(64\): 128"),
        (dict(row_warps=3), "row_warps must be 1, 2, 4, 8 or 16, got 3"),
        (dict(stream_ahead=4), "stream_ahead must be 2 or 3, got 4"),
    ],
)
def test_expand_launcher_refuses_bad_top_k_tuning(tuning, message):
    """The expand launcher's top-K knobs name the argument instead of failing in the kernel."""
    pol = treeops.EagleStatic(depth=1, topk=2, budget=4)
    st = start(pol, [1], [5], [True])
    with pytest.raises(ValueError, match=message):
        _kb()._launch_expand(torch.randn(1, pol.max_width, 40), st, pol, split=2, **tuning)


@pytest.mark.parametrize("split, block_v", [(1, 4), (3, 4), (5, 8), (12, 4)])
def test_streamed_expand_masked_vocab_matches_reference(split, block_v):
    """Draft logits masked to -inf outside a few tokens (a vocabulary restricted by the engine),
    fewer finite logits than K in some rows, equal finite values in different tiles: the tiles
    the top-K pass reads (the K with the largest maxima, the lower tile on ties) still hold
    every top-K element, -inf ones included, and the result is the reference's."""
    g = torch.Generator().manual_seed(5)
    pol = treeops.EagleStatic(depth=2, topk=4, budget=10)
    D, B, W, V = 2, 3, pol.max_width, 37
    logits = torch.full((D, B, W, V), float("-inf"))
    keep = torch.rand(D, B, W, V, generator=g) < 0.08
    logits[keep] = torch.randint(-2, 2, (int(keep.sum()),), generator=g).float()
    logits[0, 0, :, 33] = 1.0  # the same best value in the first and last tiles
    logits[0, 0, :, 2] = 1.0
    run_both(pol, logits, [1, 2, 3], [5, 6, 7], [True, True, True], block_v=block_v, split=split)


@pytest.mark.parametrize(
    ("rows", "V", "want"),
    [
        (10, 32000, (1024, 32, 2)),  # B 1: one-warp programs would each stream one tile
        (1, 32000, (1024, 32, 2)),  # the root's row alone
        (80, 32000, (512, 32, 1)),  # B 8: two 512-token tiles a program
        (640, 32000, (512, 6, 1)),  # B 64: 32 one-warp programs an SM
        (10, 128256, (512, 63, 1)),  # V 128,256: the split cap (64) leaves four tiles a program
    ],
)
def test_expand_tiling_takes_two_warp_tiles_where_one_warp_streams_one_tile(
    monkeypatch, rows, V, want
):
    """The compiled launcher's default tiling on a 132-SM GPU (the H100's and H200's count):
    1,024-token tiles over two-warp programs exactly where one-warp programs of 512-token tiles
    would each stream a single tile; elsewhere one warp and 512."""
    kt = importlib.import_module("treeops.kernels.build_tree_tiling")
    monkeypatch.setattr(kt, "interpreted", lambda: False)
    monkeypatch.setattr(kt._runtime, "sm_count", lambda device: 132)
    block_v, split = kt.expand_tiling(rows, V, torch.device("cuda"))
    assert (block_v, split, kt.stream_warps(block_v)) == want
    # an explicit tile or split keeps the caller's choice
    assert kt.expand_tiling(rows, V, torch.device("cuda"), block_v=512)[0] == 512
    assert kt.expand_tiling(rows, V, torch.device("cuda"), split=8)[0] == 512


def test_early_tile_loads_only_in_launches_of_at_most_4_mib_of_logits():
    """The streams load their first tiles before their row's state only where the bytes of rows
    nobody uses stay small: B 1 (10 rows) at V 32,000 and 128,256 in bf16, not B 8 or B 64."""
    kt = importlib.import_module("treeops.kernels.build_tree_tiling")
    assert kt.early_tile_loads(10, 32000, 2) and kt.early_tile_loads(10, 128256, 2)
    assert kt.early_tile_loads(64, 32000, 2)  # the root-row launch at B 64: 4.1 MB
    assert not kt.early_tile_loads(80, 32000, 2) and not kt.early_tile_loads(640, 32000, 2)
    assert not kt.early_tile_loads(10, 128256, 4)  # fp32 logits: 5.1 MB

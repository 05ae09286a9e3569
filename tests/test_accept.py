"""Acceptance (docs/design.md op 7): reference and Triton kernel (interpreted) against independent
computations -- a brute-force longest matching path for greedy, exact losslessness by the
interval-midpoint test for sampling, and kernel == reference on random uniforms."""

from __future__ import annotations

import itertools
import math
import os
import random

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

import treeops
from helpers import small_step, tree_from_lists
from strategies import logits_like, make_tree, parents_of, trees
from treeops.kernels.accept import accept_launch
from treeops.kernels.accept_stats import _count_search, _key
from treeops.reference import accept as ref

# interpreter noise: -inf - -inf in masked lanes, NumPy's scalar-conversion deprecation
pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") != "1",
        reason="CPU tensors need the Triton interpreter; on a GPU run tests/test_accept_gpu.py",
    ),
]


# ----------------------------------------------------------------------------- independent models
def probs_indep(x: list[float], T: float, k: int, p: float) -> list[float]:
    """docs/design.md op 7's target distribution, written independently of reference/accept.py."""
    V = len(x)
    if T == 0:
        best = min(range(V), key=lambda t: (-x[t], t))
        return [1.0 if t == best else 0.0 for t in range(V)]
    mx = max(x)
    w = [math.exp((xi - mx) / T) for xi in x]
    order = sorted(range(V), key=lambda t: (-x[t], t))
    keep = order[:k] if 0 < k < V else order
    if p < 1:
        zk = sum(w[t] for t in keep)
        c = 0.0
        for j, t in enumerate(keep):
            c += w[t]
            if c >= p * zk:
                keep = keep[: j + 1]
                break
    z = sum(w[t] for t in keep)
    ks = set(keep)
    return [w[t] / z if t in ks else 0.0 for t in range(V)]


def children(par: list[int], n: int, i: int) -> list[int]:
    return [j for j in range(1, n) if par[j] == i]


def brute_greedy_path(par: list[int], tok: list[int], n: int, am: list[int]) -> list[int]:
    """Deepest node whose every edge from the root carries the argmax of its parent; its path."""
    best = [0]
    for j in range(n):
        path = [j]
        while path[-1] != 0:
            path.append(par[path[-1]])
        path.reverse()
        if all(tok[c] == am[a] for a, c in zip(path, path[1:])) and len(path) > len(best):
            best = path
    return best


def emitted_of(res, tree, b: int) -> list[int]:
    L = int(res.accept_len[b])
    acc = res.accepted[b].tolist()
    return [int(tree.tokens[b, a]) for a in acc[1:L]] + ([int(res.bonus[b])] if L else [])


def run_kernel(tree, logits, sample=None, **kw):
    if sample is None:
        return accept_launch(tree, logits, **kw)
    T, k, p, u = sample
    return accept_launch(tree, logits, temperature=T, top_k=k, top_p=p, uniforms=u, **kw)


def assert_same(a, b, lp_tol=1e-5):
    for f in ("accepted", "accept_len", "bonus", "topk"):
        x, y = getattr(a, f), getattr(b, f)
        assert (x is None) == (y is None), f
        if x is not None:
            assert torch.equal(x, y), f"{f}: {x.tolist()} != {y.tolist()}"
    if a.logprobs is not None:
        assert torch.allclose(a.logprobs, b.logprobs, atol=lp_tol, rtol=0), (
            f"logprobs {a.logprobs.tolist()} != {b.logprobs.tolist()}"
        )


def biased_logits(tree, V: int, rng: random.Random, ties: bool, dtype=torch.float32, boost=None):
    """Logits that follow the tree often: at most nodes one child's token gets the top value."""
    B, N = tree.parents.shape
    lg = logits_like((B, N, V), rng, ties=ties).to(torch.float32)
    for b in range(B):
        n = int(tree.num_nodes[b])
        par = tree.parents[b].tolist()
        for i in range(n):
            kids = children(par, n, i)
            if kids and rng.random() < 0.75:
                t = int(tree.tokens[b, rng.choice(kids)])
                lg[b, i, t] = float(lg[b, i].max()) + (
                    boost if boost is not None else (0.0 if ties else 1.0)
                )
    return lg.to(dtype)


# ---------------------------------------------------------------------------------- greedy
@given(
    case=trees(max_batch=3, capacities=(1, 4, 8, 16), vocab=24),
    seed=st.integers(0, 2**20),
    ties=st.booleans(),
    splits=st.sampled_from([1, 2, 3]),
    block=st.sampled_from([8, 16]),
    phase=st.sampled_from([0, 1]),
    ahead=st.sampled_from([1, 2]),
)
def test_greedy_brute_force(case, seed, ties, splits, block, phase, ahead):
    """``ahead`` 2: pass 1 loads each block before reducing the one before it (the load past a
    split's last block masked off)."""
    rng = random.Random(seed)
    tree, V = case.tree, case.vocab
    lg = biased_logits(tree, V, rng, ties)
    want_ref = ref.accept_greedy(tree, lg, return_logprobs=True, topk_ids=3)
    got = run_kernel(
        tree, lg, return_logprobs=True, topk_ids=3, num_splits=splits, block_v=block,
        phase=phase, ahead=ahead,
    )  # fmt: skip
    for res in (want_ref, got):
        for b in range(tree.batch_size):
            n = int(tree.num_nodes[b])
            if n == 0:
                assert int(res.accept_len[b]) == 0 and int(res.bonus[b]) == -1
                assert res.accepted[b].tolist() == [-1] * tree.capacity
                assert res.topk[b].tolist() == [[-1] * 3] * tree.capacity
                continue
            x = lg[b].double()
            am = [min(range(V), key=lambda t, i=i: (-float(x[i, t]), t)) for i in range(n)]
            path = brute_greedy_path(tree.parents[b].tolist(), tree.tokens[b].tolist(), n, am)
            L = len(path)
            assert res.accept_len[b] == L
            assert res.accepted[b].tolist() == path + [-1] * (tree.capacity - L)
            assert int(res.bonus[b]) == am[path[-1]]
            lsm = torch.log_softmax(x, -1)
            em = emitted_of(res, tree, b)
            want_lp = [float(lsm[path[q], em[q]]) for q in range(L)]
            assert res.logprobs[b, :L].tolist() == pytest.approx(want_lp, abs=1e-5)
            assert res.logprobs[b, L:].abs().sum() == 0
            for i in range(tree.capacity):
                want = (
                    sorted(range(V), key=lambda t, i=i: (-float(x[i, t]), t))[:3]
                    if i < n
                    else [-1] * 3
                )
                assert res.topk[b, i].tolist() == want
    assert_same(got, want_ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_greedy_dtypes_and_strides(dtype):
    rng = random.Random(3)
    rows = [parents_of("random", 12, rng), parents_of("chain", 16, rng), [-1], []]
    tree = make_tree(rows, 16, 50, rng)
    base = biased_logits(tree, 50, rng, ties=False, dtype=dtype)
    # a non-contiguous view: every other vocabulary entry of a wider buffer
    wide = torch.zeros(4, 16, 100, dtype=dtype)
    wide[:, :, ::2] = base
    lg = wide[:, :, ::2]
    assert not lg.is_contiguous()
    want = ref.accept_greedy(tree, lg, return_logprobs=True, topk_ids=5)
    got = run_kernel(tree, lg, return_logprobs=True, topk_ids=5, num_splits=2, block_v=16)
    assert_same(got, want, lp_tol=1e-4)


@pytest.mark.parametrize("seed", range(3))
def test_greedy_topk_ids_with_masked_vocab_and_ties(seed):
    """The fused top-K of greedy acceptance where splits hold fewer than K finite logits (most
    of the vocabulary -inf, rounded logits tying): ids equal the reference's, ties to the lower
    id, -inf entries ranked like any value, every split and block size."""
    rng = random.Random(seed)
    for _ in range(8):
        B, N, V = rng.randint(1, 3), rng.choice([1, 3, 5]), rng.choice([5, 9, 24, 40])
        parents = [[-1] + [rng.randrange(i) for i in range(1, rng.randint(1, N))] for _ in range(B)]
        tree = make_tree(parents, N, V, rng, ties=True)
        g = torch.Generator().manual_seed(rng.randrange(2**31))
        lg = torch.randn(B, N, V, generator=g).round()
        lg[torch.rand(B, N, V, generator=g) < rng.choice([0.0, 0.5, 0.9, 1.0])] = float("-inf")
        K = rng.randint(1, min(8, V))
        want = ref.accept_greedy(tree, lg, topk_ids=K)
        got = run_kernel(tree, lg, topk_ids=K, num_splits=rng.choice([1, 2, 3, 4]),
                         block_v=rng.choice([2, 4, 8, 16]))  # fmt: skip
        assert_same(want, got)


def test_greedy_large_vocab_named_case():
    """One larger case: V = 4099 (not a power of two), several blocks and splits."""
    rng = random.Random(5)
    rows = [parents_of("binary", 15, rng), parents_of("random", 9, rng)]
    tree = make_tree(rows, 16, 4099, rng)
    lg = biased_logits(tree, 4099, rng, ties=False, dtype=torch.bfloat16, boost=2.0)
    want = ref.accept_greedy(tree, lg, return_logprobs=True, topk_ids=4)
    got = run_kernel(tree, lg, return_logprobs=True, topk_ids=4, num_splits=2, block_v=1024)
    assert_same(got, want, lp_tol=1e-4)
    assert int(want.accept_len.max()) >= 2


def test_public_ops_dispatch_to_reference_on_cpu():
    rng = random.Random(0)
    tree = make_tree([parents_of("random", 8, rng)], 8, 16, rng)
    lg = biased_logits(tree, 16, rng, ties=True)
    assert_same(
        treeops.accept_greedy(tree, lg, topk_ids=2), ref.accept_greedy(tree, lg, topk_ids=2)
    )


# ------------------------------------------------------------------------ stop ids and budgets
def chain_case():
    # chain 0-1-2-3-4 with tokens 10..14; the target agrees with every edge, bonus 7
    tree = tree_from_lists(
        [[-1, 0, 1, 2, 3], [-1, 0, 1, 2, 3], [-1, 0, 1, 2, 3], []],
        [[10, 11, 12, 13, 14]] * 3 + [[]],
        capacity=6,
    )
    lg = torch.zeros(4, 6, 16)
    for i, t in enumerate([11, 12, 13, 14, 7]):
        lg[:, i, t] = 5.0
    return tree, lg


@pytest.mark.parametrize("impl", ["reference", "kernel"])
def test_stop_ids_and_budget(impl):
    tree, lg = chain_case()
    fn = ref.accept_greedy if impl == "reference" else run_kernel
    full = fn(tree, lg)
    assert full.accept_len.tolist() == [5, 5, 5, 0]
    assert full.bonus.tolist() == [7, 7, 7, -1]
    # per-request stop ids: row 0 stops at tree token 12 (depth 2), row 1 at the bonus 7,
    # row 2 has none that occur
    stops = torch.tensor([[12, -1], [7, 99], [-1, 3], [11, 12]])
    r = fn(tree, lg, stop_ids=stops, return_logprobs=True)
    assert r.accept_len.tolist() == [2, 5, 5, 0]
    assert r.bonus.tolist() == [12, 7, 7, -1]
    assert r.accepted[0].tolist() == [0, 1, -1, -1, -1, -1]
    assert r.logprobs[0, 2:].abs().sum() == 0 and r.logprobs[0, 1] < 0
    # shared stop ids [S]: 13 stops every active row after 3 tokens
    r = fn(tree, lg, stop_ids=torch.tensor([13]))
    assert r.accept_len.tolist() == [3, 3, 3, 0] and r.bonus.tolist() == [13, 13, 13, -1]
    # budgets: 1 emits only the first tree token (as bonus); 0 counts as 1; large keeps all
    bud = torch.tensor([1, 0, 50, 2])
    r = fn(tree, lg, max_new_tokens=bud)
    assert r.accept_len.tolist() == [1, 1, 5, 0]
    assert r.bonus.tolist() == [11, 11, 7, -1]
    assert r.accepted[:, 0].tolist() == [0, 0, 0, -1]
    # both: the earlier cut wins
    r = fn(tree, lg, stop_ids=torch.tensor([13]), max_new_tokens=torch.tensor([2, 4, 9, 1]))
    assert r.accept_len.tolist() == [2, 3, 3, 0] and r.bonus.tolist() == [12, 13, 13, -1]


@given(case=trees(max_batch=3, capacities=(4, 8), vocab=12), seed=st.integers(0, 2**20))
@settings(max_examples=15)
def test_stop_budget_property(case, seed):
    """Kernel == reference with random stop ids / budgets, and the cut is the brute-force one."""
    rng = random.Random(seed)
    tree, V = case.tree, case.vocab
    B = tree.batch_size
    lg = biased_logits(tree, V, rng, ties=False)
    stops = torch.tensor([[rng.randrange(-1, V) for _ in range(3)] for _ in range(B)])
    bud = torch.tensor([rng.randrange(0, 6) for _ in range(B)], dtype=torch.int32)
    full = ref.accept_greedy(tree, lg)
    want = ref.accept_greedy(tree, lg, stop_ids=stops, max_new_tokens=bud, return_logprobs=True)
    got = run_kernel(tree, lg, stop_ids=stops, max_new_tokens=bud, return_logprobs=True, block_v=8)
    assert_same(got, want)
    for b in range(B):
        em = emitted_of(full, tree, b)
        if not em:
            continue
        cut = min(len(em), max(1, int(bud[b])))
        s = {t for t in stops[b].tolist() if t >= 0}
        for j in range(cut):
            if em[j] in s:
                cut = j + 1
                break
        assert emitted_of(want, tree, b) == em[:cut]


@pytest.mark.parametrize("impl", ["reference", "kernel"])
def test_inactive_and_single_node_rows(impl):
    tree = tree_from_lists([[], [-1], [], [-1]], [[], [4], [], [2]], capacity=4)
    lg = torch.randn(4, 4, 8)
    lg[1, 0, 6] = 9.0
    T = torch.tensor([1.0, 0.0, 1.0, 0.7])
    u = torch.rand(4, 4)
    kk, pp = torch.zeros(4, dtype=torch.int32), torch.ones(4)
    for sample in (None, (T, kk, pp, u)):
        if impl == "kernel":
            r = run_kernel(tree, lg, sample, return_logprobs=True, topk_ids=2, block_v=8)
        elif sample is None:
            r = ref.accept_greedy(tree, lg, return_logprobs=True, topk_ids=2)
        else:
            r = ref.accept_sample(tree, lg, *sample, return_logprobs=True, topk_ids=2)
        assert r.accept_len.tolist() == [0, 1, 0, 1]
        assert r.accepted.tolist() == [[-1] * 4, [0, -1, -1, -1], [-1] * 4, [0, -1, -1, -1]]
        assert r.bonus[0] == -1 and r.bonus[2] == -1 and r.bonus[1] == 6
        assert r.topk[0].tolist() == [[-1, -1]] * 4 and r.topk[1, 1:].tolist() == [[-1, -1]] * 3
        assert r.logprobs[0].abs().sum() == 0


def test_out_buffers_are_written_in_place():
    tree, lg = chain_case()
    B, N = tree.parents.shape
    for fn in (ref.accept_greedy, run_kernel):
        out = treeops.Acceptance(
            torch.full((B, N), 77, dtype=torch.int32),
            torch.full((B,), 77, dtype=torch.int32),
            torch.full((B,), 77, dtype=torch.int64),
            torch.full((B, N), 77.0),
            torch.full((B, N, 2), 77, dtype=torch.int32),
        )
        r = fn(tree, lg, out=out, return_logprobs=True, topk_ids=2)
        assert r is out
        assert_same(out, ref.accept_greedy(tree, lg, return_logprobs=True, topk_ids=2))


# ------------------------------------------------------------------ sampling: losslessness
def node_of(tree, b: int, ctx: tuple[int, ...]) -> int:
    """The tree node reached from the root by the tokens ``ctx``, or -1 (off the tree)."""
    n = int(tree.num_nodes[b])
    par, tok = tree.parents[b].tolist(), tree.tokens[b].tolist()
    cur = 0
    for t in ctx:
        nxt = [j for j in children(par, n, cur) if tok[j] == t]
        if not nxt:
            return -1
        cur = nxt[0]
    return cur


def cont_probs(ctx: tuple[int, ...], V: int) -> list[float]:
    """The target's distribution after a context that leaves the tree (any fixed one will do)."""
    g = torch.Generator().manual_seed(hash(ctx) % (2**31))
    return torch.softmax(torch.randn(V, generator=g, dtype=torch.float64), 0).tolist()


def midpoint_leaves(tree, lg, T, k, p, K):
    """Enumerate the interval rule at every reachable node (until K tokens are emitted): one
    leaf per piece sequence, with the midpoints as uniforms and the product of piece lengths."""
    n = int(tree.num_nodes[0])
    par, tok = tree.parents[0].tolist(), tree.tokens[0].tolist()
    V = lg.shape[-1]
    leaves = []

    def rec(node, assign, weight, emitted):
        q = probs_indep(lg[0, node].double().tolist(), T, k, p)
        pieces, seen = [], set()
        for j in children(par, n, node):
            if tok[j] not in seen:
                seen.add(tok[j])
                pieces.append((q[tok[j]], j, tok[j]))
        pieces += [(q[t], -1, t) for t in range(V) if t not in seen]
        start = 0.0
        for length, child, *other in pieces:
            if length > 0:
                a = dict(assign)
                a[node] = start + length / 2
                t = tok[child] if child >= 0 else other[0]
                if child >= 0 and len(emitted) + 1 < K:
                    rec(child, a, weight * length, emitted + [t])
                else:
                    leaves.append((a, weight * length, emitted + [t], length))
            start += length

    rec(0, {}, 1.0, [])
    return leaves


def joint_check(tree, lg, T, k, p, K, run):
    """Feed every leaf's midpoints to ``run`` (batched) and compare the joint distribution of the
    first K emitted tokens (completed by the target off the tree) with the target's."""
    V, N = lg.shape[-1], tree.capacity
    leaves = midpoint_leaves(tree, lg, T, k, p, K)
    R = len(leaves)
    rep = lambda t: t.expand(R, *t.shape[1:]).contiguous()  # noqa: E731
    big = treeops.Tree(*(rep(t) for t in tree.tensors()))
    u = torch.full((R, N), 0.5)
    for r, (a, *_) in enumerate(leaves):
        for node, val in a.items():
            u[r, node] = val
    f32 = lambda v, dt=torch.float32: torch.full((R,), v, dtype=dt)  # noqa: E731
    res = run(big, rep(lg), f32(T), f32(k, torch.int32), f32(p), u)

    def target_cond(ctx):
        node = node_of(tree, 0, ctx)
        return (
            probs_indep(lg[0, node].double().tolist(), T, k, p) if node >= 0 else cont_probs(ctx, V)
        )

    got: dict[tuple, float] = {}
    for r, (_, w, expect, length) in enumerate(leaves):
        em = tuple(emitted_of(res, big, r))
        pre = em[:K]
        if length > 1e-4:  # the midpoint picks exactly the piece the rule lays out there
            assert list(pre[: len(expect)]) == expect, (r, pre, expect)

        def extend(ctx, weight):
            if len(ctx) == K:
                got[ctx] = got.get(ctx, 0.0) + weight
                return
            for t, q in enumerate(cont_probs(ctx, V)):
                if q > 0:
                    extend(ctx + (t,), weight * q)

        extend(pre, w)
    want: dict[tuple, float] = {}
    for seq in itertools.product(range(V), repeat=K):
        pr = 1.0
        for r in range(K):
            pr *= target_cond(seq[:r])[seq[r]]
            if pr == 0:
                break
        if pr > 0:
            want[seq] = pr
    keys = set(got) | set(want)
    err = max(abs(got.get(s, 0.0) - want.get(s, 0.0)) for s in keys)
    assert err < 1e-6, f"joint distribution off by {err:.3e} ({R} leaves)"
    assert abs(sum(got.values()) - 1) < 1e-9


SHAPES = {
    "chain": [-1, 0, 1, 2, 3],
    "star": [-1, 0, 0, 0, 0],
    "deep": [-1, 0, 1, 2, 3, 4, 5],
    "random": [-1, 0, 0, 1, 1, 2],
}
PARAMS = [  # (temperature, top_k, top_p)
    (1.0, 0, 1.0),
    (0.6, 0, 1.0),
    (1.7, 3, 1.0),
    (1.0, 0, 0.8),
    (0.8, 4, 0.7),
    (0.0, 0, 1.0),
]


def lossless_case(shape: str, seed: int, V: int = 6):
    rng = random.Random(seed)
    par = SHAPES[shape]
    tree = make_tree([par], len(par), V, rng)
    lg = torch.randn(1, len(par), V, generator=torch.Generator().manual_seed(seed)) * 0.8
    # make the tree's tokens likely so that deep paths carry real mass
    for i in range(len(par)):
        for j in children(par, len(par), i):
            lg[0, i, int(tree.tokens[0, j])] += 0.7
    return tree, lg


def ref_run(tree, lg, T, k, p, u):
    return ref.accept_sample(tree, lg, T, k, p, u)


def kernel_run(tree, lg, T, k, p, u, cap=None):
    return accept_launch(tree, lg, temperature=T, top_k=k, top_p=p, uniforms=u, block_v=8, cap=cap)


def kernel_run_exact_search(tree, lg, T, k, p, u):
    return kernel_run(tree, lg, T, k, p, u, cap=1)


@pytest.mark.parametrize("params", PARAMS, ids=lambda t: f"T{t[0]}-k{t[1]}-p{t[2]}")
@pytest.mark.parametrize("shape", list(SHAPES))
def test_lossless_reference(shape, params):
    tree, lg = lossless_case(shape, seed=10 * list(SHAPES).index(shape) + PARAMS.index(params))
    joint_check(tree, lg, *params, K=3, run=ref_run)


@pytest.mark.parametrize(
    "shape,params",
    [
        ("chain", (1.0, 0, 1.0)),
        ("star", (0.6, 0, 1.0)),
        ("deep", (1.7, 3, 1.0)),
        ("random", (1.0, 0, 0.8)),
        ("random", (0.8, 4, 0.7)),
        ("star", (0.0, 0, 1.0)),
        ("chain", (0.8, 4, 0.7)),
    ],
)
def test_lossless_kernel(shape, params):
    tree, lg = lossless_case(shape, seed=7 + len(shape))
    joint_check(tree, lg, *params, K=2, run=kernel_run)


@pytest.mark.parametrize(
    "shape,params",
    [("random", (1.0, 0, 0.8)), ("chain", (0.8, 4, 0.7)), ("deep", (1.7, 3, 1.0))],
)
def test_lossless_kernel_exact_search(shape, params):
    """The same with the candidate path disabled (cap=1): the multi-pivot threshold search."""
    tree, lg = lossless_case(shape, seed=7 + len(shape))
    joint_check(tree, lg, *params, K=2, run=kernel_run_exact_search)


def test_sampling_with_repeated_sibling_token():
    """A token repeated among siblings counts once (at its first sibling): still lossless."""
    tree = tree_from_lists([[-1, 0, 0, 1]], [[0, 2, 2, 3]], capacity=4)
    lg = torch.randn(1, 4, 5, generator=torch.Generator().manual_seed(1))
    for run in (ref_run, kernel_run):
        joint_check(tree, lg, 1.0, 0, 1.0, K=2, run=run)


# --------------------------------------------------- sampling: kernel == reference, bit for bit
def near_boundary(tree, lg, T, k, p, u, stops, bud):
    """True if shifting every uniform or top_p by 1e-6 changes the reference's decisions."""
    base = ref.accept_sample(tree, lg, T, k, p, u, stop_ids=stops, max_new_tokens=bud)
    for du, dp in ((1e-6, 0), (-1e-6, 0), (0, 1e-6), (0, -1e-6)):
        r = ref.accept_sample(
            tree,
            lg,
            T,
            k,
            (p + dp).clamp(max=1.0),
            (u + du).clamp(0, 1 - 2**-24),
            stop_ids=stops,
            max_new_tokens=bud,
        )
        if not (torch.equal(r.accepted, base.accepted) and torch.equal(r.bonus, base.bonus)):
            return True
    return False


@given(
    case=trees(max_batch=3, capacities=(4, 8, 16), vocab=40),
    seed=st.integers(0, 2**20),
    ties=st.booleans(),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    block=st.sampled_from([16, 64]),
    phase=st.sampled_from([0, 1]),
    cap=st.sampled_from([2, None]),
    splits=st.sampled_from([1, 2, 3]),
    ahead=st.sampled_from([1, 2]),
)
def test_sample_kernel_equals_reference(case, seed, ties, dtype, block, phase, cap, splits, ahead):
    """cap=2 forces the exact multi-pivot search; the default takes the candidate path wherever
    the group maxima bound the threshold. ``splits`` vocabulary splits per node in pass 1,
    ``ahead`` its blocks in flight."""
    rng = random.Random(seed)
    tree, V = case.tree, case.vocab
    B = tree.batch_size
    lg = biased_logits(tree, V, rng, ties, dtype=dtype)
    T = torch.tensor([rng.choice([0.0, 0.5, 1.0, 1.3]) for _ in range(B)])
    k = torch.tensor([rng.choice([0, 1, 2, 5, 17, V, V + 3]) for _ in range(B)], dtype=torch.int32)
    p = torch.tensor([rng.choice([1.0, 1.0, 0.9, 0.5, 0.05]) for _ in range(B)])
    u = torch.rand(B, tree.capacity, generator=torch.Generator().manual_seed(seed))
    stops = torch.tensor([rng.randrange(V), -1]) if rng.random() < 0.3 else None
    bud = torch.tensor([rng.randrange(1, 6) for _ in range(B)]) if rng.random() < 0.3 else None
    if near_boundary(tree, lg, T, k, p, u, stops, bud):
        return
    want = ref.accept_sample(
        tree, lg, T, k, p, u, stop_ids=stops, max_new_tokens=bud, return_logprobs=True, topk_ids=2
    )
    got = accept_launch(
        tree,
        lg,
        temperature=T,
        top_k=k,
        top_p=p,
        uniforms=u,
        stop_ids=stops,
        max_new_tokens=bud,
        return_logprobs=True,
        topk_ids=2,
        block_v=block,
        phase=phase,
        cap=cap,
        num_splits=splits,
        ahead=ahead,
    )
    assert_same(got, want, lp_tol=2e-4)


@given(
    case=trees(max_batch=3, capacities=(4, 8, 16), vocab=40),
    seed=st.integers(0, 2**20),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    block=st.sampled_from([16, 64]),
    phase=st.sampled_from([0, 1, None]),
    splits=st.sampled_from([1, 2, 3]),
    which=st.sampled_from(["neither", "top_k", "top_p"]),
)
def test_sample_without_truncation_tensors(case, seed, dtype, block, phase, splits, which):
    """``top_k`` and/or ``top_p`` None (off for every request): the kernel (no pass 2 when both
    are None: one launch with phase 0, the walk apart with phase 1) equals the reference given
    the same Nones, which equals the reference given all-off tensors."""
    rng = random.Random(seed)
    tree, V = case.tree, case.vocab
    B = tree.batch_size
    lg = biased_logits(tree, V, rng, rng.random() < 0.5, dtype=dtype)
    T = torch.tensor([rng.choice([0.0, 0.5, 1.0, 1.3]) for _ in range(B)])
    k = torch.tensor([rng.choice([0, 2, 5, V]) for _ in range(B)], dtype=torch.int32)
    p = torch.tensor([rng.choice([1.0, 0.9, 0.5]) for _ in range(B)])
    k = None if which != "top_k" else k
    p = None if which != "top_p" else p
    u = torch.rand(B, tree.capacity, generator=torch.Generator().manual_seed(seed))
    k_off = torch.zeros(B, dtype=torch.int32) if k is None else k
    p_off = torch.ones(B) if p is None else p
    if near_boundary(tree, lg, T, k_off, p_off, u, None, None):
        return
    want = ref.accept_sample(tree, lg, T, k_off, p_off, u, return_logprobs=True, topk_ids=2)
    assert_same(ref.accept_sample(tree, lg, T, k, p, u, return_logprobs=True, topk_ids=2), want)
    got = accept_launch(
        tree, lg, temperature=T, top_k=k, top_p=p, uniforms=u, return_logprobs=True,
        topk_ids=2, block_v=block, phase=phase, num_splits=splits,
    )  # fmt: skip
    assert_same(got, want, lp_tol=2e-4)
    pub = treeops.accept_sample(tree, lg, T, k, p, u, validate=True)  # the op, CPU reference
    assert torch.equal(pub.accepted, want.accepted) and torch.equal(pub.bonus, want.bonus)


@given(
    V=st.integers(1, 70),
    n=st.integers(1, 6),
    seed=st.integers(0, 2**20),
    spread=st.sampled_from([2, 5, 1000]),
    block=st.sampled_from([8, 16]),
    splits=st.sampled_from([1, 2, 3, 4]),
    groups=st.sampled_from([None, 4, 1000]),
    cap=st.sampled_from([None, 4]),
    phase=st.sampled_from([0, 1]),
    ahead=st.sampled_from([1, 2]),
    reread=st.sampled_from([None, 1, 8, 32]),
)
@settings(max_examples=20)
def test_sample_splits_edge_cases(
    V, n, seed, spread, block, splits, groups, cap, phase, ahead, reread
):
    """Kernel == reference at the edges of the split / group / candidate paths: tiny V, V not a
    multiple of the block, splits past the end of the row, few distinct logits (ties at the
    top-k and top-p cuts), top_k in {1, V - 1, V, > V}, top_p in {1, tiny, near 1}, one group
    per token or very few groups (k above the group count: the exact search), few slots, and
    candidate rereads of one group at a time up to many."""
    rng = random.Random(seed)
    tree = make_tree([parents_of("random", n, rng), parents_of("chain", n, rng)], 6, V, rng)
    g = torch.Generator().manual_seed(seed)
    lg = (torch.randint(0, spread, (2, 6, V), generator=g).float() * (8.0 / spread)).to(
        torch.bfloat16
    )
    T = torch.tensor([rng.choice([0.5, 1.0, 2.0]), rng.choice([0.0, 0.7])])
    k = torch.tensor([rng.choice([0, 1, 2, max(V - 1, 1), V, V + 4]) for _ in range(2)])
    p = torch.tensor([rng.choice([1.0, 0.5, 1e-3, 0.999]) for _ in range(2)])
    u = torch.rand(2, 6, generator=g)
    if near_boundary(tree, lg, T, k, p, u, None, None):
        return
    want = ref.accept_sample(tree, lg, T, k, p, u, return_logprobs=True, topk_ids=min(2, V))
    got = accept_launch(
        tree, lg, temperature=T, top_k=k, top_p=p, uniforms=u, return_logprobs=True,
        topk_ids=min(2, V), block_v=block, num_splits=splits, max_groups=groups, cap=cap,
        phase=phase, ahead=ahead, reread=reread,
    )  # fmt: skip
    assert_same(got, want, lp_tol=2e-4)


@pytest.mark.parametrize(
    "dtype,tile,pivots,masked",
    [(torch.bfloat16, 16, 16, True), (torch.float16, 32, 1, False), (torch.float32, 64, 2, True)],
    ids=["bf16-masked", "fp16", "fp32-masked"],
)
def test_sample_exact_search_every_dtype(dtype, tile, pivots, masked):
    """The exact search (cap 4: every top-p row's candidates overflow it; k past the groups)
    equals the reference for each logits dtype, whose keys it searches above their low 16
    (bf16) or 13 (fp16) bits: logits of both signs with ties, so that negative keys (low bits
    all ones) and the tie cut are reached; several tiles and pivot counts a pass. ``masked``:
    request 1 also has -inf logits (a masked vocabulary) that its top-k 68 reaches, so that the
    kept set's bound is -inf's key, and -0.0 beside 0.0 (one key, one value compare)."""
    rng = random.Random(11)
    V = 70
    tree = make_tree([parents_of("random", 6, rng), parents_of("chain", 6, rng)], 6, V, rng)
    g = torch.Generator().manual_seed(11)
    lg = torch.randint(-12, 12, (2, 6, V), generator=g).float() * 0.37
    lg[0] -= 5.0  # request 0's logits all negative, request 1's of both signs
    if masked:
        lg[1, :, 3:8] = float("-inf")
        lg[1, :, 40:43] = -0.0
        lg[1, :, 50:52] = 0.0
    lg = lg.to(dtype)
    T = torch.tensor([0.9, 1.3])
    # top-p alone; k 60 above the 8 groups of 8 tokens (68: into the -inf logits)
    k = torch.tensor([0, 68 if masked else 60])
    p = torch.tensor([0.85, 0.6])
    for seed in range(3):
        u = torch.rand(2, 6, generator=torch.Generator().manual_seed(seed))
        if near_boundary(tree, lg, T, k, p, u, None, None):
            continue
        want = ref.accept_sample(tree, lg, T, k, p, u, return_logprobs=True)
        got = accept_launch(
            tree, lg, temperature=T, top_k=k, top_p=p, uniforms=u, return_logprobs=True,
            block_v=64, num_splits=2, max_groups=8, cap=4, exact_tile=tile, num_pivots=pivots,
        )  # fmt: skip
        assert_same(got, want, lp_tol=2e-4)


@triton.jit
def _count_search_kernel(p_row, V, goal, p_out, BLOCK: tl.constexpr, NPIV: tl.constexpr):
    o = tl.arange(0, 128)
    m = tl.max(tl.load(p_row + o, mask=o < V, other=float("-inf")).to(tl.float32), axis=0)
    lo = tl.full([], -2147483648, tl.int32)
    thr, f_gt = _count_search(p_row, 1, V, m, 1.0, goal, lo, _key(m) + 1, V * 1.0, False,
                              BLOCK, NPIV)  # fmt: skip
    tl.store(p_out, thr)
    tl.store(p_out + 1, f_gt.to(tl.int32))


@pytest.mark.parametrize("npiv", [1, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_count_search_finds_the_kth_key(dtype, npiv):
    """``_count_search`` by count: the k-th largest key of the row and how many keys are above
    it, exactly, for each dtype (its search runs above their low 16 / 13 bits) and rows of
    either sign with ties; a bisection (one pivot, its own accumulator) and four pivots."""
    g = torch.Generator().manual_seed(5)
    for shift in (-6.0, 0.0, 6.0):
        x = (torch.randint(-10, 10, (100,), generator=g).float() * 0.3 + shift).to(dtype)
        bits = x.float().view(torch.int32)
        keys = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        keys = torch.where(x.float() == 0, torch.zeros_like(keys), keys)
        for k in (1, 7, 50, 100):
            out = torch.zeros(2, dtype=torch.int32)
            _count_search_kernel[(1,)](x, 100, float(k), out, BLOCK=32, NPIV=npiv)
            kth = int(torch.sort(keys, descending=True).values[k - 1])
            assert out.tolist() == [kth, int((keys > kth).sum())], (dtype, shift, k, npiv)


@pytest.mark.parametrize("splits", [1, 4])
def test_lossless_kernel_splits(splits):
    """The interval rule stays exactly lossless with the row split over programs in pass 1."""
    tree, lg = lossless_case("random", seed=3, V=20)

    def run(tree, lg, T, k, p, u):
        return accept_launch(
            tree, lg, temperature=T, top_k=k, top_p=p, uniforms=u, block_v=8, num_splits=splits
        )

    joint_check(tree, lg, 0.8, 4, 0.7, K=2, run=run)


def test_sample_top_k_top_p_kept_set_matches_reference_probs():
    """Logprobs expose the kernel's kept set and normaliser: they equal log p_i of the
    reference's target distribution, including ties at the top-k / top-p boundary."""
    tree = tree_from_lists([[-1]] * 6, [[0]] * 6, capacity=1)
    x = torch.tensor([3.0, 1.0, 3.0, 1.0, 1.0, 0.0, 1.0, 3.0, -1.0, 1.0])
    lg = x.expand(6, 1, 10).contiguous()
    T = torch.tensor([1.0, 1.0, 0.5, 1.0, 2.0, 1.0])
    k = torch.tensor([2, 4, 0, 5, 3, 0], dtype=torch.int32)
    p = torch.tensor([1.0, 1.0, 0.6, 0.95, 0.99, 0.3])
    for q in torch.linspace(0.01, 0.99, 7):
        u = torch.full((6, 1), float(q))
        want = ref.accept_sample(tree, lg, T, k, p, u, return_logprobs=True)
        got = accept_launch(
            tree, lg, temperature=T, top_k=k, top_p=p, uniforms=u, return_logprobs=True, block_v=8
        )
        assert_same(got, want)
        for b in range(6):
            dist = probs_indep(x.double().tolist(), float(T[b]), int(k[b]), float(p[b]))
            assert got.logprobs[b, 0] == pytest.approx(math.log(dist[int(got.bonus[b])]), abs=1e-5)


@pytest.mark.parametrize("big_first", [True, False])
@pytest.mark.parametrize("top_k", [0, 8])
def test_sample_u_near_one_with_every_kept_token_a_child(big_first, top_k):
    """Every kept token is a child of the root, one weight 1 and seven far below its rounding,
    u = 1 - 2**-24: in exact arithmetic u falls in a child's piece. The sums of the weights in
    sibling order (the walk) and over the row (the normaliser) may round apart, leaving u past
    the children: then the last child's piece is taken and the walk goes on from it. Either
    way a child is accepted, as the reference accepts one."""
    V = 8
    parents = [-1] + [0] * V + [1 if big_first else V]
    tokens = [0] + list(range(V)) + [3]
    tree = tree_from_lists([parents], [tokens], capacity=V + 2)
    lg = torch.full((1, V + 2, V), -100.0)
    big = 0 if big_first else V - 1
    lg[0, 0] = -17.0  # weights exp(-17) < 2**-24 of the max's
    lg[0, 0, big] = 0.0
    lg[0, big + 1, 3] = 5.0  # below the big child, token 3 is the near-certain next
    u = torch.full((1, V + 2), 1 - 2**-24)
    T = torch.ones(1)
    want = ref.accept_sample(tree, lg, T, torch.tensor([top_k]), torch.ones(1), u)
    assert int(want.accepted[0, 1]) >= 1
    for run_k in ([None, None], [torch.tensor([top_k], dtype=torch.int32), torch.ones(1)]):
        got = accept_launch(tree, lg, temperature=T, top_k=run_k[0], top_p=run_k[1], uniforms=u)
        assert 1 <= int(got.accepted[0, 1]) <= V, got
        assert int(got.accept_len[0]) >= 2


def test_sample_large_vocab_named_case():
    """One larger case (V = 3001, several blocks) with top-k and top-p."""
    rng = random.Random(11)
    tree = make_tree([parents_of("random", 10, rng), parents_of("chain", 8, rng)], 12, 3001, rng)
    lg = biased_logits(tree, 3001, rng, ties=False, dtype=torch.bfloat16, boost=3.0)
    T = torch.tensor([0.9, 1.2])
    k = torch.tensor([50, 0], dtype=torch.int32)
    p = torch.tensor([0.9, 0.8])
    u = torch.rand(2, 12, generator=torch.Generator().manual_seed(2))
    want = ref.accept_sample(tree, lg, T, k, p, u, return_logprobs=True)
    got = accept_launch(
        tree, lg, temperature=T, top_k=k, top_p=p, uniforms=u, return_logprobs=True, block_v=1024
    )
    assert_same(got, want, lp_tol=2e-4)


# ------------------------------------------------------------------------------ bad input
def _good():
    tree, lg = chain_case()
    B, N = tree.parents.shape
    return dict(
        tree=tree,
        target_logits=lg,
        temperature=torch.ones(B),
        top_k=torch.zeros(B, dtype=torch.int32),
        top_p=torch.ones(B),
        uniforms=torch.rand(B, N),
    )


@pytest.mark.parametrize(
    "change,msg",
    [
        (lambda a: a.update(tree="x"), "Invalid type of tree: expected treeops.Tree"),
        (
            lambda a: a.update(target_logits=a["target_logits"][:, :3]),
            "Invalid shape of target_logits: expected [4, 6, V]",
        ),
        (
            lambda a: a.update(target_logits=a["target_logits"].double()),
            "Invalid dtype of target_logits",
        ),
        (
            lambda a: a.update(temperature=torch.ones(3)),
            "Invalid shape of temperature: expected [4]",
        ),
        (
            lambda a: a.update(temperature=torch.ones(4, dtype=torch.float64)),
            "Invalid dtype of temperature: expected torch.float32",
        ),
        (lambda a: a.update(top_k=torch.zeros(4)), "Invalid dtype of top_k"),
        (lambda a: a.update(top_p=torch.ones(4, 1)), "Invalid shape of top_p"),
        (
            lambda a: a.update(uniforms=torch.rand(4, 5)),
            "Invalid shape of uniforms: expected [4, 6]",
        ),
        (
            lambda a: a.update(uniforms=torch.rand(4, 6, dtype=torch.float64)),
            "Invalid dtype of uniforms",
        ),
        (
            lambda a: a.update(stop_ids=torch.zeros(2, 2, 2, dtype=torch.int64)),
            "Invalid shape of stop_ids: expected [S] or [B, S]",
        ),
        (
            lambda a: a.update(stop_ids=torch.zeros(3, 2, dtype=torch.int64)),
            "Invalid shape of stop_ids: expected [4, S]",
        ),
        (lambda a: a.update(stop_ids=torch.zeros(2)), "Invalid dtype of stop_ids"),
        (
            lambda a: a.update(stop_ids=torch.zeros(4, 6, dtype=torch.int64)[:, ::2]),
            "Invalid layout of stop_ids",
        ),
        (lambda a: a.update(uniforms=torch.rand(6, 4).t()), "Invalid layout of uniforms"),
        (
            lambda a: a.update(max_new_tokens=torch.ones(5, dtype=torch.int32)),
            "Invalid shape of max_new_tokens",
        ),
        (
            lambda a: a.update(topk_ids=17),
            "Invalid value of topk_ids: expected an int in [0, V=16]",
        ),
        (lambda a: a.update(topk_ids=-1), "Invalid value of topk_ids"),
        (lambda a: a.update(return_logprobs=1), "Invalid type of return_logprobs"),
        (lambda a: a.update(out=(1, 2, 3)), "Invalid type of out"),
        (
            lambda a: a.update(
                out=treeops.Acceptance(
                    torch.zeros(4, 6, dtype=torch.int64),
                    torch.zeros(4, dtype=torch.int32),
                    torch.zeros(4, dtype=torch.int64),
                )
            ),
            "Invalid dtype of out.accepted",
        ),
        (lambda a: a.update(validate=True, top_p=torch.zeros(4)), "Invalid value in top_p"),
        (
            lambda a: a.update(validate=True, top_p=torch.full((4,), float("nan"))),
            "Invalid value in top_p: expected finite numbers",
        ),
        (
            lambda a: a.update(validate=True, temperature=-torch.ones(4)),
            "Invalid value in temperature",
        ),
        (lambda a: a.update(validate=True, uniforms=torch.ones(4, 6)), "Invalid value in uniforms"),
        (
            lambda a: a.update(validate=True, max_new_tokens=torch.zeros(4, dtype=torch.int32)),
            "Invalid value in max_new_tokens: expected >= 1",
        ),
        (
            lambda a: a.update(validate=True, target_logits=a["target_logits"] * float("nan")),
            "Invalid value in target_logits",
        ),
    ],
)
def test_bad_input(change, msg):
    args = _good()
    change(args)
    tree, lg = args.pop("tree"), args.pop("target_logits")
    samp = [args.pop(k) for k in ("temperature", "top_k", "top_p", "uniforms")]
    with pytest.raises(ValueError) as e:
        treeops.accept_sample(tree, lg, *samp, **args)
    assert msg in str(e.value)
    if "temperature" not in msg and "top_" not in msg and "uniforms" not in msg:
        with pytest.raises(ValueError) as e:
            treeops.accept_greedy(tree, lg, **args)
        assert msg in str(e.value)


def test_bad_tree_when_validating():
    tree, lg = chain_case()
    bad = tree.clone()
    bad.depth[0, 2] = 5
    with pytest.raises(ValueError, match="Invalid tree: request 0: depth"):
        treeops.accept_greedy(bad, lg, validate=True)


@given(
    V=st.integers(1, 300),
    n=st.integers(1, 4),
    spread=st.integers(1, 20),
    k=st.integers(0, 310),
    seed=st.integers(0, 2**20),
    special=st.sampled_from([None, float("-inf"), float("inf"), float("nan")]),
)
def test_reference_rank_order_is_the_stable_sort(V, n, spread, k, seed, special):
    """The reference's top-k helper (candidates above the k-th value, then a stable sort) equals
    a stable sort of the whole row, ties included, for rows and single vectors, also with k = 0
    and with infinities or NaN in the row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, spread, (n, V), generator=g).double()  # few distinct values: ties
    if special is not None:
        x.view(-1)[torch.randint(0, n * V, (max(1, V // 4),), generator=g)] = special
    want = torch.sort(-x, dim=-1, stable=True).indices[:, :k]
    assert torch.equal(ref.rank_order(x, k), want)
    assert torch.equal(ref.rank_order(x[0], k), want[0])


def test_accept_counters_outlive_a_larger_batch():
    """The arrival counters a captured graph holds stay allocated after a larger batch makes new
    ones (a freed buffer would take the graph's atomics)."""
    from treeops.kernels import _counters as kc

    dev = torch.device("cpu")
    kc._COUNTERS.pop(dev, None)
    small = kc.arrival_counters(dev, 8)
    big = kc.arrival_counters(dev, 1000)
    assert big.numel() >= 1000 and big is not small
    assert any(t is small for t in kc._RETIRED)
    assert kc.arrival_counters(dev, 8) is big  # the larger buffer serves smaller launches


@pytest.mark.parametrize("extras", [False, True])
def test_opcheck_accept(extras):
    s = small_step()
    t, logits = s["tree"], s["logits"]
    B, N = t.parents.shape
    k = 3 if extras else 0

    def outs():
        return (
            torch.zeros(B, N, dtype=torch.int32),
            torch.zeros(B, dtype=torch.int32),
            torch.zeros(B, dtype=torch.int64),
            torch.zeros(B, N) if extras else None,
            torch.zeros(B, N, k, dtype=torch.int32) if extras else None,
        )

    stops = torch.tensor([9], dtype=torch.int64) if extras else None
    budget = torch.tensor([2, 5], dtype=torch.int32) if extras else None
    torch.library.opcheck(
        torch.ops.treeops.accept_greedy.default,
        (*t.tensors(), logits, stops, budget, k, *outs()),
    )
    sampling = (
        torch.tensor([0.0, 0.8]),
        torch.tensor([0, 5], dtype=torch.int32),
        torch.tensor([1.0, 0.9]),
        torch.rand(B, N, generator=torch.Generator().manual_seed(1)),
    )
    torch.library.opcheck(
        torch.ops.treeops.accept_sample.default,
        (*t.tensors(), logits, *sampling, stops, budget, k, *outs()),
    )
    # without top-k / top-p tensors (off for every request)
    torch.library.opcheck(
        torch.ops.treeops.accept_sample.default,
        (*t.tensors(), logits, sampling[0], None, None, sampling[3], stops, budget, k, *outs()),
    )


def test_default_ahead_loads_a_block_ahead_only_in_small_launches(monkeypatch):
    """Two blocks in flight where pass 1 has few programs per SM (B 1 and 8 at N 64 on 132
    SMs), one from B 64; always one off CUDA (the interpreter)."""
    from treeops.kernels import accept as KA

    monkeypatch.setattr(KA._runtime, "sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    assert KA.default_ahead(1 * 64 * 8, cuda) == 2
    assert KA.default_ahead(8 * 64, cuda) == 2
    assert KA.default_ahead(KA.AHEAD_PROGRAMS_PER_SM * 132 + 1, cuda) == 1
    assert KA.default_ahead(64 * 64, cuda) == 1
    assert KA.default_ahead(8, torch.device("cpu")) == 1


def test_default_splits_and_blocks_from_capacities(monkeypatch):
    """Pass 1's splits fill 132 SMs twice over (fewer with top-K ids), each at least one block
    long (the last may be partial, but sampling's with top-K ids), at most 16; greedy takes
    2,048-logit blocks where a split of 4,096 would hold fewer than two; one split off CUDA."""
    from treeops.kernels import accept as KA

    monkeypatch.setattr(KA._runtime, "sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    assert KA.default_splits(1, 64, 32000, cuda, 2048) == 8
    assert KA.default_splits(1, 64, 32000, cuda, 4096) == 8  # 7.8 blocks: the last partial
    assert KA.default_splits(1, 64, 32000, cuda, 4096, topk_ids=True) == 2  # 128 programs
    assert KA.default_splits(1, 64, 8192, cuda, 4096, topk_ids=True) == 2
    assert KA.default_splits(1, 100, 32000, cuda, 4096, topk_ids=True) == 1  # 200 > 132
    assert KA.default_splits(1, 7, 32000, cuda, 4096, topk_ids=True) == 8  # the last partial
    # sampling with top-K ids: the doubled launch within two programs per SM, whole blocks
    assert KA.default_splits(8, 7, 8192, cuda, 2048, topk_ids=True, sample=True) == 4
    assert KA.default_splits(2, 64, 8192, cuda, 2048, topk_ids=True, sample=True) == 2
    assert KA.default_splits(1, 100, 8192, cuda, 2048, topk_ids=True, sample=True) == 2
    assert KA.default_splits(1, 7, 8192, cuda, 2048, topk_ids=True, sample=True) == 4
    assert KA.default_splits(8, 64, 32000, cuda, 4096) == 1  # 512 programs fill it already
    assert KA.default_splits(1, 1, 10**6, cuda, 1024) == 16
    # the last split may be partial: 3,000 in two, 32,000 (15.6 blocks) in 16 at small B·N
    assert KA.default_splits(1, 64, 3000, cuda, 2048) == 2
    assert KA.default_splits(1, 64, 2048, cuda, 2048) == 1
    assert KA.default_splits(1, 7, 32000, cuda, 2048) == 16
    assert KA.default_splits(1, 7, 32000, cuda, 2048, sample=True) == 16
    assert KA.default_splits(1, 7, 32000, cuda, 2048, topk_ids=True, sample=True) == 8
    assert KA.default_splits(1, 64, 32000, torch.device("cpu"), 2048) == 1

    def plan(B, N, V, K=0):
        p = KA._plan(B, N, V, cuda, False, K, False, 0, False, False, None, None, 16, None,
                     None, None, None, True, False, False, None, None, KA.EXACT_TILE)  # fmt: skip
        return p.common["BLOCK_V"], p.S

    assert plan(1, 64, 32000) == (2048, 8)
    assert plan(2, 64, 32000) == (2048, 4)
    assert plan(1, 64, 128256) == (4096, 8)
    assert plan(1, 64, 32000, K=8) == (4096, 2)  # top-K ids keep 4,096 blocks
    assert plan(1, 7, 32000, K=8) == (4096, 8)


def test_launch_refuses_bad_phase_and_ahead():
    tree = make_tree([parents_of("chain", 3, random.Random(0))], 4, 16, random.Random(0))
    lg = torch.randn(1, 4, 16)
    with pytest.raises(ValueError, match="Invalid value of phase"):
        accept_launch(tree, lg, phase=3)
    with pytest.raises(ValueError, match="Invalid value of ahead"):
        accept_launch(tree, lg, ahead=3)
    with pytest.raises(ValueError, match="Invalid value of reread"):
        accept_launch(tree, lg, reread=48)
    with pytest.raises(ValueError, match="Invalid value of exact_tile"):
        accept_launch(tree, lg, exact_tile=1000)
    with pytest.raises(ValueError, match="Invalid value of num_pivots"):
        accept_launch(tree, lg, num_pivots=3)
    with pytest.raises(ValueError, match="Invalid value of pass2_warps"):
        accept_launch(tree, lg, pass2_warps=3)

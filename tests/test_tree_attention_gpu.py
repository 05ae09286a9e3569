"""GPU tests of tree attention and KV append (compiled kernels, bf16/fp16, realistic sizes).

Run on the H200: ``TREEOPS_GPU_TESTS=1 python -m pytest tests/test_tree_attention_gpu.py``; the
``memcheck`` table is fixed so that ``compute-sanitizer --tool memcheck python -m pytest
tests/test_tree_attention_gpu.py -k memcheck`` compiles each kernel once per shape.
"""

from __future__ import annotations

import random

import pytest
import torch

import treeops
from helpers import assert_close
from strategies import make_tree, paged_kv, parents_of
from treeops.kernels import tree_attention as K
from treeops.reference import kv_append as RK
from treeops.reference import tree_attention as RA

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _trees(B, N, kinds, rng, sizes=None):
    rows = []
    for b in range(B):
        kind = kinds[b % len(kinds)]
        n = N if sizes is None else sizes[b % len(sizes)]
        rows.append(parents_of(kind, n, rng))
    return make_tree(rows, N, max(64, N), rng).to(DEV)


def _check(
    q, kv, seq, tree, dtype, q_start=None, q_len=None, num_splits=None, what="", override=None
):
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:3], float("nan"), device=DEV)
    K.tree_attention_fwd(
        q,
        kv.k_cache,
        kv.v_cache,
        kv.block_table,
        seq,
        tree.num_nodes,
        tree.anc,
        q_start,
        q_len,
        q.shape[-1] ** -0.5,
        out,
        lse,
        num_splits=num_splits,
        override=override,
    )
    ref, ref_lse = RA.tree_attention(
        q, kv.k_cache, kv.v_cache, kv.block_table, seq, tree, q_start, q_len, return_lse=True
    )
    assert_close(out, ref, dtype, f"out {what}")
    assert_close(
        lse, ref_lse, torch.float32 if dtype != torch.bfloat16 else torch.float16, f"lse {what}"
    )
    zero = torch.isinf(ref_lse)
    assert bool((out[zero] == 0).all()) and bool(torch.isinf(lse[zero]).all())


_CANDIDATES = [(d, n) for d, c in K.CANDIDATES.items() for n in c] + [
    (d, "small") for d in K.CANDIDATES
]


@pytest.mark.parametrize("D,name", _CANDIDATES, ids=lambda x: str(x))
def test_sweep_candidates(D, name):
    """Every launch configuration the sweep times, compiled: bf16, page 16, GQA 4, several full
    prefix tiles, ragged lengths, a query range; the small-tree path at N = 16 and ctx <= 1000."""
    rng = random.Random(D)
    small = name == "small"
    override = {"small_tree": True} if small else K.CANDIDATES[D][name]
    B, N = (3, 16) if small else (3, 64)
    lens = [900, 517, 0] if small else [2000, 1037, 0]
    tree = _trees(B, N, ["random", "chain", "binary"], rng, sizes=[N, N - 3, 1])
    seq = torch.tensor(lens, dtype=torch.int32, device=DEV)
    kv = paged_kv([L + N for L in lens], 16, 8, D, torch.bfloat16, rng, device=DEV)
    q = torch.randn(B, N, 32, D, device=DEV).to(torch.bfloat16)
    if small:
        assert K.config_for(q, kv.k_cache, kv.block_table, None, override).num_splits == 1
    _check(q, kv, seq, tree, torch.bfloat16, override=override, what=f"D={D} {name}")
    qs = torch.tensor([0, 2, 0], dtype=torch.int32, device=DEV)
    ql = torch.tensor([5, 9, 1], dtype=torch.int32, device=DEV)
    _check(q, kv, seq, tree, torch.bfloat16, qs, ql, override=override, what=f"{name} range")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "B,ctx,N,H_q,H_kv,D,page",
    [
        (4, 1000, 64, 32, 8, 128, 16),
        (2, 3000, 64, 32, 8, 128, 64),
        (3, 517, 32, 32, 32, 64, 1),
        (2, 700, 64, 16, 2, 256, 16),
        (1, 5000, 128, 32, 8, 128, None),
        (8, 300, 16, 28, 4, 128, 16),
    ],
)
def test_realistic(dtype, B, ctx, N, H_q, H_kv, D, page):
    rng = random.Random(B * 7 + N)
    lens = [ctx + 37 * b for b in range(B)]
    tree = _trees(B, N, ["random", "chain", "star", "binary"], rng, sizes=[N, N - 3, 1, N // 2])
    seq = torch.tensor(lens, dtype=torch.int32, device=DEV)
    kv = paged_kv(
        [L + N for L in lens], page, H_kv, D, dtype, rng, strided=(page == 64), device=DEV
    )
    q = torch.randn(B, N, H_q, D, device=DEV).to(dtype)
    _check(q, kv, seq, tree, dtype, what=f"{B},{ctx},{N},{H_q},{H_kv},{D},{page}")
    qs = torch.tensor([b % 3 for b in range(B)], dtype=torch.int32, device=DEV)
    ql = torch.tensor([5 + b for b in range(B)], dtype=torch.int32, device=DEV)
    _check(q, kv, seq, tree, dtype, qs, ql, what="query range")


@pytest.mark.parametrize("page", [16, 1])
def test_cache_sized_for_long_contexts_holding_short_ones(page):
    """An engine's block table covers 8,192 slots while the prefixes are 0 to 3,000 keys: the
    automatic split count is a cap, each request's keys split into at most that many chunks;
    with a device-side bound (``split_min_len``), requests under it are written unsplit by the
    forward kernel and left by the merge. bf16, the trained pair's heads (10 query, 2 KV,
    D = 64) and a GQA-4 D = 128 layout; the output is NaN-filled."""
    rng = random.Random(page)
    N = 16
    bound = 512
    lens = [0, 100, 400, bound - N - 1, bound - N, 700, 3000, 250]
    for H_q, H_kv, D in ((10, 2, 64), (32, 8, 128)):
        tree = _trees(len(lens), N, ["random", "chain", "binary"], rng, sizes=[N, 7, 1, N])
        seq = torch.tensor(lens, dtype=torch.int32, device=DEV)
        kv = paged_kv([8192] * len(lens), page, H_kv, D, torch.bfloat16, rng, device=DEV)
        q = torch.randn(len(lens), N, H_q, D, device=DEV).to(torch.bfloat16)
        assert K.config_for(q, kv.k_cache, kv.block_table).num_splits > 1
        qs = torch.tensor([b % 3 for b in range(len(lens))], dtype=torch.int32, device=DEV)
        ql = torch.tensor([1 + b for b in range(len(lens))], dtype=torch.int32, device=DEV)
        for ov in (None, {"split_min_len": bound}):
            what = f"{H_q}/{H_kv}/{D} page {page} {ov}"
            _check(q, kv, seq, tree, torch.bfloat16, override=ov, what=what)
            _check(q, kv, seq, tree, torch.bfloat16, qs, ql, override=ov, what="query range")


@pytest.mark.parametrize("H_q,H_kv,D", [(10, 2, 64), (32, 8, 128), (16, 4, 256)])
def test_fused_merge_on_gpu(H_q, H_kv, D):
    """``fused_merge`` (split tiles merged by their last chunk's program through the arrival
    counters): automatic and forced split counts over ragged lengths (unsplit and split requests
    in one launch) and a query range, against the reference; then the launch captured in a CUDA
    graph and replayed three times (the counters must be back at zero after every replay)."""
    from treeops.kernels import _counters as kc

    rng = random.Random(D)
    N = 16
    lens = [0, 300, 512, 1500, 4000, 77]
    tree = _trees(len(lens), N, ["random", "chain", "binary"], rng, sizes=[N, 9, 1, N])
    seq = torch.tensor(lens, dtype=torch.int32, device=DEV)
    kv = paged_kv([8192] * len(lens), 16, H_kv, D, torch.bfloat16, rng, device=DEV)
    q = torch.randn(len(lens), N, H_q, D, device=DEV).to(torch.bfloat16)
    ov = {"fused_merge": True}
    assert K.config_for(q, kv.k_cache, kv.block_table, None, ov).fused_merge
    _check(q, kv, seq, tree, torch.bfloat16, override=ov, what=f"fused {H_q}/{H_kv}/{D}")
    qs = torch.tensor([b % 3 for b in range(len(lens))], dtype=torch.int32, device=DEV)
    ql = torch.tensor([2 + b for b in range(len(lens))], dtype=torch.int32, device=DEV)
    _check(q, kv, seq, tree, torch.bfloat16, qs, ql, num_splits=5, override=ov, what="forced")
    out = torch.empty_like(q)
    ws = torch.empty(
        K.workspace_numel(len(lens), N, H_q, D, K.config_for(q, kv.k_cache, kv.block_table)),
        dtype=torch.float32, device=DEV,
    )  # fmt: skip

    def call():
        K.tree_attention_fwd(
            q, kv.k_cache, kv.v_cache, kv.block_table, seq, tree.num_nodes, tree.anc, None, None,
            D**-0.5, out, None, ws, override=ov,
        )  # fmt: skip

    call()
    torch.cuda.synchronize()
    want = out.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call()
    for _ in range(3):
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, want)
    assert all(int(c.abs().sum()) == 0 for c in kc._COUNTERS.values())


@pytest.mark.parametrize("B,ctx", [(1, 4096), (4, 600)])
def test_pdl_launches_match_plain(B, ctx, monkeypatch):
    """Programmatic dependent launch (kernels/_pdl.py, ``TREEOPS_PDL=1``): two attention calls in
    a chain (the second's queries the first's output), each a split launch and its merge, eagerly
    and as a CUDA graph replayed with new queries, give bitwise the plain launches' outputs."""
    rng = random.Random(B)
    N, H_q, H_kv, D = 16, 32, 8, 128
    tree = _trees(B, N, ["random", "chain"], rng)
    seq = torch.full((B,), ctx, dtype=torch.int32, device=DEV)
    kv = paged_kv([ctx + N] * B, 16, H_kv, D, torch.bfloat16, rng, device=DEV)
    q = torch.randn(B, N, H_q, D, device=DEV).to(torch.bfloat16)
    assert K.config_for(q, kv.k_cache, kv.block_table).num_splits > 1  # a merge launch follows
    mid, out = torch.empty_like(q), torch.empty_like(q)
    ref_mid, ref_out = torch.empty_like(q), torch.empty_like(q)

    def chain(o1, o2):
        for x, o in ((q, o1), (o1, o2)):
            K.tree_attention_fwd(
                x, kv.k_cache, kv.v_cache, kv.block_table, seq, tree.num_nodes, tree.anc, None,
                None, D**-0.5, o, None,
            )  # fmt: skip

    def pdl(on):
        monkeypatch.setattr(K, "use_pdl", lambda device, default=0: int(on))
        K._PLANS.clear()  # plans keep their launch options

    pdl(True)
    chain(mid, out)  # compiles the PDL launches outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(mid, out)
    for rep in range(6):
        q.copy_(torch.randn(q.shape, device=DEV) * (1 + rep))
        pdl(True)
        if rep % 2:
            graph.replay()
        else:
            chain(mid, out)  # eager PDL launches
        pdl(False)
        chain(ref_mid, ref_out)
        torch.cuda.synchronize()
        assert torch.equal(mid, ref_mid) and torch.equal(out, ref_out), rep


def test_public_ops_dispatch_to_kernels():
    rng = random.Random(1)
    B, N, H_q, H_kv, D = 2, 32, 8, 2, 128
    tree = _trees(B, N, ["random"], rng)
    seq = torch.tensor([100, 33], dtype=torch.int32, device=DEV)
    kv = paged_kv([133 + N, 33 + N], 16, H_kv, D, torch.bfloat16, rng, device=DEV)
    q = torch.randn(B, N, H_q, D, device=DEV, dtype=torch.bfloat16)
    out, lse = treeops.tree_attention(
        q, kv.k_cache, kv.v_cache, kv.block_table, seq, tree, return_lse=True, validate=True
    )
    ref, ref_lse = RA.tree_attention(
        q, kv.k_cache, kv.v_cache, kv.block_table, seq, tree, return_lse=True
    )
    assert_close(out, ref, torch.bfloat16, "out")
    k = torch.randn(B, N, H_kv, D, device=DEV, dtype=torch.bfloat16)
    v = torch.randn(B, N, H_kv, D, device=DEV, dtype=torch.bfloat16)
    kc, vc = kv.k_cache.clone(), kv.v_cache.clone()
    treeops.kv_append(
        k, v, kv.k_cache, kv.v_cache, kv.block_table, seq, tree.num_nodes, tree.depth, validate=True
    )
    RK.kv_append(k, v, kc, vc, kv.block_table, seq, tree.num_nodes, tree.depth)
    assert_close(kv.k_cache, kc, torch.bfloat16, "k_cache")
    assert torch.equal(kv.v_cache, vc)


def test_cuda_graph_replay():
    """Capture kv_append + tree_attention once; replay with new trees, lengths, block tables."""
    rng = random.Random(2)
    B, N, H_q, H_kv, D, page, max_pages = 3, 64, 32, 8, 128, 16, 40
    dt = torch.bfloat16
    P = B * max_pages + 5
    kc = torch.randn(P, page, H_kv, D, device=DEV, dtype=dt)
    vc = torch.randn(P, page, H_kv, D, device=DEV, dtype=dt)
    bt = torch.zeros(B, max_pages, dtype=torch.int32, device=DEV)
    seq = torch.zeros(B, dtype=torch.int32, device=DEV)
    tree = _trees(B, N, ["random"], rng)
    q = torch.zeros(B, N, H_q, D, device=DEV, dtype=dt)
    k = torch.zeros(B, N, H_kv, D, device=DEV, dtype=dt)
    v = torch.zeros_like(k)
    out = torch.empty_like(q)
    lse = torch.empty(B, N, H_q, device=DEV)
    ws = treeops.tree_attention_workspace(q, kc, bt)

    def step():
        treeops.kv_append(k, v, kc, vc, bt, seq, tree.num_nodes, tree.depth)
        treeops.tree_attention(q, kc, vc, bt, seq, tree, out=out, lse=lse, workspace=ws)

    def load(seed):
        r = random.Random(seed)
        new = _trees(
            B,
            N,
            ["random", "chain", "star", "inactive"],
            r,
            sizes=[r.randrange(1, N + 1) for _ in range(B)],
        )
        for f in ("num_nodes", "depth", "anc", "parents"):
            getattr(tree, f).copy_(getattr(new, f))
        seq.copy_(torch.tensor([r.randrange(0, (max_pages - 4) * page) for _ in range(B)]))
        bt.copy_(torch.randperm(P, device=DEV)[: B * max_pages].view(B, max_pages).int())
        q.copy_(torch.randn_like(q))
        k.copy_(torch.randn_like(k))
        v.copy_(torch.randn_like(v))

    load(0)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up: compile outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    for seed in range(1, 5):
        load(seed)
        kc_ref, vc_ref = kc.clone(), vc.clone()
        RK.kv_append(k, v, kc_ref, vc_ref, bt, seq, tree.num_nodes, tree.depth)
        ref, ref_lse = RA.tree_attention(q, kc_ref, vc_ref, bt, seq, tree, return_lse=True)
        g.replay()
        torch.cuda.synchronize()
        assert_close(kc, kc_ref, dt, f"k_cache replay {seed}")
        assert torch.equal(vc, vc_ref)
        assert_close(out, ref, dt, f"out replay {seed}")
        assert_close(lse, ref_lse, torch.float16, f"lse replay {seed}")


def test_pages_beyond_2_31():
    """A request whose pages sit past element 2^31 of each cache (int64 addressing)."""
    rng = random.Random(3)
    H_kv, D, page, H_q, N = 8, 128, 16, 32, 32
    per_page = page * H_kv * D
    P = (2**31) // per_page + 64
    dt = torch.bfloat16
    kc = torch.zeros(P, page, H_kv, D, device=DEV, dtype=dt)
    vc = torch.zeros(P, page, H_kv, D, device=DEV, dtype=dt)
    lens = [300, 700]
    pages = [-(-(L + N) // page) for L in lens]
    bt = torch.zeros(2, max(pages), dtype=torch.int32, device=DEV)
    bt[0, : pages[0]] = torch.arange(P - pages[0], P, device=DEV, dtype=torch.int32)  # the top
    bt[1, : pages[1]] = torch.arange(0, pages[1], device=DEV, dtype=torch.int32).flip(0)
    used = bt[bt >= 0].long().unique()
    kc[used] = torch.randn(len(used), page, H_kv, D, device=DEV, dtype=dt)
    vc[used] = torch.randn(len(used), page, H_kv, D, device=DEV, dtype=dt)
    assert int(bt[0].max()) * per_page > 2**31
    seq = torch.tensor(lens, dtype=torch.int32, device=DEV)
    tree = _trees(2, N, ["random", "binary"], rng)
    k = torch.randn(2, N, H_kv, D, device=DEV, dtype=dt)
    v = torch.randn(2, N, H_kv, D, device=DEV, dtype=dt)
    treeops.kv_append(k, v, kc, vc, bt, seq, tree.num_nodes, tree.depth)
    slot = lens[0] + 5
    kc_small = kc[bt[0].long()]  # the request's pages, gathered: a small cache for the reference
    vc_small = vc[bt[0].long()]
    ref_k = RK.rope(k[0, 5], torch.tensor(lens[0] + int(tree.depth[0, 5]), device=DEV))
    assert_close(kc_small[slot // page, slot % page], ref_k, dt, "appended K beyond 2^31")
    q = torch.randn(2, N, H_q, D, device=DEV, dtype=dt)
    out = treeops.tree_attention(q, kc, vc, bt, seq, tree)
    bt_small = torch.arange(pages[0], device=DEV, dtype=torch.int32)[None]
    sub = treeops.Tree(*(t[:1] for t in tree.tensors()))
    ref = RA.tree_attention(q[:1], kc_small, vc_small, bt_small, seq[:1], sub)
    assert_close(out[:1], ref, dt, "attention beyond 2^31")


MEMCHECK = [  # (B, ctx, N, H_q, H_kv, D, page, splits)
    (2, 70, 16, 8, 8, 64, 1, None),
    (3, 100, 32, 8, 2, 128, 16, None),
    (2, 130, 16, 16, 2, 256, 64, 3),
    (1, 200, 64, 32, 8, 128, None, 4),
    (4, 33, 8, 4, 1, 64, 16, 2),
]


@pytest.mark.parametrize("case", MEMCHECK, ids=lambda c: "-".join(map(str, c)))
def test_memcheck(case):
    B, ctx, N, H_q, H_kv, D, page, splits = case
    rng = random.Random(4)
    lens = [ctx + 11 * b for b in range(B)]
    tree = _trees(B, N, ["random", "inactive", "chain"], rng, sizes=[N, 0, N - 1])
    seq = torch.tensor(lens, dtype=torch.int32, device=DEV)
    kv = paged_kv([L + N for L in lens], page, H_kv, D, torch.float16, rng, device=DEV)
    q = torch.randn(B, N, H_q, D, device=DEV, dtype=torch.float16)
    _check(q, kv, seq, tree, torch.float16, num_splits=splits, what=str(case))
    k = torch.randn(B, N, H_kv, D, device=DEV, dtype=torch.float16)
    v = torch.randn_like(k)
    kc, vc = kv.k_cache.clone(), kv.v_cache.clone()
    treeops.kv_append(k, v, kv.k_cache, kv.v_cache, kv.block_table, seq, tree.num_nodes, tree.depth)
    RK.kv_append(k, v, kc, vc, kv.block_table, seq, tree.num_nodes, tree.depth)
    assert_close(kv.k_cache, kc, torch.float16, "k_cache")
    assert torch.equal(kv.v_cache, vc)


@pytest.mark.parametrize("D", sorted(K.TUNED), ids=lambda d: f"D{d}")
def test_memcheck_tuned_tiles(D):
    """The tiles ``TUNED`` routes full-wave launches to, forced on a small ragged batch (so that
    compute-sanitizer sees them without a wave of programs): empty, partial and multi-tile
    requests, a query range."""
    rng = random.Random(D)
    B, N, lens = 3, 64, [300, 77, 0]
    tree = _trees(B, N, ["random", "chain", "binary"], rng, sizes=[N, N - 5, 1])
    seq = torch.tensor(lens, dtype=torch.int32, device=DEV)
    kv = paged_kv([L + N for L in lens], 16, 8, D, torch.float16, rng, device=DEV)
    q = torch.randn(B, N, 32, D, device=DEV, dtype=torch.float16)
    override = K.CANDIDATES[D][K.TUNED[D]]
    _check(q, kv, seq, tree, torch.float16, override=override, what=f"D={D} {K.TUNED[D]}")
    qs = torch.tensor([0, 3, 0], dtype=torch.int32, device=DEV)
    ql = torch.tensor([7, 20, 1], dtype=torch.int32, device=DEV)
    _check(q, kv, seq, tree, torch.float16, qs, ql, override=override, what=f"D={D} range")


_GLUON = [(d, n) for d, c in K.CANDIDATES.items() for n, ov in c.items() if ov.get("gluon")]


@pytest.mark.parametrize("D,name", _GLUON, ids=lambda x: str(x))
@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("H_q,H_kv,page", [(32, 8, 16), (10, 2, 1)])
def test_memcheck_gluon_tiles(D, name, splits, H_q, H_kv, page):
    """The Gluon forward (``tree_attention_gluon``), which it must be (not the Triton kernel it
    falls back to), on a small ragged batch under compute-sanitizer: requests with several full
    prefix tiles, a partial tail, no prefix at all, one node; a query range; unsplit and split
    (the partials through ``_merge_splits``); GQA 4 on 16-slot pages and the trained pair's
    heads (a group of 5 padded to 8 rows a node) on 1-slot pages."""
    from treeops.kernels import tree_attention_gluon as KG

    rng = random.Random(D + len(name) + H_q)
    B, N, lens = 3, 64, [700, 77, 0]
    tree = _trees(B, N, ["random", "chain", "binary"], rng, sizes=[N, N - 5, 1])
    seq = torch.tensor(lens, dtype=torch.int32, device=DEV)
    kv = paged_kv([L + N for L in lens], page, H_kv, D, torch.float16, rng, device=DEV)
    q = torch.randn(B, N, H_q, D, device=DEV, dtype=torch.float16)
    override = K.CANDIDATES[D][name]
    assert K.config_for(q, kv.k_cache, kv.block_table, splits, override).gluon
    assert KG.launchable(q, kv.k_cache, kv.v_cache, torch.empty_like(q))
    what = f"D={D} {name} splits={splits}"
    _check(q, kv, seq, tree, torch.float16, num_splits=splits, override=override, what=what)
    qs = torch.tensor([0, 3, 0], dtype=torch.int32, device=DEV)
    ql = torch.tensor([7, 20, 1], dtype=torch.int32, device=DEV)
    _check(q, kv, seq, tree, torch.float16, qs, ql, num_splits=splits, override=override, what=what)

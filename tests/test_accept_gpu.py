"""GPU tests of acceptance (compiled kernels, realistic sizes); compaction's own are in
``test_compact_kv_gpu.py``, and this file's graph test captures both.

Skipped unless ``TREEOPS_GPU_TESTS=1`` on a CUDA machine. Fixed shapes (no hypothesis), so the
file also runs under ``compute-sanitizer --tool memcheck``:

    TREEOPS_GPU_TESTS=1 python -m pytest tests/test_accept_gpu.py -q
    TREEOPS_GPU_TESTS=1 compute-sanitizer --tool memcheck \
        python -m pytest tests/test_accept_gpu.py -q -k "not stress"
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from test_accept import assert_same, biased_logits, near_boundary

import treeops
from strategies import make_tree, parents_of
from treeops.kernels import _counters as kc
from treeops.kernels import accept as kacc
from treeops.kernels.accept import accept_launch
from treeops.reference import accept as ref

pytestmark = pytest.mark.gpu
DEV = os.environ.get("TREEOPS_GPU_TEST_DEVICE", "cuda")  # "cpu": a dry run of the test logic


def tree_batch(B: int, N: int, V: int, seed: int):
    rng = random.Random(seed)
    kinds = ["random", "chain", "binary", "star", "random", "single", "inactive"]
    rows = [
        parents_of(kinds[b % len(kinds)], N if b % 3 else rng.randint(1, N), rng) for b in range(B)
    ]
    if not any(rows):
        rows[0] = [-1]
    return make_tree(rows, N, V, rng), rng


@pytest.mark.parametrize(
    "B,N,V,dtype",
    [
        (4, 64, 128256, torch.bfloat16),
        (3, 16, 32000, torch.float16),
        (2, 64, 128256, torch.float32),
        (1, 64, 32000, torch.bfloat16),
        (1, 7, 32000, torch.bfloat16),  # top-K ids: 8 splits of 4,096, the last partial
        (9, 7, 151936, torch.bfloat16),
        (2, 16, 262144, torch.bfloat16),
        (3, 16, 32001, torch.bfloat16),  # rows not 16-byte aligned: element loads
    ],
)
@pytest.mark.parametrize("phase", [0, 1])
def test_greedy_gpu_matches_reference(B, N, V, dtype, phase):
    tree, rng = tree_batch(B, N, V, seed=B * 1000 + N)
    lg = biased_logits(tree, V, rng, ties=False, dtype=dtype, boost=0.0)  # bf16: real ties
    want = ref.accept_greedy(tree, lg, return_logprobs=True, topk_ids=8)
    tg, lgg = tree.to(DEV), lg.to(DEV)
    got = accept_launch(tg, lgg, return_logprobs=True, topk_ids=8, phase=phase)
    assert_same(Acc_cpu(got), want, lp_tol=5e-4)
    pub = treeops.accept_greedy(tg, lgg)
    assert torch.equal(pub.accepted.cpu(), want.accepted) and torch.equal(
        pub.bonus.cpu(), want.bonus
    )
    # every split count, pass 1's element loads and its block loaded ahead give the same
    # answer, and so do logits whose base is 2 bytes off (no vector load may assume alignment)
    off = torch.empty(lgg.numel() + 1, dtype=lgg.dtype, device=DEV)[1:].view(lgg.shape)
    off.copy_(lgg)
    for s, x, kw in ((1, lgg, {}), (8, lgg, {}), (8, lgg, dict(ahead=2)),
                     (8, lgg, dict(vector_loads=False)), (8, off, {})):  # fmt: skip
        r = accept_launch(tg, x, num_splits=s, phase=phase, topk_ids=3, **kw)
        assert torch.equal(r.accepted.cpu(), want.accepted) and torch.equal(
            r.bonus.cpu(), want.bonus
        )
        assert torch.equal(r.topk.cpu(), want.topk[..., :3])
    assert all(int(c.abs().sum()) == 0 for c in kc._COUNTERS.values())


def Acc_cpu(r):
    return treeops.Acceptance(*[None if t is None else t.cpu() for t in r])


@pytest.mark.parametrize(
    "B,N,V,dtype",
    [
        (4, 64, 128256, torch.bfloat16),
        (3, 16, 32000, torch.float32),
        (6, 32, 50000, torch.float16),
        (2, 16, 256000, torch.bfloat16),
        # a large tree: the walker's [nodes, nodes] tiles at 256
        (2, 200, 32000, torch.bfloat16),
    ],
)
@pytest.mark.parametrize("phase", [0, 1])
def test_sample_gpu_matches_reference(B, N, V, dtype, phase):
    tree, rng = tree_batch(B, N, V, seed=B * 7 + N)
    lg = biased_logits(tree, V, rng, ties=False, dtype=dtype, boost=4.0)
    T = torch.tensor([[0.0, 0.7, 1.0, 1.3][b % 4] for b in range(B)])
    k = torch.tensor([[0, 50, 1000, 0, 20][b % 5] for b in range(B)], dtype=torch.int32)
    p = torch.tensor([[1.0, 0.9, 0.95, 0.8][b % 4] for b in range(B)])
    stops = torch.tensor([5, 17, -1])
    bud = torch.tensor([[50, 3, 8][b % 3] for b in range(B)], dtype=torch.int32)
    for trial in range(3):
        u = torch.rand(B, N, generator=torch.Generator().manual_seed(trial))
        if near_boundary(tree, lg, T, k, p, u, stops, bud):
            continue
        want = ref.accept_sample(
            tree,
            lg,
            T,
            k,
            p,
            u,
            stop_ids=stops,
            max_new_tokens=bud,
            return_logprobs=True,
            topk_ids=4,
        )
        args = [t.to(DEV) for t in (T, k, p, u)]
        got = accept_launch(
            tree.to(DEV),
            lg.to(DEV),
            temperature=args[0],
            top_k=args[1],
            top_p=args[2],
            uniforms=args[3],
            stop_ids=stops.to(DEV),
            max_new_tokens=bud.to(DEV),
            return_logprobs=True,
            topk_ids=4,
            phase=phase,
        )
        assert_same(Acc_cpu(got), want, lp_tol=5e-4)
        # pass 1 with one block and two in flight (the default takes either by the launch's
        # size), pass 2's reread tiles and warps of the sweep
        # and the exact search's tiles and pivots (rows with k 1,000 take it)
        tunes = (dict(ahead=1), dict(ahead=2), dict(reread=256, pass2_warps=8),
                 dict(reread=512, pass2_warps=2), dict(exact_tile=128, num_pivots=16),
                 dict(exact_tile=2048, num_pivots=1))  # fmt: skip
        for tune in tunes if trial == 0 else ():
            got = accept_launch(
                tree.to(DEV), lg.to(DEV), temperature=args[0], top_k=args[1], top_p=args[2],
                uniforms=args[3], stop_ids=stops.to(DEV), max_new_tokens=bud.to(DEV),
                return_logprobs=True, topk_ids=4, phase=phase, **tune,
            )  # fmt: skip
            assert_same(Acc_cpu(got), want, lp_tol=5e-4)
        # top-p alone (no top-k tensor: top-k off for every request)
        if not near_boundary(tree, lg, T, torch.zeros_like(k), p, u, stops, bud):
            want = ref.accept_sample(
                tree, lg, T, None, p, u, stop_ids=stops, max_new_tokens=bud,
                return_logprobs=True, topk_ids=4,
            )  # fmt: skip
            got = accept_launch(
                tree.to(DEV), lg.to(DEV), temperature=args[0], top_k=None, top_p=args[2],
                uniforms=args[3], stop_ids=stops.to(DEV), max_new_tokens=bud.to(DEV),
                return_logprobs=True, topk_ids=4, phase=phase,
            )  # fmt: skip
            assert_same(Acc_cpu(got), want, lp_tol=5e-4)
        # without top-k / top-p tensors: no kept-set pass (one launch with phase 0 where the
        # blocks allow it, else pass 1 and the walk)
        if near_boundary(tree, lg, T, torch.zeros_like(k), torch.ones_like(p), u, stops, bud):
            continue
        want = ref.accept_sample(tree, lg, T, None, None, u, stop_ids=stops,
                                 max_new_tokens=bud, return_logprobs=True, topk_ids=4)  # fmt: skip
        got = accept_launch(
            tree.to(DEV), lg.to(DEV), temperature=args[0], top_k=None, top_p=None,
            uniforms=args[3], stop_ids=stops.to(DEV), max_new_tokens=bud.to(DEV),
            return_logprobs=True, topk_ids=4, phase=phase,
        )  # fmt: skip
        assert_same(Acc_cpu(got), want, lp_tol=5e-4)


def test_cuda_graph_capture_and_replay():
    """greedy -> compact and sampling captured in one CUDA graph through the public ops;
    replays on fresh inputs match eager runs, and the arrival counters end at zero."""
    B, N, V = 8, 64, 128256
    tree, rng = tree_batch(B, N, V, seed=3)
    tree = tree.to(DEV)
    lg = torch.empty(B, N, V, device=DEV, dtype=torch.bfloat16)
    T = torch.full((B,), 0.8, device=DEV)
    k = torch.full((B,), 40, device=DEV, dtype=torch.int32)
    p = torch.full((B,), 0.9, device=DEV)
    u = torch.empty(B, N, device=DEV)
    L, H, D, ps = 4, 8, 128, 16
    seq = torch.full((B,), 100, device=DEV, dtype=torch.int32)
    pages = -(-(100 + N) // ps)
    bt = torch.arange(B * pages, device=DEV, dtype=torch.int32).reshape(B, pages)
    k_cache = torch.empty(L, B * pages, ps, H, D, device=DEV, dtype=torch.bfloat16)
    v_cache = torch.empty_like(k_cache)

    def fill(seed):
        g = torch.Generator(device=DEV).manual_seed(seed)
        cpu_rng = random.Random(seed)
        lg.copy_(
            biased_logits(
                tree.to("cpu"), V, cpu_rng, ties=False, dtype=torch.bfloat16, boost=3.0
            ).to(DEV)
        )
        u.copy_(torch.rand(B, N, device=DEV, generator=g))
        k_cache.copy_(torch.randn(k_cache.shape, device=DEV, generator=g).to(k_cache.dtype))
        v_cache.copy_(torch.randn(v_cache.shape, device=DEV, generator=g).to(v_cache.dtype))

    def step():
        g = treeops.accept_greedy(tree, lg, return_logprobs=True, topk_ids=4)
        new = treeops.compact_kv(k_cache, v_cache, bt, seq, tree, g.accepted, g.accept_len)
        s = treeops.accept_sample(tree, lg, T, k, p, u, return_logprobs=True)
        return g, new, s

    fill(0)
    step()  # compile, allocate counters
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    for seed in (1, 2, 3):
        fill(seed)
        k0, v0 = k_cache.clone(), v_cache.clone()
        graph.replay()
        torch.cuda.synchronize()
        got_k, got_v = k_cache.clone(), v_cache.clone()
        k_cache.copy_(k0)
        v_cache.copy_(v0)
        eager = step()
        torch.cuda.synchronize()
        for a, b in zip(static[0], eager[0]):
            if a is not None:
                assert torch.equal(a, b)
        assert torch.equal(static[1], eager[1])
        for a, b in zip(static[2], eager[2]):
            if a is not None:
                assert torch.equal(a, b)
        assert torch.equal(got_k, k_cache) and torch.equal(got_v, v_cache)
        assert int(static[0].accept_len.float().mean()) >= 1
    assert all(int(c.abs().sum()) == 0 for c in kc._COUNTERS.values())


@pytest.mark.parametrize("trunc", [True, False])
@pytest.mark.parametrize("B,V", [(1, 128256), (8, 32000)])
def test_sample_pdl_matches_plain(B, V, trunc, monkeypatch):
    """Sampling's pass 2 and walk chained to pass 1 by programmatic dependent launch
    (kernels/_pdl.py; the default on sm_90 where B * N is at most the SMs, forced here) give
    bitwise the results of plain launches, eagerly and replayed in a CUDA graph with new logits
    and uniforms: every launch waits for the one before it before it touches memory, wherever
    the one before released it."""
    from treeops.kernels import _pdl

    if DEV == "cpu" or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90")
    N = 64
    tree, rng = tree_batch(B, N, V, seed=B + V)
    tree = tree.to(DEV)
    lg = torch.empty(B, N, V, device=DEV, dtype=torch.bfloat16)
    u = torch.empty(B, N, device=DEV)
    T = torch.tensor([[0.7, 1.0, 1.3, 0.0][b % 4] for b in range(B)], device=DEV)
    k = torch.tensor([[50, 0, 1000, 20][b % 4] for b in range(B)], device=DEV, dtype=torch.int32)
    p = torch.tensor([[0.9, 0.8, 1.0, 0.95][b % 4] for b in range(B)], device=DEV)
    kw = dict(top_k=k, top_p=p) if trunc else dict(top_k=None, top_p=None)

    def launch(pdl: int) -> treeops.Acceptance:
        monkeypatch.setattr(kacc, "use_pdl", lambda device, default=0: pdl)
        kacc._PLANS.clear()  # a plan keeps its launch options
        try:
            return accept_launch(tree, lg, temperature=T, uniforms=u, return_logprobs=True, **kw)
        finally:
            kacc._PLANS.clear()

    def fill(seed: int) -> None:
        g = torch.Generator(device=DEV).manual_seed(seed)
        cpu_lg = biased_logits(tree.to("cpu"), V, random.Random(seed), ties=False,
                               dtype=torch.bfloat16, boost=3.0)  # fmt: skip
        lg.copy_(cpu_lg.to(DEV))
        u.copy_(torch.rand(B, N, device=DEV, generator=g))

    on = _pdl.PDL_LATE.value
    fill(0)
    launch(0), launch(on)  # compile both outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    monkeypatch.setattr(kacc, "use_pdl", lambda device, default=0: on)
    kacc._PLANS.clear()
    with torch.cuda.graph(graph):
        static = accept_launch(tree, lg, temperature=T, uniforms=u, return_logprobs=True, **kw)
    for rep in range(1, 7):
        fill(rep)
        if rep % 2:
            graph.replay()
            piped = static
        else:
            piped = launch(on)
        plain = launch(0)
        torch.cuda.synchronize()
        assert_same(Acc_cpu(piped), Acc_cpu(plain), lp_tol=0.0)


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs"
)
def test_public_ops_launch_on_their_tensors_device():
    """With cuda:0 current, accept_greedy on cuda:1 tensors launches on cuda:1 and matches the
    reference (every public op switches the same way, through ``_checks.cuda_device``)."""
    B, N, V = 3, 16, 32000
    tree, rng = tree_batch(B, N, V, seed=7)
    lg = biased_logits(tree, V, rng, ties=False, dtype=torch.bfloat16, boost=0.0)
    want = ref.accept_greedy(tree, lg)
    torch.cuda.set_device(0)
    launched_on = []
    launch = kacc.accept_launch

    def recording(*a, **k):
        launched_on.append(torch.cuda.current_device())
        return launch(*a, **k)

    kacc.accept_launch = recording  # what treeops.accept imports at call time
    try:
        got = treeops.accept_greedy(tree.to("cuda:1"), lg.to("cuda:1"))
    finally:
        kacc.accept_launch = launch
    assert launched_on == [1] and torch.cuda.current_device() == 0
    assert_same(Acc_cpu(got), want)

"""GPU tests of KV append and RoPE (compiled kernels, realistic sizes; the combined capture with
tree attention is in ``test_tree_attention_gpu.py``).

Run on the H200: ``TREEOPS_GPU_TESTS=1 python -m pytest tests/test_kv_append_gpu.py``; fixed
shapes, so ``compute-sanitizer --tool memcheck`` runs the whole file.
"""

from __future__ import annotations

import random

import pytest
import torch

import treeops
from helpers import assert_close
from strategies import make_tree, paged_kv, parents_of
from treeops.reference import kv_append as RK

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.mark.parametrize("seq_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(
    "B,ctx,N,H_kv,D,page,dtype",
    [
        (4, 1000, 64, 8, 128, 16, torch.bfloat16),
        (3, 517, 7, 2, 64, 1, torch.float16),
        (2, 300, 33, 4, 256, 64, torch.float32),
    ],
)
def test_kv_append_matches_reference(B, ctx, N, H_kv, D, page, dtype, seq_dtype):
    rng = random.Random(B * N)
    rows = [parents_of(("random", "chain", "star")[b % 3], N, rng) for b in range(B)]
    tree = make_tree(rows, N, 64, rng).to(DEV)
    seq = torch.tensor([rng.randint(0, ctx) for _ in range(B)], dtype=seq_dtype, device=DEV)
    kv = paged_kv([int(s) + N for s in seq], page, H_kv, D, dtype, rng, device=DEV)
    # k and v as strided views of one fused projection, as an engine's QKV GEMM leaves them
    kvp = torch.randn(B, N, 2 * H_kv * D + 8, device=DEV, dtype=dtype)
    k = kvp[..., : H_kv * D].view(B, N, H_kv, D)
    v = kvp[..., H_kv * D : 2 * H_kv * D].view(B, N, H_kv, D)
    kc, vc = kv.k_cache.clone(), kv.v_cache.clone()
    treeops.kv_append(
        k, v, kv.k_cache, kv.v_cache, kv.block_table, seq, tree.num_nodes, tree.depth,
        validate=True,
    )  # fmt: skip
    RK.kv_append(k, v, kc, vc, kv.block_table, seq, tree.num_nodes, tree.depth)
    assert_close(kv.k_cache, kc, dtype, "k_cache")
    assert torch.equal(kv.v_cache, vc)


def _qkv(B, N, H_q, H_kv, D, dtype, g=None):
    """q, k, v as strided views of one fused QKV projection output, as the decoder passes them."""
    qkv = torch.randn(B, N, (H_q + 2 * H_kv) * D, device=DEV, dtype=dtype, generator=g)
    q = qkv[..., : H_q * D].unflatten(-1, (H_q, D))
    k = qkv[..., H_q * D : (H_q + H_kv) * D].unflatten(-1, (H_kv, D))
    v = qkv[..., (H_q + H_kv) * D :].unflatten(-1, (H_kv, D))
    return q, k, v


def _rotated_rows(q0, seq, num, depth):
    """What kv_append(..., q=q) leaves in q: rows i < num[b] rotated at seq[b] + depth[b, i]."""
    want = q0.clone()
    for b in range(q0.shape[0]):
        n = int(num[b])
        pos = seq[b].long() + depth[b, :n].long()
        want[b, :n] = RK.rope(q0[b, :n], pos)
    return want


@pytest.mark.parametrize(
    "B,ctx,N,H_q,H_kv,D,page,dtype",
    [
        (4, 1000, 64, 32, 8, 128, 16, torch.bfloat16),
        (3, 517, 7, 2, 2, 64, 1, torch.float16),
        (2, 300, 33, 16, 4, 256, 64, torch.float32),
        (8, 4096, 10, 64, 8, 128, 16, torch.bfloat16),
    ],
)
def test_kv_append_with_q_matches_reference(B, ctx, N, H_q, H_kv, D, page, dtype):
    rng = random.Random(B * N + H_q)
    rows = [parents_of(("random", "chain", "star")[b % 3], N - b % 2, rng) for b in range(B)]
    tree = make_tree(rows, N, 64, rng).to(DEV)
    seq = torch.tensor([rng.randint(0, ctx) for _ in range(B)], dtype=torch.int32, device=DEV)
    kv = paged_kv([int(s) + N for s in seq], page, H_kv, D, dtype, rng, device=DEV)
    q, k, v = _qkv(B, N, H_q, H_kv, D, dtype)
    q0, k0 = q.clone(), k.clone()
    kc, vc = kv.k_cache.clone(), kv.v_cache.clone()
    treeops.kv_append(
        k, v, kv.k_cache, kv.v_cache, kv.block_table, seq, tree.num_nodes, tree.depth, q=q,
        validate=True,
    )  # fmt: skip
    RK.kv_append(k, v, kc, vc, kv.block_table, seq, tree.num_nodes, tree.depth)
    assert_close(kv.k_cache, kc, dtype, "k_cache")
    assert torch.equal(kv.v_cache, vc)
    assert torch.equal(k, k0), "k and v, next to q in the projection's buffer, are not written"
    want = _rotated_rows(q0, seq, tree.num_nodes, tree.depth)
    assert_close(q, want, dtype, "q")
    for b in range(B):  # rows past num_nodes untouched
        assert torch.equal(q[b, int(tree.num_nodes[b]) :], q0[b, int(tree.num_nodes[b]) :])


def test_kv_append_with_q_is_graph_capturable():
    """Captured once, replayed with new inputs in the same buffers: K/V land at the new
    slots and q (rotated in place on every replay) at the new positions."""
    B, N, H_q, H_kv, D, dtype = 4, 16, 32, 8, 128, torch.bfloat16
    rng = random.Random(7)
    tree = make_tree([parents_of("random", N, rng) for _ in range(B)], N, 64, rng).to(DEV)
    seq = torch.tensor([rng.randint(0, 2000) for _ in range(B)], dtype=torch.int32, device=DEV)
    kv = paged_kv([2000 + N] * B, 16, H_kv, D, dtype, rng, device=DEV)
    q, k, v = _qkv(B, N, H_q, H_kv, D, dtype)

    def call():
        treeops.kv_append(k, v, kv.k_cache, kv.v_cache, kv.block_table, seq, tree.num_nodes,
                          tree.depth, q=q)  # fmt: skip

    call()  # warm-up: compiles and builds the frequency table
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call()
    g2 = torch.Generator(device=DEV).manual_seed(1)
    for buf in (q, k, v):
        buf.copy_(torch.randn(buf.shape, device=DEV, dtype=dtype, generator=g2))
    seq.copy_(torch.tensor([rng.randint(0, 2000) for _ in range(B)], dtype=torch.int32))
    q0 = q.clone()
    kc, vc = kv.k_cache.clone(), kv.v_cache.clone()
    RK.kv_append(k, v, kc, vc, kv.block_table, seq, tree.num_nodes, tree.depth)
    g.replay()
    torch.cuda.synchronize()
    assert_close(kv.k_cache, kc, dtype, "replayed k_cache")
    assert torch.equal(kv.v_cache, vc)
    assert_close(q, _rotated_rows(q0, seq, tree.num_nodes, tree.depth), dtype, "replayed q")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1, 10, 64), (64, 60, 32, 128), (3, 5, 7, 256)])
def test_rope_matches_reference(shape, dtype):
    B, N, H, D = shape
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(B, N, 3 * H * D, device=DEV, dtype=dtype, generator=g)[..., : H * D]
    x = x.view(B, N, H, D)
    pos = torch.randint(0, 1 << 17, (B, N), device=DEV, generator=g)
    assert_close(treeops.rope(x, pos), RK.rope(x, pos), dtype, "rope")
    # other ranks reach the same kernel through views
    assert_close(treeops.rope(x[0], pos[0]), RK.rope(x[0], pos[0]), dtype, "rope 3-d")


def test_rope_is_graph_capturable():
    x = torch.randn(4, 8, 16, 64, device=DEV, dtype=torch.bfloat16)
    pos = torch.randint(0, 4096, (4, 8), device=DEV)
    treeops.rope(x, pos)  # warm-up: compiles and builds the frequency table
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = treeops.rope(x, pos)
    pos.copy_(torch.randint(0, 4096, (4, 8), device=DEV))
    g.replay()
    torch.cuda.synchronize()
    assert_close(y, RK.rope(x, pos), torch.bfloat16, "replayed rope")

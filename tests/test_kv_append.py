"""KV append with RoPE: reference against an independent float64 rotation, the Triton kernel
(under the interpreter) against the reference, the queries rotated in place (``q=``), the
``rope`` helper, and input checks."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import treeops
from helpers import assert_close, small_step
from strategies import paged_kv, trees
from treeops.kernels import kv_append as KA
from treeops.reference import kv_append as RK


def rotate_f64(x: torch.Tensor, pos: int, theta: float) -> torch.Tensor:
    """Llama rotate_half RoPE of one [D] vector, pair (k, k + D/2) rotated by pos·theta^(-2k/D)."""
    d = x.shape[-1]
    out = torch.empty(d, dtype=torch.float64)
    for k in range(d // 2):
        a = pos * theta ** (-2 * k / d)
        x1, x2 = float(x[k]), float(x[k + d // 2])
        out[k] = x1 * math.cos(a) - x2 * math.sin(a)
        out[k + d // 2] = x2 * math.cos(a) + x1 * math.sin(a)
    return out


def test_rope_reference_matches_float64_rotation():
    x = torch.randn(3, 2, 64)
    pos = torch.tensor([0, 7, 93])
    y = RK.rope(x, pos, 10000.0)
    for i in range(3):
        for h in range(2):
            # fp32 angles (pos · inv_freq rounded): a few ulps of the angle, so fp16's tolerance
            assert_close(y[i, h], rotate_f64(x[i, h], int(pos[i]), 10000.0), torch.float16)
    assert torch.equal(RK.rope(x, torch.zeros(3, dtype=torch.int64)), x)


def test_rope_is_relative():
    """<rope(q, m), rope(k, n)> depends on m - n only (the property RoPE exists for)."""
    q, k = torch.randn(1, 1, 128, dtype=torch.float64), torch.randn(1, 1, 128, dtype=torch.float64)

    def dot(m, n):
        return float((RK.rope(q, torch.tensor([m])) * RK.rope(k, torch.tensor([n]))).sum())

    assert math.isclose(dot(10, 3), dot(57, 50), rel_tol=1e-5)


def test_public_rope_helper():
    x = torch.randn(2, 4, 8, 64, dtype=torch.bfloat16)
    pos = torch.randint(0, 500, (2, 4))
    assert torch.equal(treeops.rope(x, pos), RK.rope(x, pos))
    with pytest.raises(ValueError, match=r"Invalid shape of positions: expected \[2, 4\]"):
        treeops.rope(x, torch.zeros(2, dtype=torch.int64))


def brute_force(k, v, kc, vc, bt, seq, nt, depth, theta):
    """Expected caches: a copy with each written slot set from the float64 rotation."""
    kc, vc = kc.clone(), vc.clone()
    ps = kc.shape[1]
    for b in range(k.shape[0]):
        for i in range(int(nt[b])):
            slot = int(seq[b]) + i
            pos = int(seq[b]) + (i if depth is None else int(depth[b, i]))
            page, row = int(bt[b, slot // ps]), slot % ps
            for h in range(k.shape[2]):
                kc[page, row, h] = rotate_f64(k[b, i, h].float(), pos, theta).to(kc.dtype)
            vc[page, row] = v[b, i]
    return kc, vc


def test_reference_matches_brute_force():
    rng = random.Random(0)
    seq = torch.tensor([5, 0, 17], dtype=torch.int32)
    nt = torch.tensor([3, 4, 0], dtype=torch.int32)
    depth = torch.tensor([[0, 1, 1, 0], [0, 1, 2, 3], [0, 0, 0, 0]], dtype=torch.int32)
    kv = paged_kv([9, 4, 21], 4, 2, 64, torch.float32, rng)
    k, v = torch.randn(3, 4, 2, 64), torch.randn(3, 4, 2, 64)
    for dep in (depth, None):
        kc, vc = kv.k_cache.clone(), kv.v_cache.clone()
        RK.kv_append(k, v, kc, vc, kv.block_table, seq, nt, dep, rope_theta=500.0)
        ek, ev = brute_force(k, v, kv.k_cache, kv.v_cache, kv.block_table, seq, nt, dep, 500.0)
        assert_close(kc, ek, torch.float16, "k_cache")  # fp32 angles vs float64 (see above)
        assert torch.equal(vc, ev)


@given(tc=trees(max_batch=3, capacities=(1, 4, 8, 16, 32, 64)), data=st.data())
def test_kernel_matches_reference(tc, data):
    rng = random.Random(data.draw(st.integers(0, 2**16)))
    B, N = tc.tree.batch_size, tc.tree.capacity
    H_kv = data.draw(st.sampled_from([1, 2, 4]))
    D = data.draw(st.sampled_from([64, 64, 128]))
    dtype = data.draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))
    page = data.draw(st.sampled_from([1, 16, 64, None]))
    seq = torch.tensor([data.draw(st.integers(0, 80)) for _ in range(B)], dtype=torch.int32)
    kv = paged_kv(
        [int(s) + N for s in seq], page, H_kv, D, dtype, rng, strided=data.draw(st.booleans())
    )
    k = torch.randn(B, N, H_kv, D).to(dtype)
    v = torch.randn(B, N, H_kv, D).to(dtype)
    if data.draw(st.booleans()):  # strided k
        k = torch.randn(B, H_kv, N, D).to(dtype).transpose(1, 2)
    depth = tc.tree.depth if data.draw(st.booleans()) else None
    theta = data.draw(st.sampled_from([10000.0, 500000.0]))
    kc, vc = kv.k_cache.clone(), kv.v_cache.clone()
    RK.kv_append(k, v, kc, vc, kv.block_table, seq, tc.tree.num_nodes, depth, rope_theta=theta)
    KA.kv_append_fwd(
        k, v, kv.k_cache, kv.v_cache, kv.block_table, seq, tc.tree.num_nodes, depth, theta
    )
    assert_close(kv.k_cache, kc, dtype, "k_cache")
    assert torch.equal(kv.v_cache, vc), "V is copied bit for bit, other slots untouched"
    # untouched slots are bit-identical too (assert_close is relative to the whole cache)
    changed = kc != kv.k_cache
    written = torch.zeros_like(changed)
    for b in range(B):
        for i in range(int(tc.tree.num_nodes[b])):
            s = int(seq[b]) + i
            written[int(kv.block_table[b, s // kv.page_size]), s % kv.page_size] = True
    assert not bool(changed[~written].any())


def _queries(B, N, H_q, D, dtype, layout):
    """q [B, N, H_q, D] and the buffer it lives in: dense, a view of a fused QKV projection's
    output (the decoder's case: row stride past H_q·D), or heads-major (transposed)."""
    if layout == "qkv":
        buf = torch.randn(B, N, (H_q + 3) * D).to(dtype)
        return buf[..., : H_q * D].view(B, N, H_q, D), buf
    if layout == "heads_major":
        buf = torch.randn(B, H_q, N, D).to(dtype)
        return buf.transpose(1, 2), buf
    buf = torch.randn(B, N, H_q, D).to(dtype)
    return buf, buf


@given(tc=trees(max_batch=3, capacities=(1, 4, 8, 16, 32)), data=st.data())
def test_kernel_rotates_q_like_rope(tc, data):
    """With ``q``: rows i < num_tokens[b] become rope(q, seq_lens[b] + depth[b, i]) (the
    reference exactly, the kernel within the dtype's tolerance), every other element of q's
    buffer is untouched, and the caches are written as without q."""
    rng = random.Random(data.draw(st.integers(0, 2**16)))
    B, N = tc.tree.batch_size, tc.tree.capacity
    H_kv = data.draw(st.sampled_from([1, 2]))
    H_q = H_kv * data.draw(st.sampled_from([1, 2, 4]))
    D = data.draw(st.sampled_from([64, 128]))
    dtype = data.draw(st.sampled_from([torch.float16, torch.bfloat16, torch.float32]))
    layout = data.draw(st.sampled_from(["dense", "qkv", "heads_major"]))
    seq = torch.tensor([data.draw(st.integers(0, 80)) for _ in range(B)], dtype=torch.int32)
    kv = paged_kv([int(s) + N for s in seq], data.draw(st.sampled_from([1, 16, None])), H_kv, D,
                  dtype, rng)  # fmt: skip
    k, v = torch.randn(B, N, H_kv, D).to(dtype), torch.randn(B, N, H_kv, D).to(dtype)
    depth = tc.tree.depth if data.draw(st.booleans()) else None
    nt = tc.tree.num_nodes
    q, buf = _queries(B, N, H_q, D, dtype, layout)
    buf0 = buf.clone()
    q0 = q.clone()

    rq, kc, vc = q0.clone(), kv.k_cache.clone(), kv.v_cache.clone()
    RK.kv_append(k, v, kc, vc, kv.block_table, seq, nt, depth, q=rq, rope_theta=500000.0)
    KA.kv_append_fwd(k, v, kv.k_cache, kv.v_cache, kv.block_table, seq, nt, depth, 500000.0, q)

    want = q0.clone()
    for b in range(B):
        n = int(nt[b])
        i = torch.arange(n)
        pos = int(seq[b]) + (i if depth is None else depth[b, :n].long())
        want[b, :n] = RK.rope(q0[b, :n], pos, 500000.0)
    assert torch.equal(rq, want), "the reference rotates q as rope does, rows >= n untouched"
    assert_close(q, want, dtype, "q")
    for b in range(B):  # rows past num_tokens bit-identical (assert_close is relative)
        assert torch.equal(q[b, int(nt[b]) :], q0[b, int(nt[b]) :])
    if layout == "qkv":  # the K/V part of the projection's buffer is not q's
        assert torch.equal(buf[..., H_q * D :], buf0[..., H_q * D :])
    assert_close(kv.k_cache, kc, dtype, "k_cache")
    assert torch.equal(kv.v_cache, vc)


def test_public_op_rotates_q_in_place():
    """CPU backend (the reference) through the public op, q a strided view; no depth."""
    a = _args()
    q, _ = _queries(2, 8, 4, 64, torch.float16, "qkv")
    q0 = q.clone()
    treeops.kv_append(**a, q=q, validate=True)
    seq, nt = a["seq_lens"], a["num_tokens"]
    for b in range(2):
        n = int(nt[b])
        pos = int(seq[b]) + torch.arange(n)
        assert torch.equal(q[b, :n], RK.rope(q0[b, :n], pos))
        assert torch.equal(q[b, n:], q0[b, n:])


def _args(**changes):
    rng = random.Random(1)
    kv = paged_kv([24, 24], 16, 2, 64, torch.float16, rng)
    a = dict(
        k=torch.randn(2, 8, 2, 64).half(),
        v=torch.randn(2, 8, 2, 64).half(),
        k_cache=kv.k_cache,
        v_cache=kv.v_cache,
        block_table=kv.block_table,
        seq_lens=torch.tensor([16, 3], dtype=torch.int32),
        num_tokens=torch.tensor([8, 2], dtype=torch.int32),
    )
    a.update(changes)
    return a


def test_public_op_on_cpu_is_the_reference():
    a = _args()
    kc, vc = a["k_cache"].clone(), a["v_cache"].clone()
    RK.kv_append(a["k"], a["v"], kc, vc, a["block_table"], a["seq_lens"], a["num_tokens"])
    assert treeops.kv_append(**a, validate=True) is None
    assert torch.equal(a["k_cache"], kc) and torch.equal(a["v_cache"], vc)


@pytest.mark.parametrize(
    "changes,message",
    [
        (
            dict(k=torch.randn(2, 8, 2, 64)),
            "Invalid dtype of v: expected torch.float32, got torch.float16",
        ),
        (
            dict(k=torch.randn(2, 8, 2, 48).half()),
            "Invalid head dim of k: expected one of (64, 128, 256), got 48",
        ),
        (
            dict(v=torch.randn(2, 8, 3, 64).half()),
            "Invalid shape of v: expected [2, 8, 2, 64], got [2, 8, 3, 64]",
        ),
        (dict(k_cache=torch.zeros(3, 16, 2, 64, dtype=torch.bfloat16)), "Invalid dtype of k_cache"),
        (dict(block_table=torch.zeros(2, 2, dtype=torch.int64)), "Invalid dtype of block_table"),
        (
            dict(num_tokens=torch.zeros(3, dtype=torch.int32)),
            "Invalid shape of num_tokens: expected [2], got [3]",
        ),
        (
            dict(depth=torch.zeros(2, 7, dtype=torch.int32)),
            "Invalid shape of depth: expected [2, 8], got [2, 7]",
        ),
        (dict(rope_theta=0.0), "Invalid value of rope_theta"),
        (
            dict(seq_lens=torch.zeros(2, dtype=torch.int32, device="meta")),
            "Invalid device of seq_lens",
        ),
        (
            dict(q=torch.randn(2, 8, 3, 64).half()),
            "Invalid shape of q: expected a multiple of H_kv = 2 query heads (dim 2), got 3",
        ),
        (dict(q=torch.randn(2, 8, 4, 64)), "Invalid dtype of q: expected torch.float16"),
        (
            dict(q=torch.randn(2, 7, 4, 64).half()),
            "Invalid shape of q: expected [2, 8, *, 64], got [2, 7, 4, 64]",
        ),
        (
            dict(q=torch.randn(2, 8, 4, 128).half()),
            "Invalid shape of q: expected [2, 8, *, 64], got [2, 8, 4, 128]",
        ),
        (
            dict(q=torch.randn(2, 8, 1, 64).half().expand(2, 8, 4, 64)),
            "Invalid stride of q: expected no stride-0 (expanded) dimension",
        ),
        (
            dict(q=torch.zeros(2, 8, 4, 64, dtype=torch.float16, device="meta")),
            "Invalid device of q",
        ),
    ],
)
def test_public_op_rejects_bad_input(changes, message):
    with pytest.raises(ValueError) as e:
        treeops.kv_append(**_args(**changes))
    assert message in str(e.value)


def test_validate_checks_capacity_and_ranges():
    with pytest.raises(ValueError, match="exceeds the block table's capacity of 32 slots"):
        treeops.kv_append(**_args(seq_lens=torch.tensor([30, 0], dtype=torch.int32)), validate=True)
    with pytest.raises(ValueError, match="Invalid value in num_tokens: expected < 9, got 9"):
        treeops.kv_append(
            **_args(num_tokens=torch.tensor([9, 0], dtype=torch.int32)), validate=True
        )


def test_opcheck_kv_append_and_rope():
    s = small_step()
    t = s["tree"]
    torch.library.opcheck(
        torch.ops.treeops.kv_append.default,
        (s["k"], s["v"], s["k_cache"], s["v_cache"], s["block_table"], s["seq_lens"],
         t.num_nodes, t.depth, 10000.0),
    )  # fmt: skip
    # with q (mutated in place), a strided view as the decoder's fused QKV output gives it
    q = torch.randn(2, 4, 4 * 64)[..., : 2 * 64].unflatten(-1, (2, 64))
    torch.library.opcheck(
        torch.ops.treeops.kv_append.default,
        (s["k"], s["v"], s["k_cache"], s["v_cache"], s["block_table"], s["seq_lens"],
         t.num_nodes, t.depth, 10000.0, q),
    )  # fmt: skip
    torch.library.opcheck(
        torch.ops.treeops.rope.default, (s["q"], t.positions(s["seq_lens"]), 10000.0)
    )


def test_rope_kernel_matches_reference_on_strided_input():
    """The CUDA path's kernel (interpreted): a q view of a fused QKV output, every position
    dtype, against the reference's fp32 angles."""
    torch.manual_seed(0)
    for (B, N, H, D), dt in (((2, 3, 5, 64), torch.float32), ((1, 7, 2, 128), torch.float16)):
        x = torch.randn(B, N, 3 * H * D, dtype=dt)[..., : H * D].view(B, N, H, D)
        for pdt in (torch.int32, torch.int64):
            pos = torch.randint(0, 5000, (B, N), dtype=pdt)
            y = torch.empty(B, N, H, D, dtype=dt)
            KA.rope_fwd(x, pos, 10000.0, y)
            assert_close(y, RK.rope(x, pos, 10000.0), dt, "rope")

"""``pass2_phases``: its sort-free k-th largest (the ``bound_radix`` phase) against a sort, under
the interpreter on CPU (the phase timings themselves need a GPU)."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from pass2_phases import _kth_largest


@triton.jit
def _kth_kernel(p_v, p_k, p_out, GC: tl.constexpr):
    v = tl.load(p_v + tl.arange(0, GC)).to(tl.float32)
    tl.store(p_out, _kth_largest(v, tl.load(p_k), GC))


@pytest.mark.parametrize("seed", range(6))
def test_kth_largest_matches_a_sort(seed):
    g = torch.Generator().manual_seed(seed)
    GC = 16
    # ties, both zeros, -inf padding and values of both signs
    pool = torch.tensor([-float("inf"), -3.5, -1.0, -0.0, 0.0, 1e-30, 0.25, 2.0, 7.0, 1e30])
    v = pool[torch.randint(0, len(pool), (GC,), generator=g)]
    if seed % 2:
        v = torch.randn(GC, generator=g) * 10
    for k in range(1, GC + 1):
        out = torch.empty(1)
        _kth_kernel[(1,)](v, torch.tensor([k], dtype=torch.int32), out, GC=GC)
        want = torch.sort(v, descending=True).values[k - 1]
        assert out.item() == want.item(), (k, v.tolist())

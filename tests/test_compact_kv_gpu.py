"""GPU tests of KV compaction (compiled kernel, realistic sizes).

Skipped unless ``TREEOPS_GPU_TESTS=1`` on a CUDA machine. Fixed shapes, so the file also runs
under ``compute-sanitizer --tool memcheck``:

    TREEOPS_GPU_TESTS=1 python -m pytest tests/test_compact_kv_gpu.py -q
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from treeops.kernels.compact_kv import compact_kv_launch

pytestmark = pytest.mark.gpu
DEV = os.environ.get("TREEOPS_GPU_TEST_DEVICE", "cuda")  # "cpu": a dry run of the test logic


STRESS_SHAPE = (8, 256, 4, 8, 128)  # B, N, layers, KV heads, head dim


def _phys(bt: torch.Tensor, slots: torch.Tensor, ps: int):
    """(page, offset) of logical slots [B, M] through the block table."""
    return bt.gather(1, (slots // ps).long()).long(), (slots % ps).long()


def _misaligned_layers(c: torch.Tensor) -> list[torch.Tensor]:
    """``c``'s layers as views of one buffer, each starting one element past a 16-byte
    boundary (16-bit elements: 2 bytes off)."""
    L, n = c.shape[0], c[0].numel()
    flat = torch.empty(L * (n + 8) + 8, dtype=c.dtype, device=c.device)
    out = []
    for i in range(L):
        v = flat[1 + i * (n + 8) : 1 + i * (n + 8) + n].view(c.shape[1:])
        v.copy_(c[i])
        out.append(v)
    assert all(t.data_ptr() % 16 == 2 for t in out)
    return out


@pytest.mark.parametrize("page_size", [1, 16, None], ids=["ps1", "ps16", "contiguous"])
@pytest.mark.parametrize("layout", ["stacked", "list", "list_misaligned"])
def test_compact_gpu_stress(page_size, layout):
    """Long accepted paths whose destinations are earlier sources (i_d = 2d and random
    increasing paths): any ordering race in the in-place copy shows as a mismatch. A list of
    layers reaches the kernel through a pointer table, which it is told is 16-byte aligned
    when every layer is (vector copies); ``list_misaligned``'s layers start 2 bytes off, so
    the kernel must not be told so."""
    B, N, L, H, D = STRESS_SHAPE
    rng = random.Random(page_size or 0)
    seq = torch.tensor([rng.randint(0, 300) for _ in range(B)], dtype=torch.int32)
    ps = page_size or int(seq.max()) + N
    pages = [-(-(int(s) + N) // ps) for s in seq]
    perm = torch.randperm(sum(pages) + 3, generator=torch.Generator().manual_seed(1))
    bt = torch.zeros(B, max(pages), dtype=torch.int32)
    k = 0
    for b in range(B):
        bt[b, : pages[b]] = perm[k : k + pages[b]].to(torch.int32)
        k += pages[b]
    P = sum(pages) + 3
    shape = (L, P, ps, H, D)
    kc0 = torch.randn(shape).to(DEV, torch.bfloat16)
    vc0 = torch.randn(shape).to(DEV, torch.bfloat16)
    btg, seqg = bt.to(DEV), seq.to(DEV)
    for trial in range(6):
        acc = torch.full((B, N), -1, dtype=torch.int32)
        alen = torch.zeros(B, dtype=torch.int32)
        for b in range(B):
            if trial % 3 == 0:
                path = [2 * d for d in range(N // 2)]
            else:
                path, cur = [0], 0
                while True:
                    cur += rng.choice([1, 1, 2, 3, 5])
                    if cur >= N or len(path) >= N:
                        break
                    path.append(cur)
                path = path[: rng.randint(1, len(path))]
            acc[b, : len(path)] = torch.tensor(path, dtype=torch.int32)
            alen[b] = len(path)
        accg, aleng = acc.to(DEV), alen.to(DEV)
        kc, vc = kc0.clone(), vc0.clone()
        if layout == "stacked":
            kk, vv = kc, vc
        elif layout == "list":
            kk, vv = list(kc.unbind(0)), list(vc.unbind(0))
        else:  # each layer a view 2 bytes past a 16-byte boundary, filled from kc / vc
            kk, vv = _misaligned_layers(kc), _misaligned_layers(vc)
        new = compact_kv_launch(kk, vv, btg, seqg, accg, aleng)
        if layout == "list_misaligned":
            kc, vc = torch.stack(kk), torch.stack(vv)
        assert torch.equal(new.cpu(), seq + alen)
        d = torch.arange(N, device=DEV)[None, :].expand(B, N)
        live = d < aleng[:, None]
        src = seqg[:, None] + torch.where(live, accg, d)
        dst = seqg[:, None] + d
        sp, so = _phys(btg, src, ps)
        dp, do = _phys(btg, dst, ps)
        want_k, want_v = kc0.clone(), vc0.clone()
        want_k[:, dp[live], do[live]] = kc0[:, sp[live], so[live]]
        want_v[:, dp[live], do[live]] = vc0[:, sp[live], so[live]]
        assert torch.equal(kc, want_k) and torch.equal(vc, want_v), f"trial {trial}"

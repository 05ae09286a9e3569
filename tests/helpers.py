"""Float comparison with one tolerance table, and small tree builders for tests."""

from __future__ import annotations

from fractions import Fraction

import torch

import treeops

# Relative to the reference's max magnitude: (max error, RMS error). Justification: the unit
# roundoff u of each dtype (fp32 6e-8, fp16 4.9e-4, bf16 3.9e-3) times a small factor for the
# rounding of inputs and outputs plus fp32 accumulation in a different order. fp32 kernels run
# with IEEE dots (no tf32), so their error is accumulation-order only.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-11),
    torch.float32: (2e-5, 2e-6),
    torch.float16: (4e-3, 6e-4),
    torch.bfloat16: (3e-2, 5e-3),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str = ""):
    """Max and RMS error of ``actual`` against ``expected``, normalised by the reference's scale,
    within the tolerance of ``dtype`` (the dtype the computation's inputs came in). NaN fails."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    a = actual.double().cpu()
    e = expected.double().cpu()
    assert not torch.isnan(a).any(), f"{what}: NaN in output (an element left unwritten?)"
    same_inf = torch.isinf(e) & (a == e)
    a = torch.where(same_inf, 0.0, a)
    e = torch.where(same_inf, 0.0, e)
    assert torch.isfinite(a).all(), f"{what}: inf where the reference is finite"
    scale = max(float(e.abs().max()) if e.numel() else 0.0, 1e-6)
    err = (a - e).abs() / scale
    max_err = float(err.max()) if err.numel() else 0.0
    rms_err = float(err.pow(2).mean().sqrt()) if err.numel() else 0.0
    tmax, trms = TOLERANCES[dtype]
    assert max_err <= tmax and rms_err <= trms, (
        f"{what}: max rel err {max_err:.3e} (tol {tmax:.0e}), rms {rms_err:.3e} (tol {trms:.0e})"
    )


def tree_from_lists(
    parents: list[list[int]],
    tokens: list[list[int]] | None = None,
    scores: list[list[float]] | None = None,
    capacity: int | None = None,
    device: str = "cpu",
) -> treeops.Tree:
    """A Tree from per-request Python lists (rows may differ in length; [] = inactive row)."""
    B = len(parents)
    N = capacity or max(1, max(len(p) for p in parents))
    par = torch.full((B, N), -1, dtype=torch.int32)
    tok = torch.zeros(B, N, dtype=torch.int64)
    sc = torch.zeros(B, N, dtype=torch.float32)
    for b, p in enumerate(parents):
        par[b, : len(p)] = torch.tensor(p, dtype=torch.int32)
        if tokens is not None:
            tok[b, : len(p)] = torch.tensor(tokens[b], dtype=torch.int64)
        if scores is not None:
            sc[b, : len(p)] = torch.tensor(scores[b], dtype=torch.float32)
        else:
            sc[b, : len(p)] = 1.0
    nn = torch.tensor([len(p) for p in parents], dtype=torch.int32)
    return treeops.Tree.from_parents(par.to(device), nn.to(device), tok.to(device), sc.to(device))


def small_step(device="cpu", seed: int = 0) -> dict:
    """One small verification step's tensors (B 2, N 4, 2 query / 1 KV heads, D 64, page 16,
    V 32): the tree, q/k/v, paged caches, block table, seq_lens and target logits. For the custom
    op checks (opcheck) and the torch.compile test."""
    g = torch.Generator().manual_seed(seed)
    tree = treeops.Tree.from_parents(
        torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 2]], dtype=torch.int32),
        torch.tensor([4, 3], dtype=torch.int32),
        torch.tensor([[5, 7, 9, 11], [6, 8, 10, 0]]),
    )
    d = {
        "q": torch.randn(2, 4, 2, 64, generator=g),
        "k": torch.randn(2, 4, 1, 64, generator=g),
        "v": torch.randn(2, 4, 1, 64, generator=g),
        "k_cache": torch.randn(4, 16, 1, 64, generator=g),
        "v_cache": torch.randn(4, 16, 1, 64, generator=g),
        "block_table": torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),
        "seq_lens": torch.tensor([9, 20], dtype=torch.int32),
        "logits": torch.randn(2, 4, 32, generator=g),
    }
    d = {k: v.to(device) for k, v in d.items()}
    d["tree"] = tree.to(device)
    return d


def brute_utilities(
    scores: list[list[float]], K: int, active: list[bool] | None = None, root: bool = False
) -> list[Fraction]:
    """CAST's utilities u_1..u_K, exactly: the mean over active rows (all when ``active`` is
    None) of the sum of each row's k best scores (negative scores count 0; ``root`` puts a score
    of 1 first)."""
    rows = []
    for b, row in enumerate(scores):
        if active is not None and not active[b]:
            continue
        s = sorted((Fraction(float(max(v, 0.0))) for v in row), reverse=True)
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

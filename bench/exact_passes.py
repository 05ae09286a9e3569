"""Passes of acceptance's exact search (``accept_stats._count_search``, top-p) on the CPU.

The search's bracket logic, restated in NumPy over one row: each pass counts the mass at or
above its pivots and keeps the bracket around the goal ``top_p * Z``. ``keys``: the keys'
midpoint alone, from the lowest key (the search before session 54); ``keys+lo``: from the
analytic start t_lo = m + ln((1 - p) Z / V) - 0.01; ``dual``: the keys' and the values'
midpoints a pass; ``dual+lo``: both (the kernel's). Rows: bf16-rounded logits of a few shapes,
128,256 tokens, T 1.

    python bench/exact_passes.py
"""

from __future__ import annotations

import numpy as np

KEY_NEG_INF = -2139095041  # the key of -inf


def _keys(x: np.ndarray) -> np.ndarray:
    b = x.astype(np.float32).view(np.int32).astype(np.int64)
    return np.where(x == 0, 0, np.where(b >= 0, b, b ^ 0x7FFFFFFF))


def _at_least(k: int) -> float:
    if k <= KEY_NEG_INF:
        return -np.inf
    b = k if k >= 0 else k ^ 0x7FFFFFFF
    return float(np.array([b], dtype=np.int64).astype(np.int32).view(np.float32)[0])


def passes(x: np.ndarray, p: float, dual: bool, analytic: bool, shift: int = 16) -> int:
    x = x.astype(np.float32)
    m = float(x.max())
    w = np.exp(x.astype(np.float64) - m)
    goal = p * w.sum()
    k = _keys(x)
    lo, hi = -(2**31), int(_keys(np.array([m]))[0]) + 1
    if analytic:
        t = m + np.log((1 - p) * w.sum() / len(x)) - 0.01
        lo = max(lo, int(_keys(np.array([min(t, m)], np.float32))[0]))
    lo, hi = lo >> shift, ((hi - 1) >> shift) + 1
    n = 0
    while hi - lo > 1:
        n += 1
        pivots = [lo + (hi - lo) // 2]
        v_lo, v_hi = _at_least(lo << shift), _at_least(hi << shift)
        if dual and v_lo > -np.inf and v_hi == v_hi:
            pv = int(_keys(np.array([0.5 * v_lo + 0.5 * v_hi], np.float32))[0]) >> shift
            if lo < pv < hi:
                pivots.append(pv)
        for piv in pivots:
            if w[k >= (piv << shift)].sum() >= goal:
                lo = max(lo, piv)
            else:
                hi = min(hi, piv)
    return n


def _bf16(x: np.ndarray) -> np.ndarray:
    """Round to bfloat16 (to nearest even), as fp32."""
    b = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.astype(np.uint32).view(np.float32)


def main() -> None:
    rng = np.random.default_rng(0)
    V = 128256
    rows = {
        "standard normal": rng.standard_normal(V),
        "normal, sd 3, mean 2": rng.standard_normal(V) * 3 + 2,
        "peaked: 2,000 tokens near 6, the rest near -4": np.concatenate(
            [rng.standard_normal(V - 2000) * 2 - 4, rng.standard_normal(2000) * 1.5 + 6]
        ),
    }
    print(f"{'row':<46} {'p':>5} {'keys':>5} {'keys+lo':>8} {'dual':>5} {'dual+lo':>8}")
    for name, x in rows.items():
        xb = _bf16(x)
        for p in (0.9, 0.95):
            n = [passes(xb, p, d, a) for d, a in ((0, 0), (0, 1), (1, 0), (1, 1))]
            print(f"{name:<46} {p:>5} {n[0]:>5} {n[1]:>8} {n[2]:>5} {n[3]:>8}")


if __name__ == "__main__":
    main()

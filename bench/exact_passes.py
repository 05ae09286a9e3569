"""Passes of acceptance's exact search (``accept_stats._count_search``, top-p) on the CPU.

The search's bracket logic, restated in NumPy over one row: each pass counts the mass at or
above its pivots and keeps the bracket around the goal ``top_p * Z``. Rules:

- ``keys``: the keys' midpoint alone (a bisection of the int32 keys);
- ``dual``: the keys' and the values' midpoints a pass;
- ``interp`` (the kernel's): the value where the mass, linear between the bracket's ends,
  meets the goal, with the values' midpoint, or the keys' after a pass that did not halve the
  keys' span (so no row takes more than twice the keys' bisection);
- ``snap`` (not the kernel's): ``interp``, and a pivot that meets the goal lifts lo to the
  least value at or above it (f is the same there). It ends rows of few distinct values (all
  equal: 1 pass, not 17) and sparse fp32 rows early, but leaves dense bf16 rows where they
  were (standard normal at top-p 0.9: 7), while its minimum per pivot costs a pass about a
  quarter more instructions.

Each from the lowest key, or (``+lo``) from the analytic start
t_lo = m + T (ln((1 - p) Z / V) - 0.01). Rows: bf16-rounded logits of several shapes.

    python bench/exact_passes.py
"""

from __future__ import annotations

import numpy as np

KEY_NEG_INF = -2139095041  # the key of -inf
RULES = ("keys", "dual", "interp", "snap")


def _keys(x: np.ndarray) -> np.ndarray:
    b = x.astype(np.float32).view(np.int32).astype(np.int64)
    return np.where(x == 0, 0, np.where(b >= 0, b, b ^ 0x7FFFFFFF))


def _key(v: float) -> int:
    return int(_keys(np.array([v], np.float32))[0])


def _at_least(k: int) -> float:
    if k <= KEY_NEG_INF:
        return -np.inf
    b = k if k >= 0 else k ^ 0x7FFFFFFF
    return float(np.array([b], dtype=np.int64).astype(np.int32).view(np.float32)[0])


def search(
    x: np.ndarray, p: float, rule: str, analytic: bool, T: float = 1.0, shift: int = 16
) -> tuple[int, int]:
    """(passes, the threshold key >> shift) of one row's top-p search under ``rule``."""
    x = x.astype(np.float32)
    m = float(x.max())
    w = np.exp((x.astype(np.float64) - m) / T)
    z = w.sum()
    goal = p * z
    k = _keys(x)
    lo, hi = -(2**31), _key(m) + 1
    if analytic:
        t = m + T * (np.log((1 - p) * z / len(x)) - 0.01)
        lo = max(lo, _key(min(t, m)))
    lo, hi = lo >> shift, ((hi - 1) >> shift) + 1
    ks = k >> shift
    f_lo, f_hi = z, 0.0  # f(lo) is at most the row's mass
    n, slow = 0, False
    while hi - lo > 1:
        n += 1
        span = hi - lo
        v_lo, v_hi = _at_least(lo << shift), _at_least(hi << shift)
        fin = v_lo > -np.inf and v_hi == v_hi
        piv_k = lo + span // 2
        piv_v = _key(0.5 * v_lo + 0.5 * v_hi) >> shift if fin else piv_k
        piv_v = piv_v if lo < piv_v < hi else piv_k
        if rule == "keys":
            pivots = [piv_k]
        elif rule == "dual":
            pivots = [piv_k, piv_v]
        else:
            piv_i = piv_k
            if fin:
                r = (f_lo - goal) / (f_lo - f_hi)
                piv_i = min(max(_key(v_lo + r * (v_hi - v_lo)) >> shift, lo + 1), hi - 1)
            pivots = [piv_i, piv_k if slow else piv_v]
        for piv in pivots:
            f = w[ks >= piv].sum()
            if f >= goal and piv > lo:
                lo, f_lo = piv, f
                if rule == "snap":
                    lo = int(ks[ks >= piv].min())
            elif f < goal and piv < hi:
                hi, f_hi = piv, f
        slow = (hi - lo) * 2 > span
    return n, lo


def passes(x: np.ndarray, p: float, rule: str, analytic: bool, T: float = 1.0) -> int:
    return search(x, p, rule, analytic, T)[0]


def _bf16(x: np.ndarray) -> np.ndarray:
    """Round to bfloat16 (to nearest even), as fp32."""
    b = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.astype(np.uint32).view(np.float32)


def rows(rng: np.random.Generator, V: int) -> dict[str, np.ndarray]:
    """Logit rows of several shapes: dense ones, a peaked one, heavy tails, and degenerate
    ones (equal logits, tiny magnitudes) where the values bunch around 0."""
    return {
        "standard normal": rng.standard_normal(V),
        "normal, sd 3, mean 2": rng.standard_normal(V) * 3 + 2,
        "peaked: 2,000 near 6, the rest near -4": np.concatenate(
            [rng.standard_normal(V - 2000) * 2 - 4, rng.standard_normal(2000) * 1.5 + 6]
        ),
        "normal, sd 0.3": rng.standard_normal(V) * 0.3,
        "gumbel, scale 2": rng.gumbel(size=V) * 2,
        "uniform on [-1, 1]": rng.uniform(-1, 1, V),
        "zipf-like": -np.log(np.arange(1, V + 1)) + rng.standard_normal(V) * 0.1,
        "normal, sd 10": rng.standard_normal(V) * 10,
        "all equal (0)": np.zeros(V),
        "normal, sd 1e-20": rng.standard_normal(V) * 1e-20,
        "half zeros": np.concatenate([np.zeros(V // 2), rng.standard_normal(V - V // 2)]),
    }


def main() -> None:
    rng = np.random.default_rng(0)
    cols = [("keys", False), ("keys", True), ("dual", True), ("interp", True), ("snap", True)]
    heads = ("keys", "keys+lo", "dual+lo", "interp+lo (kernel)", "snap+lo")
    widths = [max(5, len(h)) for h in heads]
    print(f"{'row (V 128,256, T 1, bf16)':<40} {'p':>5} "
          + " ".join(f"{h:>{w}}" for h, w in zip(heads, widths)))  # fmt: skip
    data = rows(rng, 128256)
    total = np.zeros(len(cols))
    for name, x in data.items():
        xb = _bf16(x)
        for p in (0.5, 0.9, 0.95, 0.99):
            n = [passes(xb, p, r, a) for r, a in cols]
            total += n
            print(f"{name:<40} {p:>5} " + " ".join(f"{v:>{w}}" for v, w in zip(n, widths)))
    print(f"{'total':<40} {'':>5} " + " ".join(f"{t:>{w}.0f}" for t, w in zip(total, widths)))
    # fp32 logits: keys of every bit (shift 0), so up to 32 passes by the keys' bisection
    total32 = np.zeros(len(cols))
    for x in data.values():
        for p in (0.5, 0.9, 0.95, 0.99):
            total32 += [search(x.astype(np.float32), p, r, a, shift=0)[0] for r, a in cols]
    print(f"{'total, the same rows in fp32':<40} {'':>5} "
          + " ".join(f"{t:>{w}.0f}" for t, w in zip(total32, widths)))  # fmt: skip


if __name__ == "__main__":
    main()

"""bench/exact_passes.py: the exact search's pass counts (CPU)."""

import numpy as np
import pytest
from exact_passes import RULES, _at_least, _bf16, _keys, passes, rows, search


def test_at_least_inverts_the_keys():
    x = _bf16(np.array([-3.5, -1e-30, -0.0, 0.0, 1e-30, 2.25, np.inf, -np.inf], np.float32))
    for v, k in zip(x, _keys(x)):
        assert _at_least(int(k)) == v  # -0.0 and 0.0 share the key 0, whose value is 0.0


@pytest.mark.parametrize("T", [1.0, 0.6])
def test_every_rule_finds_the_same_key_and_interpolation_stays_bounded(T):
    """Each rule ends at the same threshold, over bf16 and fp32 rows; the interpolation (the
    kernel's) never takes more than twice the keys' bisection plus one, on the degenerate rows
    too."""
    rng = np.random.default_rng(1)
    for name, x in rows(rng, 4096).items():
        for xb, shift in ((_bf16(x), 16), (x.astype(np.float32), 0)):
            for p in (0.5, 0.9, 0.99):
                got = {(r, a): search(xb, p, r, a, T, shift) for r in RULES for a in (0, 1)}
                assert len({lo for _, lo in got.values()}) == 1, (name, p, got)
                assert got["interp", 1][0] <= 2 * got["keys", 0][0] + 1, (name, p, got)


def test_interpolation_takes_fewer_passes_over_dense_rows():
    rng = np.random.default_rng(2)
    dual = interp = 0
    for x in list(rows(rng, 32000).values())[:8]:
        for p in (0.5, 0.9, 0.95):
            dual += passes(_bf16(x), p, "dual", True)
            interp += passes(_bf16(x), p, "interp", True)
    assert interp < 0.85 * dual, (interp, dual)

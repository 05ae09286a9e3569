"""bench/exact_passes.py: the exact search's pass counts (CPU)."""

import numpy as np
from exact_passes import _at_least, _bf16, _keys, passes


def test_at_least_inverts_the_keys():
    x = _bf16(np.array([-3.5, -1e-30, -0.0, 0.0, 1e-30, 2.25, np.inf, -np.inf], np.float32))
    for v, k in zip(x, _keys(x)):
        assert _at_least(int(k)) == v  # -0.0 and 0.0 share the key 0, whose value is 0.0


def test_two_pivots_and_the_start_never_take_more_passes():
    rng = np.random.default_rng(1)
    for scale, shift in ((1.0, 0.0), (3.0, 2.0), (0.01, 0.0)):
        x = _bf16(rng.standard_normal(4096) * scale + shift)
        for p in (0.5, 0.9, 0.99):
            assert passes(x, p, True, True) <= passes(x, p, False, False)

"""The graph path of the example decoder, on the CPU (bench/bench_e2e.py's own tests are in
bench/test_bench_e2e.py).

``static_shapes=True`` runs the code that ``cuda_graphs=True`` captures (static buffers, token
buckets, the draft's in-place working tree, decisions read back from the host buffer, the packed
copy-back after acceptance) eagerly, so its logic is checked here against the eager decoder; the
captures themselves are checked on the GPU (``tests/test_decoder.py``, ``gpu`` marker).
"""

from __future__ import annotations

import pytest
import torch
from test_decoder import PROMPTS, _decoder, _greedy_baseline, pair  # noqa: F401

from treeops.decoder import POLICIES, Decoder
from treeops.decoder.engine import TOKEN_BUCKETS, bucket_for, token_buckets


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_token_buckets_never_undersize():
    for cap in (1, 2, 3, 7, 12, 16, 33, 60, 64, 100):
        bs = token_buckets(cap)
        assert bs == sorted(set(bs)) and bs[-1] == cap and all(b <= cap for b in bs)
        assert set(bs[:-1]) <= set(TOKEN_BUCKETS)
        for n in range(1, cap + 1):
            b = bucket_for(n, cap)
            assert n <= b <= cap and b in bs
            assert b == min(x for x in bs if x >= n)
    assert bucket_for(0, 8) == 1 and bucket_for(99, 8) == 8


def test_cuda_graphs_on_cpu_is_a_clear_error(pair):  # noqa: F811
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    target, draft = pair
    with pytest.raises(ValueError, match="cuda_graphs"):
        Decoder(target, draft, "Cast", cuda_graphs=True)
    with pytest.raises(ValueError, match="cuda_graphs"):
        Decoder(target, None, "autoregressive", cuda_graphs=True)


def _static(pair, policy):  # noqa: F811
    dec = _decoder(pair, policy)
    dec.static = True
    dec.check_buckets = True
    return dec


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("policy", POLICIES)
def test_static_path_equals_eager(pair, policy, batch):  # noqa: F811
    """Same tokens, same accepted lengths, same verified tree sizes and grafted counts as the
    eager decoder; every forward's bucket holds its tokens; a second call reuses the buffers."""
    eager = _decoder(pair, policy).generate(PROMPTS[:batch], 10)
    dec = _static(pair, policy)
    res = dec.generate(PROMPTS[:batch], 10)
    assert res.tokens == eager.tokens
    assert res.emitted == eager.emitted and res.verified == eager.verified
    assert res.grafted == eager.grafted
    assert res.undersized == 0
    assert len(res.verify_buckets) == res.steps == len(res.catchup_buckets)
    for b, row in zip(res.verify_buckets, res.verified):
        assert max(row) <= b <= dec.capacity
    for rc, em in zip(res.catchup_buckets, res.emitted):
        assert rc == (0 if policy == "autoregressive" else bucket_for(max(em), dec.capacity))
    if policy in ("Cast", "CastGraft"):
        assert res.host_waits >= 2 * res.steps  # rerank + acceptance, plus one per layer
        # CAST sizes the verification below the capacity; CastGraft verifies at the capacity
        # after a step whose requests were all pruned (its budget), as every step here is
        if policy == "Cast":
            assert min(res.verify_buckets) < dec.capacity
    elif policy != "autoregressive":
        assert res.host_waits == res.steps  # static trees: the acceptance read only
        assert set(res.verify_buckets) == {dec.capacity}
    again = dec.generate(PROMPTS[:batch], 10)
    assert again.tokens == res.tokens and len(dec._batches) == 1


def test_static_path_stop_ids_budgets_sampling(pair):  # noqa: F811
    """Ragged budgets, a stop id and per-request sampling through the static path."""
    from treeops.decoder import SamplingParams

    target, _ = pair
    budgets = [7, 1, 4]
    want = [_greedy_baseline(target, p, m) for p, m in zip(PROMPTS, budgets)]
    stop = want[0][2]
    res = _static(pair, "CastGraft").generate(PROMPTS, budgets, stop_ids=[stop])
    for got, w in zip(res.tokens, want):
        cut = w[: w.index(stop) + 1] if stop in w else w
        assert got == cut
    sp = [SamplingParams(), SamplingParams(1.0, 5, 0.9), SamplingParams()]
    g1 = torch.Generator().manual_seed(3)
    g2 = torch.Generator().manual_seed(3)
    a = _decoder(pair, "Cast").generate(PROMPTS, 10, sampling=sp, generator=g1)
    b = _static(pair, "Cast").generate(PROMPTS, 10, sampling=sp, generator=g2)
    assert a.tokens == b.tokens

"""Continuous batching in the example decoder (``generate(..., max_batch=B)``): more requests than
rows, a finished request's row taking the next waiting one between steps. Greedy output stays
autoregressive decoding's for every request, on every path and policy (tiny random pair, CPU
float32; the GPU-marked test on the H200 with whole-step CUDA graphs launched ahead)."""

from __future__ import annotations

import random

import pytest
import torch
from test_decoder import (  # noqa: F401  (pair, gpu_pair, _one_thread: fixtures)
    _decoder,
    _greedy_baseline,
    _lambda_decoder,
    _one_thread,
    gpu_pair,
    pair,
)

from treeops.decoder import POLICIES, Decoder, SamplingParams
from treeops.testing import NoHostSync


def _requests(seed: int, n: int, vocab: int = 128):
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 12))] for _ in range(n)]
    return prompts, [rng.choice([0, 1, 3, 9, 17, 30]) for _ in range(n)]


def _baseline(target, prompts, budgets, stop=()):
    return [_greedy_baseline(target, p, m, stop=stop) for p, m in zip(prompts, budgets)]


# (thresholded CAST and CastGraft have no whole-step body: λ-CAST's is tested below)
CASES = [(p, path) for p in POLICIES for path in ("eager", "static", "step-body")
         if not (path == "step-body" and p in ("Cast", "CastGraft"))]  # fmt: skip


@pytest.mark.parametrize("policy,path", CASES)
def test_refilled_rows_decode_every_request_as_autoregressive(pair, policy, path):  # noqa: F811
    """Nine requests (some with no budget, prompts of one token among them) through three rows,
    with a stop id: each request's tokens equal autoregressive decoding's, in request order, as
    when all nine run at once; every step ran three rows."""
    target, _ = pair
    prompts, budgets = _requests(11, 9)
    stop = _greedy_baseline(target, prompts[0], 30)[4]
    kw = {"eager": {}, "static": {"static_shapes": True}}.get(path)
    if kw is None:
        kw = {"static_shapes": True, "step_graphs": True}
    dec = _decoder(pair, policy, **kw)
    res = dec.generate(prompts, budgets, stop_ids=[stop], max_batch=3)
    assert res.tokens == _baseline(target, prompts, budgets, (stop,))
    assert all(len(row) == 3 for row in res.emitted)
    one = _decoder(pair, policy, **kw).generate(prompts, budgets, stop_ids=[stop])
    assert res.tokens == one.tokens


@pytest.mark.parametrize("path", ["eager", "step-body"])
def test_full_batch_window_ends_when_the_list_drains(pair, path):  # noqa: F811
    """``steps_full``: the steps before a row first idled with no request waiting (one step at
    a time, every row of them ran a request; launched ahead, a refilled row idles the one step
    already launched), and its tokens are those steps'. Autoregressive decoding of equal
    budgets never idles a row early: its window is the whole loop."""
    target, _ = pair
    prompts = _requests(5, 7)[0]
    kw = {} if path == "eager" else {"static_shapes": True, "step_graphs": True}
    res = _decoder(pair, "chain", **kw).generate(prompts, [9, 30, 3, 17, 9, 30, 17], max_batch=3)
    k = res.steps_full
    assert 0 < k < res.steps
    if path == "eager":
        assert all(all(e > 0 for e in row) for row in res.emitted[:k])
    assert any(e == 0 for e in res.emitted[k])  # (the next step ran with a row idle)
    assert res.tokens_full == sum(map(sum, res.emitted[:k]))
    assert 0 < res.time_full <= res.time_decode
    ar = _decoder(pair, "autoregressive").generate(prompts[:6], 5, max_batch=3)
    assert (ar.steps_full, ar.tokens_full) == (ar.steps, 30)


@pytest.mark.parametrize("graft", [False, True], ids=["lambda-Cast", "lambda-CastGraft"])
def test_refilled_rows_under_lambda_cast(pair, graft):  # noqa: F811
    """λ-CAST (and Graft over it) as whole steps launched ahead, with refills: greedy output
    equals autoregressive decoding for every request, the planner observed the steps and the
    refills' time is recorded."""
    target, _ = pair
    prompts, budgets = _requests(5, 8)
    dec = _lambda_decoder(pair, graft=graft, static_shapes=True)
    res = dec.generate(prompts, budgets, max_batch=2)
    assert res.tokens == _baseline(target, prompts, budgets)
    assert res.time_refill > 0 and dec.planner.describe(2)["steps"] > 0


def test_refills_keep_per_request_sampling(pair):  # noqa: F811
    """Sampled requests with their own parameters keep them in whatever row they land: a
    temperature-0 request among sampled ones decodes greedily."""
    target, _ = pair
    prompts, budgets = _requests(2, 6)
    budgets = [max(b, 5) for b in budgets]
    sp = [SamplingParams(temperature=1.0, top_k=20)] * 6
    sp[4] = SamplingParams()  # greedy, refilled into a row that sampled before it
    dec = _decoder(pair, "EagleStatic", static_shapes=True, step_graphs=True)
    res = dec.generate(prompts, budgets, sampling=sp, max_batch=2)
    assert res.tokens[4] == _greedy_baseline(target, prompts[4], budgets[4])
    assert [len(t) for t in res.tokens] == budgets


def test_refill_device_work_reads_nothing_back(pair, monkeypatch):  # noqa: F811
    """What a refill queues (the prompts' prefill through the rows' cache view, the draft's, the
    rows' carried state, Graft's table warmed) reads nothing back to the host, so on a GPU it
    waits behind the step launched ahead instead of for it (the table's warm start is its CPU
    reference here, opaque to the check: the GPU runs a kernel there)."""
    import treeops.decoder.engine as engine_mod

    dec = _lambda_decoder(pair, graft=True, static_shapes=True)
    checked = []
    apply = engine_mod._Refill.apply

    def apply_checked(self, toks, st, fl):
        check = NoHostSync()
        table = self.dec.table
        monkeypatch.setattr(table, "warm_start", check.opaque(table.warm_start))
        with check:
            apply(self, toks, st, fl)
        checked.append(check.ops_checked)

    monkeypatch.setattr(engine_mod._Refill, "apply", apply_checked)
    prompts, budgets = _requests(4, 6)
    res = dec.generate(prompts, [max(b, 2) for b in budgets], max_batch=2)
    assert res.tokens == _baseline(pair[0], prompts, [max(b, 2) for b in budgets])
    assert checked and min(checked) > 0


def test_max_batch_is_checked(pair):  # noqa: F811
    dec = _decoder(pair, "chain")
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_batch"):
            dec.generate([[1, 2]], 3, max_batch=bad)
    assert dec.generate([[1, 2]], 3, max_batch=8).tokens[0]  # more rows than requests: fine


@pytest.mark.gpu
def test_refilled_rows_with_step_graphs_on_gpu(gpu_pair):  # noqa: F811
    """λ-CAST + Graft with whole-step CUDA graphs launched ahead, 24 requests through 4 rows:
    every request decodes as autoregressive decoding (fp32, tf32 off), no capture after the
    first batch, the refills' device time recorded."""
    torch.backends.cuda.matmul.allow_tf32 = False
    target, _ = gpu_pair
    prompts, budgets = _requests(9, 24)
    ar = Decoder(target, None, "autoregressive").generate(prompts, budgets)
    dec = _lambda_decoder(gpu_pair, graft=True, static_shapes=True, cuda_graphs=True)
    res = dec.generate(prompts, budgets, max_batch=4)
    assert res.tokens == ar.tokens and res.time_refill > 0
    again = dec.generate(prompts[::-1], budgets[::-1], max_batch=4)
    assert again.tokens == ar.tokens[::-1]

"""The per-layer ops' own replays (``treeops.kernels._replay``): a repeated plain call of a
signature launches, argument for argument, what the op's Python path launches for the same
tensors, with fresh outputs where the op makes them; anything a replay cannot be falls back to
the op."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from replay_stand_in import PRELUDE

import treeops

ROOT = Path(__file__).resolve().parent.parent

_STAND_IN = (
    PRELUDE
    + r"""
with bench_host.launchers_on_cpu():
    g = torch.Generator().manual_seed(0)
    B, N, HQ, HKV, D, P = 2, 8, 4, 2, 64, 16
    bf = torch.bfloat16
    rnd = lambda *s: torch.randn(*s, generator=g).to(bf)
    par = torch.tensor([[-1] + [(i - 1) // 2 for i in range(1, N)]] * B, dtype=torch.int32)
    tree = treeops.Tree.from_parents(par, torch.full((B,), N, dtype=torch.int32),
                                     torch.arange(B * N).view(B, N) + 1)
    bt = torch.arange(B * 4, dtype=torch.int32).view(B, 4)
    sl = torch.tensor([20, 33], dtype=torch.int32)
    tree1 = treeops.Tree.from_parents(par[:1], torch.full((1,), N, dtype=torch.int32),
                                      torch.arange(N).view(1, N) + 1)
    bt1 = torch.arange(40, dtype=torch.int32).view(1, 40)
    sl1 = torch.tensor([600], dtype=torch.int32)
    from treeops.kernels import tree_attention as K

    def attn(split=False, out=False, lse=False, ws=False):
        def make():
            if split:
                q, kc, vc = rnd(1, N, HQ, D), rnd(40, P, HKV, D), rnd(40, P, HKV, D)
                args = (q, kc, vc, bt1, sl1, tree1)
            else:
                q, kc, vc = rnd(B, N, HQ, D), rnd(B * 4, P, HKV, D), rnd(B * 4, P, HKV, D)
                args = (q, kc, vc, bt, sl, tree)
            kw = dict(return_lse=lse)
            if out:
                kw["out"] = torch.empty_like(q)
                if lse:
                    kw["lse"] = torch.empty(q.shape[:3], dtype=torch.float32)
            if ws:
                kw["workspace"] = torch.zeros(K.workspace_numel(
                    *q.shape, K.config_for(q, args[1], args[3])))
            return args, kw
        return make

    res = {}
    for name, kw in (("attn", {}), ("attn_out", dict(out=True)), ("attn_lse", dict(lse=True)),
                     ("attn_out_lse", dict(out=True, lse=True)), ("split", dict(split=True)),
                     ("split_ws", dict(split=True, ws=True)),
                     ("split_out_lse", dict(split=True, out=True, lse=True))):
        res[name] = run(name, TA._REPLAYS, treeops.tree_attention, attn(**kw))

    def append(with_q):
        def make():
            kc, vc = rnd(B * 4, P, HKV, D), rnd(B * 4, P, HKV, D)
            kw = dict(q=rnd(B, N, HQ, D)) if with_q else {}
            return (rnd(B, N, HKV, D), rnd(B, N, HKV, D), kc, vc, bt, sl, tree.num_nodes,
                    tree.depth), kw
        return make

    res["append"] = run("append", KA._APPEND_REPLAYS, treeops.kv_append, append(False))
    res["append_q"] = run("append_q", KA._APPEND_REPLAYS, treeops.kv_append, append(True))
    res["rope"] = run("rope", KA._ROPE_REPLAYS, treeops.rope,
                      lambda: ((rnd(B, N, HQ, D), tree.depth.long()), {}))
    res["rope_3d"] = run("rope_3d", KA._ROPE_REPLAYS, treeops.rope,
                         lambda: ((rnd(N, HQ, D), tree.depth[0].long()), {}))

    AC = sys.modules["treeops.accept"]
    V = 64

    def acc(sample, out=False, logprobs=False, topk=0):
        def make():
            lg = torch.randn(B, N, V, generator=g)
            kw = dict(return_logprobs=logprobs, topk_ids=topk)
            if out:
                kw["out"] = treeops.Acceptance(
                    torch.empty(B, N, dtype=torch.int32), torch.empty(B, dtype=torch.int32),
                    torch.empty(B, dtype=torch.int64),
                    torch.empty(B, N) if logprobs else None,
                    torch.empty(B, N, topk, dtype=torch.int32) if topk else None)
            if sample:
                return (tree, lg, torch.full((B,), 0.8), torch.full((B,), 5, dtype=torch.int32),
                        torch.full((B,), 0.9), torch.rand(B, N, generator=g)), kw
            return (tree, lg), kw
        return make

    for name, sample, kw in (("greedy", False, {}), ("greedy_lp_topk", False,
                             dict(logprobs=True, topk=4)), ("greedy_out", False, dict(out=True)),
                             ("sample", True, {}), ("sample_out_lp", True,
                             dict(out=True, logprobs=True))):
        reps = AC._SAMPLE_REPLAYS if sample else AC._GREEDY_REPLAYS
        op = treeops.accept_sample if sample else treeops.accept_greedy
        res[name] = run(name, reps, op, acc(sample, **kw))
        a, k = acc(sample, **kw)()
        r = op(*a, **k)
        res[name]["type"] = type(r).__name__
        res[name]["nones"] = [x is None for x in r]

    # CAST's rules: a threshold seen once is not recorded (record_after=1): a first call
    # primes, then run() records and replays; a new threshold is a new key
    CA = sys.modules["treeops.cast"]
    sc, cs = torch.rand(B, 16, generator=g), torch.linspace(1, 2, 16)
    table2, sl64 = torch.rand(3, 16, generator=g) + 1, torch.tensor([700, 20])
    cast_cases = {
        "select": (treeops.cast_select, lambda: ((torch.rand(16, generator=g), cs, 0.5), {})),
        "width": (treeops.cast_width, lambda: ((torch.rand(B, 16, generator=g), cs, 0.5),
                                               dict(active=torch.tensor([True, False])))),
        "width_table": (treeops.cast_width, lambda: ((torch.rand(B, 16, generator=g), table2,
                        0.25), dict(seq_lens=sl64, context_len=512))),
        "depth": (treeops.cast_depth, lambda: ((torch.rand(3, generator=g), torch.tensor(0.5),
                                               1.0, 4), {})),
        "rerank": (treeops.cast_rerank, lambda: ((torch.rand(B, 16, generator=g), cs, 0.5), {})),
    }
    for name, (op, make) in cast_cases.items():
        reps = CA._REPLAYS[name.split("_")[0]]
        a, kw = make()
        n0 = len(reps._runs)
        op(*a, **kw)  # primes: not recorded
        primed = len(reps._runs) == n0
        res["cast_" + name] = run(name, reps, op, make)
        res["cast_" + name]["primed_unrecorded"] = primed
    a, kw = cast_cases["width"][1]()
    n0 = CA._REPLAYS["width"].replays
    treeops.cast_width(a[0], a[1], 0.75, **kw)  # another threshold: the op, not a replay
    res["cast_new_threshold_replays"] = CA._REPLAYS["width"].replays - n0

    CK = sys.modules["treeops.compact_kv"]
    acc0 = treeops.accept_greedy(tree, torch.randn(B, N, 64, generator=g))

    def compact(stacked, out):
        def make():
            kc, vc = rnd(3, B * 4, P, HKV, D), rnd(3, B * 4, P, HKV, D)
            if not stacked:
                kc, vc = list(kc.unbind(0)), list(vc.unbind(0))
            kw = dict(out=torch.empty(B, dtype=torch.int32)) if out else {}
            return (kc, vc, bt, sl, tree, acc0.accepted, acc0.accept_len), kw
        return make

    res["compact"] = run("compact", CK._REPLAYS, treeops.compact_kv, compact(True, False))
    res["compact_out"] = run("compact_out", CK._REPLAYS, treeops.compact_kv, compact(True, True))
    n0 = CK._REPLAYS.replays
    for _ in range(3):
        a, kw = compact(False, False)()
        treeops.compact_kv(*a, **kw)
    res["compact_list_replays"] = CK._REPLAYS.replays - n0

    # what falls back: a misaligned pointer, a dispatch mode, a call being recorded (prepare)
    q, kc, vc = rnd(B, N, HQ, D), rnd(B * 4, P, HKV, D), rnd(B * 4, P, HKV, D)
    treeops.tree_attention(q, kc, vc, bt, sl, tree)
    n0 = TA._REPLAYS.replays
    off = torch.empty(q.numel() + 8, dtype=bf)[1:1 + q.numel()].view(q.shape)
    treeops.tree_attention(off, kc, vc, bt, sl, tree)
    from treeops.testing import NoHostSync
    with NoHostSync():
        treeops.tree_attention(q, kc, vc, bt, sl, tree)
    n1 = TA._REPLAYS.replays
    o = torch.empty_like(q)
    treeops.tree_attention(q, kc, vc, bt, sl, tree, out=o)  # this signature is recorded
    prep = treeops.prepare(treeops.tree_attention, q, kc, vc, bt, sl, tree, out=o,
                           rebind=("q", "out"))
    res["fallback"] = dict(replays=n1 - n0, prepared_fast=prep.fast,
                           prepared_launches=len(prep.source.split("L0(")) - 1)
print("RESULT" + json.dumps(res))
"""
)


def test_replay_launches_what_the_op_launches():
    """Against stub kernels (bench/bench_host.py's stand-in driver): the second call of each
    signature replays, launching argument for argument what the op's own path launches for the
    same tensors (pointers as the input or result they point into, with the offset; the op's
    own buffers by their offsets to each other), and returns the given tensors where the op
    does and fresh ones of the op's shapes, strides and dtypes where it makes them:
    tree_attention with and without ``out``, ``lse``, a split-KV workspace (two launches: the
    given workspace's views at their offsets, or the op's own workspace fresh per call),
    kv_append with and without ``q``, rope on 4-d and 3-d ``x`` (views of x and of its fresh
    result), accept_greedy and accept_sample with and without ``out``, log-probs and top-k ids
    (an ``Acceptance`` back, its workspace passed as recorded), CAST's four rules (recorded at
    a threshold's second call, not its first; another threshold runs the op) and compaction of
    stacked caches (a list of layers always runs the op). A misaligned pointer, a dispatch
    mode and a call being recorded by ``prepare`` run the op."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _STAND_IN], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(proc.stdout.split("RESULT", 1)[1])
    for name in ("attn", "attn_out", "attn_lse", "attn_out_lse", "split", "split_ws",
                 "split_out_lse", "append", "append_q", "rope", "rope_3d", "greedy",
                 "greedy_lp_topk", "greedy_out", "sample", "sample_out_lp"):  # fmt: skip
        r = res[name]
        assert r["replayed"] == 1 and r["same"] and r["meta"] and r["launches"] >= 1, (name, r)
    assert res["split"]["launches"] == 2 and res["split_ws"]["launches"] == 2
    assert res["attn"]["returned_inputs"] == [False]  # a fresh out
    assert res["attn_out_lse"]["returned_inputs"] == [True, True]
    assert res["attn_lse"]["returned_inputs"] == [False, False]
    assert res["append"]["returned_none"] and res["append_q"]["returned_none"]
    assert res["rope"]["returned_inputs"] == [False]
    # what each replay allocates per call: its fresh results, and fresh bytes only for a buffer
    # the kernels write before they read (the split-KV workspace the op made); RoPE's frequency
    # table and the arrival counters are the launchers' own, passed as recorded
    fresh = {name: (r["fresh_results"], r["fresh_bytes"]) for name, r in res.items()
             if isinstance(r, dict) and "fresh_bytes" in r
             and not name.startswith(("cast_", "compact"))}  # fmt: skip
    assert fresh == {
        "attn": (1, 0), "attn_out": (0, 0), "attn_lse": (2, 0), "attn_out_lse": (0, 0),
        "split": (1, 1), "split_ws": (1, 0), "split_out_lse": (0, 1), "append": (0, 0),
        "append_q": (0, 0), "rope": (1, 0), "rope_3d": (1, 0), "greedy": (3, 0),
        "greedy_lp_topk": (5, 0), "greedy_out": (0, 0), "sample": (3, 0), "sample_out_lp": (0, 0),
    }, fresh  # fmt: skip
    # acceptance: an Acceptance back, its absent fields None; the per-device workspace and the
    # counters are passed as recorded (no fresh bytes above)
    for name in ("greedy", "greedy_lp_topk", "greedy_out", "sample", "sample_out_lp"):
        assert res[name]["type"] == "Acceptance", (name, res[name])
    assert res["greedy"]["nones"] == [False, False, False, True, True]
    assert res["greedy_lp_topk"]["nones"] == [False] * 5
    assert res["sample"]["launches"] == 3
    for name in ("select", "width", "width_table", "depth", "rerank"):
        r = res["cast_" + name]
        assert r["primed_unrecorded"] and r["replayed"] == 1 and r["same"] and r["meta"], (name, r)
        assert (r["fresh_results"], r["fresh_bytes"], r["returned_inputs"]) == (1, 0, [False])
    assert res["cast_new_threshold_replays"] == 0
    for name in ("compact", "compact_out"):
        r = res[name]
        assert r["replayed"] == 1 and r["same"] and r["meta"] and r["launches"] == 1, (name, r)
    assert (res["compact"]["fresh_results"], res["compact"]["returned_inputs"]) == (1, [False])
    assert (res["compact_out"]["fresh_results"], res["compact_out"]["returned_inputs"]) == (
        0, [True])  # fmt: skip
    assert res["compact_list_replays"] == 0  # a list of layers: the op, every call
    assert res["fallback"]["replays"] == 0, res["fallback"]
    assert res["fallback"]["prepared_fast"] and res["fallback"]["prepared_launches"] == 1


def test_on_unless_turned_off():
    """Plain calls replay unless ``TREEOPS_REPLAY=0``."""
    code = "import treeops.kernels._replay as r; print(r.ENABLED)"
    for value, want in (("", "True"), ("1", "True"), ("0", "False")):
        env = {k: v for k, v in os.environ.items() if k != "TREEOPS_REPLAY"}
        if value:
            env["TREEOPS_REPLAY"] = value
        got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=env, cwd=ROOT, timeout=120).stdout.strip()  # fmt: skip
        assert got == want, (value, got)


def test_cpu_calls_run_the_reference():
    """On CPU the ops run their references: nothing is recorded, every call is the op's."""
    ta = sys.modules["treeops.tree_attention"]
    g = torch.Generator().manual_seed(1)
    par = torch.tensor([[-1, 0, 0, 1]], dtype=torch.int32)
    tree = treeops.Tree.from_parents(par, torch.tensor([4], dtype=torch.int32),
                                     torch.tensor([[7, 3, 5, 2]]))  # fmt: skip
    kc, vc = torch.randn(2, 16, 2, 64, generator=g), torch.randn(2, 16, 2, 64, generator=g)
    bt, sl = torch.tensor([[1, 0]], dtype=torch.int32), torch.tensor([10], dtype=torch.int32)
    n0 = ta._REPLAYS.replays
    outs = [treeops.tree_attention(torch.randn(1, 4, 4, 64, generator=g), kc, vc, bt, sl, tree)
            for _ in range(3)]  # fmt: skip
    assert ta._REPLAYS.replays == n0 and not any(o is outs[0] for o in outs[1:])


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True], ids=["one-launch", "split-kv"])
def test_gpu_plain_calls_replay_and_equal_the_ops(split, monkeypatch):
    """A layer loop of plain calls (kv_append with q, tree_attention without out or workspace,
    rope) replays from the second layer on and writes bitwise what the ops' Python path writes
    (the replay table emptied before each reference call); each replayed output is a fresh
    tensor. Then acceptance, greedy and sampling: a replayed call's ``Acceptance`` equals the
    op's, field for field."""
    ta, ka = sys.modules["treeops.tree_attention"], sys.modules["treeops.kv_append"]
    monkeypatch.setattr(sys.modules["treeops.kernels._replay"], "ENABLED", True)
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(3)
    B, N, HQ, HKV, D, P = 2, 8, 4, 2, 64, 16
    ctx = 3000 if split else 20
    pages = -(-(ctx + N) // P)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16).to(dev)

    par = torch.tensor([[-1] + [(i - 1) // 2 for i in range(1, N)]] * B, dtype=torch.int32)
    tree = treeops.Tree.from_parents(par, torch.full((B,), N, dtype=torch.int32),
                                     torch.arange(B * N).view(B, N) + 1).to(dev)  # fmt: skip
    bt = torch.arange(B * pages, dtype=torch.int32, device=dev).view(B, pages)
    sl = torch.tensor([ctx, ctx - 7], dtype=torch.int32, device=dev)
    layers = [(rnd(B * pages, P, HKV, D), rnd(B * pages, P, HKV, D), rnd(B, N, HQ, D),
               rnd(B, N, HKV, D), rnd(B, N, HKV, D)) for _ in range(4)]  # fmt: skip
    pos = tree.positions(sl)

    def layer(kc, vc, q, k, v):
        treeops.kv_append(k, v, kc, vc, bt, sl, tree.num_nodes, tree.depth, q=q)
        return treeops.tree_attention(q, kc, vc, bt, sl, tree), treeops.rope(q, pos)

    def plain(x):
        for r in (ta._REPLAYS, ka._APPEND_REPLAYS, ka._ROPE_REPLAYS):
            r._runs.clear()
        return layer(*x)

    counts = [r.replays for r in (ta._REPLAYS, ka._APPEND_REPLAYS, ka._ROPE_REPLAYS)]
    prev = None
    for i, x in enumerate(layers):
        y = [t.clone() for t in x]
        got = layer(*x)
        want = plain(y)
        for a, b in zip(list(x) + list(got), list(y) + list(want), strict=True):
            assert torch.equal(a, b), i
        layer(*[t.clone() for t in y])  # records again after the reference's emptying
        if prev is not None:
            assert got[0] is not prev[0] and got[1] is not prev[1]
        prev = got
    after = [r.replays for r in (ta._REPLAYS, ka._APPEND_REPLAYS, ka._ROPE_REPLAYS)]
    assert all(a - c >= len(layers) - 1 for a, c in zip(after, counts, strict=True)), after

    # acceptance, greedy and sampling: replayed calls give the op's Acceptance, field for field
    ac = sys.modules["treeops.accept"]
    V = 32000
    temp, top_k = torch.full((B,), 0.8, device=dev), torch.full((B,), 50, device=dev)
    top_p = torch.full((B,), 0.9, device=dev)
    for _ in range(3):
        lg = torch.randn(B, N, V, generator=g).to(dev)
        uni = torch.rand(B, N, generator=g).to(dev)
        for op, extra, reps in ((treeops.accept_greedy, (), ac._GREEDY_REPLAYS),
                                (treeops.accept_sample, (temp, top_k, top_p, uni),
                                 ac._SAMPLE_REPLAYS)):  # fmt: skip
            got = op(tree, lg, *extra, return_logprobs=True)
            runs = dict(reps._runs)
            reps._runs.clear()
            want = op(tree, lg, *extra, return_logprobs=True)
            reps._runs.clear()
            reps._runs.update(runs)
            for a, b in zip(got, want, strict=True):
                assert (a is None and b is None) or torch.equal(a, b)
    assert ac._GREEDY_REPLAYS.replays >= 2 and ac._SAMPLE_REPLAYS.replays >= 2


def test_a_recording_is_its_threads_own():
    """A call recorded in one thread takes no launch of another: the recording state is per
    thread (an engine's threads call ops while one of them records a first call)."""
    import threading

    from treeops.kernels import _launch

    seen = []
    with _launch.recording():
        t = threading.Thread(target=lambda: seen.append(_launch.STATE.rec))
        t.start()
        t.join()
        assert _launch.STATE.rec is not None
    assert seen == [None]


def test_a_signature_whose_launches_never_go_direct_stops_being_recorded():
    """A recorded call with a launch through Triton's own path is not kept and the next call is
    recorded again, but only ``MAX_MISSED`` times: then the signature is left to the op."""
    rp = sys.modules["treeops.kernels._replay"]
    from treeops.kernels import _launch

    class Missed(_launch._Recorded):
        missed = True

    replays = rp.Replays("stub")
    key = object()
    for _ in range(rp.MAX_MISSED):
        assert key not in replays._runs
        replays.record(key, (), Missed(), None)
    assert key in replays._runs and replays._runs[key] is None and replays.source(key) is None


@pytest.mark.gpu
def test_gpu_cast_and_compact_replay_equal_the_ops(monkeypatch):
    """CAST's four rules (a threshold repeated, so recorded and replayed) and compaction of
    stacked caches: each replayed call's result, and compaction's caches, equal the op's own
    path's (the replay table emptied for it), bitwise; the results are fresh tensors."""
    monkeypatch.setattr(sys.modules["treeops.kernels._replay"], "ENABLED", True)
    ca, ck = sys.modules["treeops.cast"], sys.modules["treeops.compact_kv"]
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(5)
    B, N = 4, 16
    costs = torch.linspace(1, 3, N, device=dev)
    table = (torch.rand(3, N, generator=g) + 1).to(dev)
    sl = torch.tensor([700, 20, 1500, 3], device=dev)

    def own(reps, fn, *args):
        runs = dict(reps._runs)
        reps._runs.clear()
        try:
            return fn(*args)
        finally:
            reps._runs.clear()
            reps._runs.update(runs)

    calls = {
        "select": lambda s: treeops.cast_select(s[0].sort().values, costs, 0.3),
        "width": lambda s: treeops.cast_width(s, costs, 0.3),
        "width_table": lambda s: treeops.cast_width(s, table, 0.2, seq_lens=sl, context_len=512),
        "depth": lambda s: treeops.cast_depth(s[0, :3], torch.tensor(0.5, device=dev), 1.0, 4),
        "rerank": lambda s: treeops.cast_rerank(s, costs, 0.1),
    }
    before = {k: r.replays for k, r in ca._REPLAYS.items()}
    prev = {}
    for _ in range(4):
        s = torch.rand(B, N, generator=g).to(dev)
        for name, fn in calls.items():
            reps = ca._REPLAYS[name.split("_")[0]]
            got = fn(s)
            want = own(reps, fn, s)
            assert torch.equal(got, want), name
            assert got is not prev.get(name)
            prev[name] = got
    assert all(r.replays - before[k] >= 2 for k, r in ca._REPLAYS.items()), before

    # compaction: stacked [L, pages, page, H_kv, D] caches, the accepted path of a real tree
    par = torch.tensor([[-1] + [(i - 1) // 2 for i in range(1, N)]] * B, dtype=torch.int32)
    tree = treeops.Tree.from_parents(par, torch.full((B,), N, dtype=torch.int32),
                                     torch.arange(B * N).view(B, N) % 50 + 1).to(dev)  # fmt: skip
    pages = 8
    bt = torch.randperm(B * pages, generator=g).to(torch.int32).view(B, pages).to(dev)
    seq = torch.tensor([5, 40, 77, 0], dtype=torch.int32, device=dev)
    n0 = ck._REPLAYS.replays
    for _ in range(3):
        acc = treeops.accept_greedy(tree, torch.randn(B, N, 64, generator=g).to(dev))
        kc = torch.randn(2, B * pages, 16, 2, 64, generator=g).to(torch.bfloat16).to(dev)
        vc = torch.randn(2, B * pages, 16, 2, 64, generator=g).to(torch.bfloat16).to(dev)
        k2, v2 = kc.clone(), vc.clone()
        got = treeops.compact_kv(kc, vc, bt, seq, tree, acc.accepted, acc.accept_len)
        want = own(
            ck._REPLAYS, treeops.compact_kv, k2, v2, bt, seq, tree, acc.accepted, acc.accept_len
        )
        assert torch.equal(got, want) and torch.equal(kc, k2) and torch.equal(vc, v2)
    assert ck._REPLAYS.replays - n0 >= 2

"""``treeops.prepare``: a prepared call gives the op's result for every rebound input, replays
the recorded launches with exactly the arguments the op would launch with, and falls back to the
op (its checks, its errors) wherever a replay would not be the op's own launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import treeops

ROOT = Path(__file__).resolve().parent.parent


def _inputs(dev, B=2, N=8, HQ=4, HKV=2, D=64, P=16, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype).to(dev)

    par = torch.tensor([[-1] + [(i - 1) // 2 for i in range(1, N)]] * B, dtype=torch.int32)
    tok = torch.arange(B * N).view(B, N) + 1
    tree = treeops.Tree.from_parents(par, torch.full((B,), N, dtype=torch.int32), tok).to(dev)
    kc, vc = rnd(B * 4, P, HKV, D), rnd(B * 4, P, HKV, D)
    bt = torch.arange(B * 4, dtype=torch.int32).view(B, 4).to(dev)
    sl = torch.tensor([20, 33][:B], dtype=torch.int32, device=dev)
    return dict(q=rnd(B, N, HQ, D), k=rnd(B, N, HKV, D), v=rnd(B, N, HKV, D), kc=kc, vc=vc,
                bt=bt, sl=sl, tree=tree, rnd=rnd)  # fmt: skip


def test_prepare_refuses_what_it_cannot_replay():
    x = _inputs("cpu")
    args = (x["q"], x["kc"], x["vc"], x["bt"], x["sl"], x["tree"])
    with pytest.raises(ValueError, match="Invalid op"):
        treeops.prepare(treeops.rope, x["q"], x["tree"].depth)
    with pytest.raises(ValueError, match="Invalid value of out"):
        treeops.prepare(treeops.tree_attention, *args, rebind=("q",))
    out, lse = torch.empty_like(x["q"]), None
    with pytest.raises(ValueError, match="Invalid value of lse"):
        treeops.prepare(treeops.tree_attention, *args, out=out, lse=lse, return_lse=True)
    with pytest.raises(ValueError, match="Invalid value of validate"):
        treeops.prepare(treeops.tree_attention, *args, out=out, validate=True)
    with pytest.raises(ValueError, match="Invalid rebind: tree_attention has no argument 'x'"):
        treeops.prepare(treeops.tree_attention, *args, out=out, rebind=("x",))
    with pytest.raises(ValueError, match="'tree' must be a tensor"):
        treeops.prepare(treeops.tree_attention, *args, out=out, rebind=("tree",))
    with pytest.raises(ValueError, match="given twice"):
        treeops.prepare(treeops.tree_attention, *args, out=out, rebind=("q", "q"))


def test_prepared_call_is_the_ops_call_on_cpu():
    """On CPU the op runs its reference: a prepared call is the op's call (never a replay)."""
    x = _inputs("cpu", dtype=torch.float32)
    out = torch.empty_like(x["q"])
    attn = treeops.prepare(
        treeops.tree_attention, x["q"], x["kc"], x["vc"], x["bt"], x["sl"], x["tree"], out=out,
        rebind=("q", "k_cache", "v_cache", "out"),
    )  # fmt: skip
    assert not attn.fast and "CUDA" in attn.reason
    q2, out2 = x["rnd"](*x["q"].shape).float(), torch.empty_like(out)
    got = attn(q2, x["kc"], x["vc"], out2)
    want = treeops.tree_attention(q2, x["kc"], x["vc"], x["bt"], x["sl"], x["tree"])
    assert got is out2 and torch.equal(got, want) and attn.replays == 0
    with pytest.raises(ValueError, match="Invalid dtype of q"):  # the op's own checks
        attn(q2.double(), x["kc"], x["vc"], out2)
    with pytest.raises(TypeError, match="takes 4 tensors"):
        attn(q2, x["kc"])


_STAND_IN = r"""
import json, sys, torch
sys.path.insert(0, "bench")
import bench_host
import treeops

calls = []
bench_host._StubKernel.run = lambda self, *a: calls.append(a)
with bench_host.launchers_on_cpu():
    g = torch.Generator().manual_seed(0)
    B, N, HQ, HKV, D, P = 2, 8, 4, 2, 64, 16
    bf = torch.bfloat16
    def rnd(*s):
        return torch.randn(*s, generator=g).to(bf)
    par = torch.tensor([[-1] + [(i - 1) // 2 for i in range(1, N)]] * B, dtype=torch.int32)
    tree = treeops.Tree.from_parents(par, torch.full((B,), N, dtype=torch.int32),
                                     torch.arange(B * N).view(B, N) + 1)
    kc, vc = rnd(B * 4, P, HKV, D), rnd(B * 4, P, HKV, D)
    bt = torch.arange(B * 4, dtype=torch.int32).view(B, 4)
    sl = torch.tensor([20, 33], dtype=torch.int32)
    q, out = rnd(B, N, HQ, D), torch.empty(B, N, HQ, D, dtype=bf)
    k, v = rnd(B, N, HKV, D), rnd(B, N, HKV, D)
    attn = treeops.prepare(treeops.tree_attention, q, kc, vc, bt, sl, tree, out=out,
                           rebind=("q", "k_cache", "v_cache", "out"))
    append = treeops.prepare(treeops.kv_append, k, v, kc, vc, bt, sl, tree.num_nodes,
                             tree.depth, q=q, rebind=("k", "v", "k_cache", "v_cache", "q"))

    # one request over a 640-slot table: the split path (attention, then the merge launch),
    # once with the op's own workspace and once with one given
    q1, out1 = rnd(1, N, HQ, D), torch.empty(1, N, HQ, D, dtype=bf)
    kc1, vc1 = rnd(40, P, HKV, D), rnd(40, P, HKV, D)
    bt1 = torch.arange(40, dtype=torch.int32).view(1, 40)
    sl1 = torch.tensor([600], dtype=torch.int32)
    tree1 = treeops.Tree.from_parents(par[:1], torch.full((1,), N, dtype=torch.int32),
                                      torch.arange(N).view(1, N) + 1)
    from treeops.kernels import tree_attention as K  # (tree_attention_workspace: CPU, none)
    ws1 = torch.zeros(K.workspace_numel(1, N, HQ, D, K.config_for(q1, kc1, bt1)))
    split = treeops.prepare(treeops.tree_attention, q1, kc1, vc1, bt1, sl1, tree1, out=out1,
                            workspace=ws1, rebind=("q", "k_cache", "v_cache", "out"))
    split_own = treeops.prepare(treeops.tree_attention, q1, kc1, vc1, bt1, sl1, tree1,
                                out=out1, rebind=("q", "k_cache", "v_cache", "out"))

    def norm(a):  # a launch's arguments, tensors as their data pointers
        return [x.data_ptr() if isinstance(x, torch.Tensor) else x if type(x) is int else repr(x)
                for x in a]

    res = {}
    for name, prep, op in (
        ("attn", attn, lambda q2, k2, v2, o2: treeops.tree_attention(
            q2, k2, v2, bt, sl, tree, out=o2)),
        ("append", append, lambda k2, v2, kc2, vc2, q2: treeops.kv_append(
            k2, v2, kc2, vc2, bt, sl, tree.num_nodes, tree.depth, q=q2)),
        ("split", split, lambda q2, k2, v2, o2: treeops.tree_attention(
            q2, k2, v2, bt1, sl1, tree1, out=o2, workspace=ws1)),
    ):
        new = [prep._arguments[n].clone() for n in prep.names]
        calls.clear(); op(*new); want = [norm(c) for c in calls]
        calls.clear(); r = prep(*new); got = [norm(c) for c in calls]
        n0 = prep.replays
        strided = [new[0].transpose(1, 2).contiguous().transpose(1, 2)] + new[1:]
        calls.clear(); prep(*strided)  # another stride: the op's call
        n1 = prep.replays
        off = torch.empty(new[0].numel() + 8, dtype=new[0].dtype)[1:1 + new[0].numel()]
        off = off.view(new[0].shape)  # 2 bytes off 16-byte alignment
        calls.clear(); prep(off, *new[1:])
        res[name] = dict(same=got == want, launches=len(got), replays=[n0, n1, prep.replays],
                         fast=prep.fast, returned=(r is new[-1]) if name != "append" else r)
    # the op's own workspace belongs to the prepared call: its launches read that buffer
    new = [split_own._arguments[n].clone() for n in split_own.names]
    calls.clear(); split_own(*new)
    res["split_own"] = dict(fast=split_own.fast, launches=len(calls), replays=split_own.replays)
print("RESULT" + json.dumps(res))
"""


def test_replay_launches_what_the_op_launches():
    """Against stub kernels (bench/bench_host.py's stand-in driver, no interpreter): a replay's
    launches carry, argument for argument, what the op's own launches carry for the same
    rebound tensors (tensors as their data pointers); another stride or a misaligned pointer
    is the op's call, not a replay. The split path's two launches (attention, merge) replay
    with a workspace given and with the op's own."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _STAND_IN], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(proc.stdout.split("RESULT", 1)[1])
    for name in ("attn", "append", "split"):
        r = res[name]
        assert r["fast"] and r["same"] and r["launches"] >= 1, (name, r)
        assert r["replays"][0] >= 1 and r["replays"][1] == r["replays"][0], (name, r)
        assert r["replays"][2] == r["replays"][0], (name, r)  # misaligned: not replayed
    assert res["attn"]["returned"] is True and res["append"]["returned"] is None
    assert res["split"]["launches"] == 2 and res["split"]["returned"] is True
    assert res["split_own"] == dict(fast=True, launches=2, replays=1)


@pytest.mark.gpu
@pytest.mark.parametrize("split", [False, True], ids=["one-launch", "split-kv"])
def test_gpu_prepared_layer_loop_equals_the_ops(split):
    """A layer loop through prepared calls (kv_append with q, then tree_attention, each layer
    its own caches and tensors) writes exactly what the ops' own calls write, replaying every
    layer; a stride change and a dispatch mode fall back to the op with the op's result."""
    dev = torch.device("cuda")
    ctx = 3000 if split else 20  # a long prefix splits the keys over programs (two launches)
    x = _inputs(dev, P=16)
    pages = -(-(ctx + 8) // 16)
    layers = 3
    caches = [(x["rnd"](2 * pages, 16, 2, 64), x["rnd"](2 * pages, 16, 2, 64))
              for _ in range(layers)]  # fmt: skip
    bt = torch.arange(2 * pages, dtype=torch.int32, device=dev).view(2, pages)
    sl = torch.tensor([ctx, ctx - 7], dtype=torch.int32, device=dev)
    tree = x["tree"]
    ws = treeops.tree_attention_workspace(x["q"], caches[0][0], bt)
    qs = [x["rnd"](2, 8, 4, 64) for _ in range(layers)]
    ks = [x["rnd"](2, 8, 2, 64) for _ in range(layers)]
    vs = [x["rnd"](2, 8, 2, 64) for _ in range(layers)]
    outs = [torch.empty_like(qs[0]) for _ in range(layers)]

    def reference():
        want = []
        for (kc, vc), q, k, v in zip(caches, qs, ks, vs, strict=True):
            kc, vc, q = kc.clone(), vc.clone(), q.clone()
            treeops.kv_append(k, v, kc, vc, bt, sl, tree.num_nodes, tree.depth, q=q)
            o = treeops.tree_attention(q, kc, vc, bt, sl, tree, workspace=ws)
            want.append((kc, vc, q, o))
        return want

    want = reference()
    kc0, vc0 = (c.clone() for c in caches[0])
    q0 = qs[0].clone()
    append = treeops.prepare(
        treeops.kv_append, ks[0], vs[0], kc0, vc0, bt, sl, tree.num_nodes, tree.depth, q=q0,
        rebind=("k", "v", "k_cache", "v_cache", "q"),
    )  # fmt: skip
    attn = treeops.prepare(treeops.tree_attention, q0, kc0, vc0, bt, sl, tree, out=outs[0],
                           workspace=ws, rebind=("q", "k_cache", "v_cache", "out"))  # fmt: skip
    assert append.fast and attn.fast, (append.reason, attn.reason)
    for layer, ((kc, vc), q, k, v) in enumerate(zip(caches, qs, ks, vs, strict=True)):
        append(k, v, kc, vc, q)
        got = attn(q, kc, vc, outs[layer])
        assert got is outs[layer]
        wk, wv, wq, wo = want[layer]
        assert torch.equal(kc, wk) and torch.equal(vc, wv) and torch.equal(q, wq)
        assert torch.equal(got, wo), layer
    assert append.replays == layers and attn.replays == layers
    # another layout of q: the op's call (its own launch), the same result
    q = want[0][2]
    strided = q.transpose(1, 2).contiguous().transpose(1, 2)
    o = torch.empty_like(q)
    attn(strided, *caches[0], o)
    assert attn.replays == layers and torch.equal(o, want[0][3])
    from treeops.testing import NoHostSync

    with NoHostSync():  # a dispatch mode: the op's call, which the mode sees
        attn(q, *caches[0], o)
    assert attn.replays == layers and torch.equal(o, want[0][3])
    with pytest.raises(ValueError, match="Invalid dtype of k_cache"):  # the op's check
        attn(q.float(), *caches[0], o)

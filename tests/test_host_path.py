"""The eager host path's memo of passed checks (``treeops._checks.signature`` / ``Memo``): a call
whose argument signature passed before skips the checks, and nothing else does — an argument that
differs in any checked property (type, shape, strides, dtype, device, a plain value and its
type) is checked in full and refused with the same message as on a first call."""

from __future__ import annotations

import pytest
import torch

import treeops
from treeops._checks import Memo, signature


def _tree(B=2, N=4):
    par = torch.tensor([[-1, 0, 0, 1]] * B, dtype=torch.int32)
    tok = torch.arange(B * N).view(B, N) + 1
    return treeops.Tree.from_parents(par, torch.full((B,), N, dtype=torch.int32), tok)


def test_signature_separates_what_checks_read():
    x = torch.zeros(2, 3)
    base = signature((x,), (1,))
    assert base == signature((torch.ones(2, 3),), (1,))  # values are not metadata
    for other in (
        signature((x.t().contiguous().t(),), (1,)),  # strides
        signature((x.double(),), (1,)),  # dtype
        signature((x.to("meta"),), (1,)),  # device
        signature((torch.nn.Parameter(x),), (1,)),  # type
        signature((x[None],), (1,)),  # shape
        signature((x,), (True,)),  # True == 1, but a bool is not an int
        signature((None,), (1,)),
    ):
        assert other != base
    assert signature(([1, 2],)) is None  # not a tensor: no memo, the full checks run


def test_memo_is_bounded_and_tolerates_unhashable_keys():
    m = Memo(maxsize=3)
    for i in range(5):
        m.put((i,), i)
    assert len(m) == 3 and m.get((0,)) is None and m.get((4,)) == 4
    assert m.get(([],)) is None  # an unhashable value argument: a miss, no error
    m.put(([],), 1)
    assert m.get(None) is None


def test_errors_after_a_passing_call_are_the_first_calls_errors():
    tree = _tree()
    q = torch.randn(2, 4, 2, 64)
    kc, vc = torch.randn(2, 16, 1, 64), torch.randn(2, 16, 1, 64)
    bt = torch.tensor([[0], [1]], dtype=torch.int32)
    sl = torch.tensor([3, 5], dtype=torch.int32)
    ok = treeops.tree_attention(q, kc, vc, bt, sl, tree)  # memoised from here on
    assert torch.equal(treeops.tree_attention(q, kc, vc, bt, sl, tree), ok)
    with pytest.raises(ValueError, match="Invalid dtype of q"):
        treeops.tree_attention(q.double(), kc, vc, bt, sl, tree)
    with pytest.raises(ValueError, match="Invalid stride of seq_lens"):
        treeops.tree_attention(q, kc, vc, bt, sl[:1].expand(2), tree)
    with pytest.raises(ValueError, match="Invalid value of sm_scale"):
        treeops.tree_attention(q, kc, vc, bt, sl, tree, sm_scale=-1.0)
    bad = _tree()
    bad.anc = bad.anc.transpose(0, 1).contiguous().transpose(0, 1)  # same shape, strided
    with pytest.raises(ValueError, match="Invalid stride of tree.anc"):
        treeops.tree_attention(q, kc, vc, bt, sl, bad)
    # validate=True checks values on every call, memo or not
    with pytest.raises(ValueError, match="seq_lens"):
        treeops.tree_attention(q, kc, vc, bt, torch.tensor([3, 40], dtype=torch.int32), tree,
                               validate=True)  # fmt: skip


def test_in_place_metadata_change_is_seen():
    tree = _tree()
    logits = torch.randn(2, 4, 8)
    treeops.accept_greedy(tree, logits)
    logits.resize_(2, 4, 8, 1)  # the same tensor object, another shape
    with pytest.raises(ValueError, match="Invalid shape of target_logits"):
        treeops.accept_greedy(tree, logits)


def test_graft_out_aliasing_is_checked_on_every_call():
    tree = _tree()
    table = treeops.AdjacencyTable(16, 4)
    template = treeops.RankTemplate.chain(2)
    out = treeops.Tree.uninitialized(2, 4)
    treeops.graft(tree, table, template, 4, out=out)  # memoised from here on
    with pytest.raises(ValueError, match="shares memory with tree"):
        treeops.graft(tree, table, template, 4, out=tree)


def test_kv_append_and_rope_checks_are_memoised_and_errors_unchanged():
    import importlib

    kv = importlib.import_module("treeops.kv_append")

    B, N, H, D = 2, 3, 2, 64
    k, v = torch.randn(B, N, H, D), torch.randn(B, N, H, D)
    kc, vc = torch.zeros(4, 16, H, D), torch.zeros(4, 16, H, D)
    bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    sl, nt = torch.tensor([3, 5], dtype=torch.int32), torch.tensor([3, 2], dtype=torch.int32)
    kv._PASSED.clear()
    treeops.kv_append(k, v, kc, vc, bt, sl, nt)
    assert len(kv._PASSED) == 1
    treeops.kv_append(k, v, kc, vc, bt, sl, nt)  # memo hit
    assert len(kv._PASSED) == 1
    with pytest.raises(ValueError, match="Invalid dtype of v"):
        treeops.kv_append(k, v.double(), kc, vc, bt, sl, nt)
    with pytest.raises(ValueError, match="Invalid value of rope_theta"):
        treeops.kv_append(k, v, kc, vc, bt, sl, nt, rope_theta=-1.0)
    with pytest.raises(ValueError, match="Invalid stride of num_tokens"):
        treeops.kv_append(k, v, kc, vc, bt, sl, nt[:1].expand(2))
    with pytest.raises(ValueError, match="seq_lens"):  # validate=True: values, every call
        treeops.kv_append(k, v, kc, vc, bt, torch.tensor([3, 40], dtype=torch.int32), nt,
                          validate=True)  # fmt: skip
    x, pos = torch.randn(2, 3, 4, 64), torch.zeros(2, 3, dtype=torch.int64)
    y = treeops.rope(x, pos)
    assert torch.equal(treeops.rope(x, pos), y) and len(kv._PASSED) == 2
    with pytest.raises(ValueError, match="Invalid shape of positions"):
        treeops.rope(x, pos[:, :2])
    with pytest.raises(ValueError, match="Invalid head dim of x"):
        treeops.rope(torch.randn(2, 3, 4, 63), pos)
    # other ranks than the kernel's 4-D layout
    assert torch.equal(treeops.rope(x[0], pos[0]), y[0])


# ---------------------------------------------------------------- the ops' direct (eager) path
from treeops import _library  # noqa: E402
from treeops._library import direct_ok  # noqa: E402
from treeops.testing import NoHostSync  # noqa: E402


def test_every_op_has_a_first_tensor_argument():
    assert _library.OPS
    for name, op in _library.OPS.items():
        assert op.first >= 0, name
        assert op.overload is getattr(torch.ops.treeops, name).default
        assert op.cuda is _library.CUDA_BACKENDS[name]


def test_direct_path_guard(monkeypatch):
    x = torch.zeros(2, 3)
    args = (x, x, 1.0, None, 3, True)
    assert not direct_ok(args, 0, 0)  # CPU tensors: the dispatcher (the CPU reference)
    monkeypatch.setattr(_library, "DIRECT", 2)  # as if they were on CUDA
    assert direct_ok(args, 0, 0)
    with NoHostSync():  # a TorchDispatchMode
        assert not direct_ok(args, 0, 0)

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Mode():
        assert not direct_ok(args, 0, 0)
    with torch.device("cpu"):  # a TorchFunctionMode too
        assert not direct_ok(args, 0, 0)
    assert not direct_ok((torch.nn.Parameter(x), x), 0, 0)  # a subclass, anywhere
    assert not direct_ok((x, torch.nn.Parameter(x)), 0, 0)
    assert not direct_ok((x, [x]), 0, 0)  # not a plain argument
    with torch.profiler.profile():
        assert not direct_ok(args, 0, 0)
    assert not direct_ok((x.to("meta"), x), 0, 0) or _library.DIRECT == 2
    g = torch.zeros(2, requires_grad=True)
    assert direct_ok((x, g), 0, 0)  # returns nothing: autograd is not involved
    assert not direct_ok((x, g), 0, 1)  # returns a tensor: the autograd fallback marks it
    with torch.no_grad():
        assert direct_ok((x, g), 0, 1)
    assert torch.vmap(lambda t: t + direct_ok((t,), 0, 0))(x).eq(0).all()  # functorch
    seen = []

    @torch.compile(backend="eager", fullgraph=True)
    def compiled(t):
        seen.append(direct_ok((t,), 0, 0))
        return t + 1

    compiled(x)
    assert seen == [False]
    monkeypatch.setattr(_library, "DIRECT", 0)
    assert not direct_ok(args, 0, 0)


def test_direct_path_calls_the_cuda_backend_with_the_same_arguments(monkeypatch):
    calls = []

    def backend(x, positions, theta):
        calls.append((x, positions, theta))
        return x + 1

    op = _library._make_op(torch.ops.treeops.rope.default, backend)
    x, pos = torch.randn(2, 3, 4, 64), torch.zeros(2, 3, dtype=torch.int64)
    ref = torch.ops.treeops.rope.default(x, pos, 10000.0)
    assert torch.equal(op(x, pos, 10000.0), ref) and not calls  # CPU: the dispatcher
    monkeypatch.setattr(_library, "DIRECT", 2)
    out = op(x, pos, 10000.0)
    assert len(calls) == 1 and calls[0][0] is x and calls[0][1] is pos
    assert torch.equal(out, x + 1)
    with NoHostSync():
        out = op(x, pos, 10000.0)
    assert torch.equal(out, ref) and len(calls) == 1
    xg = x.clone().requires_grad_()
    out = op(xg, pos, 10000.0)  # grad mode and an input requiring grad: the dispatcher
    assert len(calls) == 1 and out.requires_grad
    # ops returning several tensors give a tuple, as the OpOverload does
    op4 = _library._make_op(
        torch.ops.treeops.adjacency_retrieve.default, lambda *a: [a[1], a[1], a[1], a[1]]
    )
    r = op4(torch.zeros(4, 2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64),
            torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
            torch.zeros(1, dtype=torch.int32), 1, None, 1)  # fmt: skip
    assert r.__class__ is tuple and len(r) == 4


def test_direct_path_matches_the_dispatched_op(monkeypatch):
    """The public ops on CPU tensors with the direct path forced (DIRECT = 2): the CUDA backend
    (the Triton launcher, interpreted here) runs without the dispatcher, and computes what the
    dispatched op does."""
    x, pos = torch.randn(2, 3, 4, 64), torch.arange(6).view(2, 3)
    ref = treeops.rope(x, pos)
    tree = _tree()
    logits = torch.randn(2, 4, 16)
    acc_ref = treeops.accept_greedy(tree, logits)
    monkeypatch.setattr(_library, "DIRECT", 2)
    torch.testing.assert_close(treeops.rope(x, pos), ref)
    acc = treeops.accept_greedy(tree, logits)
    assert torch.equal(acc.accepted, acc_ref.accepted)
    assert torch.equal(acc.accept_len, acc_ref.accept_len)

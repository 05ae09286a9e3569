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

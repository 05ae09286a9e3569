"""``DraftState.reset``'s one-launch form (``treeops.kernels.draft_reset``) against the torch
writes it replaces: every field equal, exactly, for any state the writes start from."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import treeops
from treeops.kernels import draft_reset

FIELDS = ("root_tokens", "seq_lens", "active", "frontier", "frontier_tokens", "frontier_scores",
          "decisions", "u_hist", "cand_tokens", "cand_scores", "cand_parents")  # fmt: skip


def _scrambled(B: int, depth: int, topk: int, width: int, seed: int, dev="cpu"):
    """A state mid-step: every field the reset writes holds other values."""
    g = torch.Generator().manual_seed(seed)
    pol = treeops.EagleStatic(depth=depth, topk=topk, budget=2, width=width)
    state = treeops.DraftState.new(pol, torch.zeros(B, dtype=torch.int64),
                                   torch.zeros(B, dtype=torch.int64))  # fmt: skip
    for f in FIELDS:
        t = getattr(state, f)
        if t.dtype == torch.bool:
            t.copy_(torch.rand(t.shape, generator=g) < 0.5)
        elif t.is_floating_point():
            t.copy_(torch.randn(t.shape, generator=g))
        else:
            t.copy_(torch.randint(-5, 1000, t.shape, generator=g))
    state.layer = 3
    return state.to(dev) if dev != "cpu" else state


def _inputs(B: int, seed: int, seq_dtype, with_active: bool, strided: bool, dev="cpu"):
    g = torch.Generator().manual_seed(seed + 1)
    step = 3 if strided else 1
    roots = torch.randint(0, 50000, (B * step,), generator=g)[::step]
    seq = torch.randint(0, 9000, (B * step,), generator=g).to(seq_dtype)[::step]
    active = (torch.rand(B * step, generator=g) < 0.6)[::step] if with_active else None
    move = (lambda t: None if t is None else t.to(dev)) if dev != "cpu" else (lambda t: t)
    return move(roots), move(seq), move(active)


@given(
    B=st.integers(1, 9),
    depth=st.integers(1, 5),
    topk=st.integers(1, 6),
    extra=st.integers(0, 3),
    seed=st.integers(0, 1000),
    seq64=st.booleans(),
    with_active=st.booleans(),
    strided=st.booleans(),
)
def test_kernel_reset_equals_the_torch_writes(
    B, depth, topk, extra, seed, seq64, with_active, strided
):
    """The kernel (interpreter) on one copy of a scrambled state, the torch writes on another:
    every field equal (the candidates, which neither writes, untouched), ``layer`` 0 after the
    public call; inputs strided or not, int32 or int64 lengths, with or without ``active``."""
    a = _scrambled(B, depth, topk, topk + extra, seed)
    b = a.to("cpu")
    dt = torch.int64 if seq64 else torch.int32
    roots, seq, active = _inputs(B, seed, dt, with_active, strided)
    draft_reset.reset(a, roots, seq, active)
    b.reset(roots, seq, active)  # CPU: the torch writes
    for f in FIELDS:
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert b.layer == 0


def test_reset_reads_its_inputs_before_writing():
    """``reset(state.root_tokens, state.seq_lens, state.active)``: the state's own buffers as
    inputs give what copies of them give."""
    a = _scrambled(4, 3, 2, 3, 7)
    b = a.to("cpu")
    draft_reset.reset(a, a.root_tokens, a.seq_lens, a.active)
    b.reset(b.root_tokens.clone(), b.seq_lens.clone(), b.active.clone())
    for f in FIELDS:
        assert torch.equal(getattr(a, f), getattr(b, f)), f


@pytest.mark.gpu
@pytest.mark.parametrize("with_active", [False, True])
def test_gpu_reset_equals_the_torch_writes(with_active):
    """On CUDA the public ``reset`` is the one launch: equal, field for field, to the torch
    writes on a CPU copy; and it is captured and replayed in a CUDA graph like the writes."""
    for B, depth, topk, width in ((1, 6, 10, 10), (64, 6, 10, 10), (5, 3, 4, 7)):
        a = _scrambled(B, depth, topk, width, B, dev="cuda")
        b = a.to("cpu")
        roots, seq, active = _inputs(B, B, torch.int64, with_active, True, dev="cuda")
        a.reset(roots, seq, active)
        b.reset(roots.cpu(), seq.cpu(), None if active is None else active.cpu())
        for f in FIELDS:
            assert torch.equal(getattr(a, f).cpu(), getattr(b, f)), (B, f)
    g = torch.cuda.CUDAGraph()
    a.frontier.fill_(7)
    with torch.cuda.graph(g):
        a.reset(roots, seq, active)
    a.frontier.fill_(7)
    g.replay()
    torch.cuda.synchronize()
    assert bool((a.frontier == -1).all())

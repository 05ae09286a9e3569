"""Launcher state across calls and CUDA graphs (CPU; kernels under the interpreter): buffers a
launcher caches are never first built inside a graph capture (a clear error instead of buffers
that only the capturing graph initialises), replaced workspaces stay alive, graft's claims are
undone when its second launch fails, and a batch too large for the attention grid is refused."""

import pytest
import torch

import treeops
from treeops.build_tree import _launch_expand as launch_expand
from treeops.kernels import _counters as kcount
from treeops.kernels import build_tree_tiling as kt
from treeops.kernels import compact_kv as kc
from treeops.kernels import graft_update as kgu
from treeops.kernels import kv_append as kk


@pytest.fixture
def capturing(monkeypatch):
    """Pretend a CUDA graph is being captured on the current stream."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)


def test_cached_buffers_are_not_built_during_capture(capturing):
    cpu = torch.device("cpu")
    with pytest.raises(RuntimeError, match="arrival counters.*outside CUDA-graph capture"):
        kcount.arrival_counters(cpu, 10**7)  # larger than any cached buffer: a miss
    with pytest.raises(RuntimeError, match="RoPE frequency table"):
        kk.inv_freq(6, 1234.5, cpu)
    with pytest.raises(RuntimeError, match="table of layer addresses"):
        kc._pointer_table([torch.zeros(2), torch.zeros(2)])


def test_cache_hits_are_fine_during_capture(monkeypatch):
    cpu = torch.device("cpu")
    c = kcount.arrival_counters(cpu, 8)  # built eagerly, as the warm-up call does
    f = kk.inv_freq(8, 500.0, cpu)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert kcount.arrival_counters(cpu, 8) is c
    assert kk.inv_freq(8, 500.0, cpu) is f


def _state(B=2, V=1024):
    pol = treeops.EagleStatic(depth=2, topk=2, budget=5)
    st = treeops.DraftState.new(pol, torch.zeros(B, dtype=torch.int64), torch.full((B,), 3))
    return pol, st, torch.randn(B, 1, V)


def test_expand_split_workspace_not_built_during_capture(capturing):
    pol, st, logits = _state()
    with pytest.raises(RuntimeError, match="split workspace"):
        launch_expand(logits, st, pol, split=2, block_v=256)


def test_expand_split_workspace_replaced_stays_alive():
    pol, st, logits = _state()
    launch_expand(logits, st, pol, split=2, block_v=256)
    first = st.workspace["part_m"]
    wide = torch.randn(2, 1, 4096)  # more splits x rows: a larger workspace
    launch_expand(wide, st, pol, split=8, block_v=256)
    assert st.workspace["part_m"] is not first
    assert any(t is first for t in kt._RETIRED)


def test_graft_claims_undone_when_the_write_launch_fails(monkeypatch):
    V, K = 50, 4
    table = torch.full((V, K), -1, dtype=torch.int32)
    owner = torch.full((V,), kgu.INT32_MAX, dtype=torch.int32)
    tokens = torch.tensor([[3, 7, 3], [9, 3, 1]])
    num = torch.tensor([3, 3], dtype=torch.int32)
    ids = torch.randint(0, V, (2, 3, K), dtype=torch.int32)
    seen = {}

    class Failing:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                seen["claimed"] = int((owner != kgu.INT32_MAX).sum())
                raise KeyboardInterrupt  # e.g. interrupted between the two launches

            return launch

    monkeypatch.setattr(kgu, "_update_write_kernel", Failing())
    with pytest.raises(KeyboardInterrupt):
        kgu.adjacency_update(table, owner, {}, tokens, num, None, ids, False)
    assert seen["claimed"] > 0  # the claim kernel did claim tokens before the failure
    assert bool((owner == kgu.INT32_MAX).all())  # ... and every claim was undone


def test_attention_batch_beyond_the_grid_is_refused():
    B, H_kv = 8193, 8  # B x H_kv = 65544 > 65535
    tree = treeops.Tree.from_parents(
        torch.full((B, 1), -1, dtype=torch.int32),
        torch.ones(B, dtype=torch.int32),
        torch.zeros(B, 1, dtype=torch.int64),
    )
    q = torch.zeros(B, 1, H_kv, 64, dtype=torch.float16)
    cache = torch.zeros(1, 16, H_kv, 64, dtype=torch.float16)
    bt = torch.zeros(B, 1, dtype=torch.int32)
    seq = torch.zeros(B, dtype=torch.int32)
    with pytest.raises(ValueError, match="batch x KV heads = 8193 x 8 exceeds 65535"):
        treeops.tree_attention(q, cache, cache, bt, seq, tree)


def test_expand_split_workspace_replaced_when_rows_grow():
    """More frontier rows (layer 1: W = 2) with no more partials than before: the block maxima
    (one row of them per frontier row) are too small, and the workspace is replaced."""
    pol, st, logits = _state(V=4096)
    launch_expand(logits, st, pol, split=8, block_v=256, max_block=256)  # 2 x 8 = 16 partials
    tiles = st.workspace["part_t"]
    st.layer = 1
    wide = torch.randn(2, 2, 4096)
    launch_expand(wide, st, pol, split=2, block_v=256, max_block=256)  # 4 rows x 2 = 8 partials
    assert st.workspace["part_t"].shape == (4 * 16,)
    assert st.workspace["part_t"] is not tiles
    assert any(t is tiles for t in kt._RETIRED)


def test_expand_split_workspace_kept_when_layers_alternate_blocks(monkeypatch):
    """A step's root layer (B rows, small blocks: many of them) and later layers (B * W rows,
    larger blocks) need different row strides of the block maxima; once both shapes have run
    eagerly, a captured step reuses the grown buffers (at B 64 on the H200 the root layer's
    64-token blocks and the later layers' 128-token ones once rebuilt them every layer, and a
    step could not be captured)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    pol, st, logits = _state(V=4096)
    wide = torch.randn(2, 2, 4096)

    def step():
        st.layer = 0
        launch_expand(logits, st, pol, split=2, block_v=256, max_block=16)  # 2 rows x 256 blocks
        st.layer = 1
        launch_expand(wide, st, pol, split=2, block_v=256, max_block=64)  # 4 rows x 64 blocks

    step()
    kept = [st.workspace[k] for k in ("part_m", "part_s", "part_t")]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    step()  # would raise "split workspace" if either layer rebuilt the buffers
    assert all(st.workspace[k] is t for k, t in zip(("part_m", "part_s", "part_t"), kept))

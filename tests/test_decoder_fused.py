"""The example decoder's fused forwards (treeops/decoder/fused.py and the fused path of
treeops/decoder/model.py), on the CPU.

Each Triton kernel runs in the interpreter on CPU tensors against its PyTorch form (fp32 and fp16,
odd sizes, strided inputs). The fused Target/Draft forwards, forced onto CPU tensors
(``fused.on_cpu()``: concatenated weights and these kernels), equal the unfused per-layer forward
(``forward_unfused``) up to rounding, and the default CPU forward equals it exactly. The fused
forward's launch sites are counted per layer (no stray elementwise op, no cast inside a layer),
its glue never syncs with the host, and a decoder run on it gives the CPU decoder's tokens.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import treeops.decoder.model as M
from treeops import Tree
from treeops.decoder import Decoder, Draft, ModelConfig, Target, fused, make_policy
from treeops.decoder.model import chain_tree
from treeops.testing import NoHostSync
from treeops.tree import anc_words, bit_value


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny matmuls: one intra-op thread (see tests/test_decoder.py)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _tol(dtype):
    # fp16: one rounding of the output may differ (reduction order, exp); fp32: a few ulps
    return dict(atol=2e-3, rtol=2e-3) if dtype == torch.float16 else dict(atol=1e-5, rtol=1e-5)


# -------------------------------------------------------------------------------- the kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 1), (3, 37), (2, 5, 100), (1, 3, 640)])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rmsnorm(dtype, shape, with_delta):
    H = shape[-1]
    x = torch.randn(shape).to(dtype)
    delta = torch.randn(shape).to(dtype) if with_delta else None
    w = (1 + 0.1 * torch.randn(H)).to(dtype)
    xo, y = fused.add_rmsnorm(x, delta, w, 1e-6)
    xr, yr = fused.add_rmsnorm_torch(x, delta, w, 1e-6)
    assert xo.dtype == y.dtype == dtype and y.shape == x.shape
    if with_delta:
        assert torch.equal(xo, xr)  # the add rounds once, as PyTorch's
    else:
        assert xo is x
    torch.testing.assert_close(y, yr, **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_add_rmsnorm_gathers_embedding_rows(dtype):
    """With ``tokens`` (strided [B, R]) x is an embedding table: x' = table[tokens], written."""
    V, H = 11, 72
    table = torch.randn(V, H).to(dtype)
    tokens = torch.randint(0, V, (3, 10))[:, ::2]  # [3, 5], strided
    w = torch.randn(H).to(dtype)
    xo, y = fused.add_rmsnorm(table, None, w, 1e-5, tokens=tokens)
    emb = torch.nn.functional.embedding(tokens, table)
    assert torch.equal(xo, emb)
    torch.testing.assert_close(y, fused.add_rmsnorm_torch(emb, None, w, 1e-5)[1], **_tol(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1, 2), (3, 14), (2, 3, 154), (1, 2 * 1100)])
def test_swiglu(dtype, shape):
    gu = (3 * torch.randn(shape)).to(dtype)
    out = fused.swiglu(gu)
    assert out.shape == (*shape[:-1], shape[-1] // 2) and out.dtype == dtype
    torch.testing.assert_close(out, fused.swiglu_torch(gu), **_tol(dtype))


@pytest.mark.parametrize(("fdtype", "dtype"), [(torch.float32, torch.float32),
                                               (torch.float32, torch.float16),
                                               (torch.float16, torch.float16)])  # fmt: skip
def test_embed_cat(fdtype, dtype):
    V, H, B, R = 13, 40, 3, 5
    table = torch.randn(V, H).to(dtype)
    tokens = torch.randint(0, V, (B, 2 * R))[:, 1::2]  # strided
    feats = torch.randn(B, R + 2, H).to(fdtype)[:, 1 : R + 1]  # strided rows
    out = fused.embed_cat(tokens, feats, table, dtype)
    assert torch.equal(out, fused.embed_cat_torch(tokens, feats, table, dtype))


@pytest.mark.parametrize("seq_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(("N", "R"), [(1, 1), (7, 3), (13, 5), (40, 9)])
def test_tree_index(seq_dtype, N, R):
    B = 3
    seq = torch.tensor([0, 17, 1000], dtype=seq_dtype)
    depth = torch.randint(0, 6, (B, 2 * N), dtype=torch.int32)[:, ::2]  # strided
    pos, idx, base, rel = fused.tree_index(seq, depth)
    assert idx is None and base is None and rel is None
    assert torch.equal(pos, fused.tree_index_torch(seq, depth)[0])
    if R > N:
        return
    # frontier rows from q_start (clamped at the last node, as the unfused code)
    q_start = torch.tensor([0, N - R, max(N - 2, 0)], dtype=torch.int32)
    got = fused.tree_index(seq, depth, q_start, R)
    want = fused.tree_index_torch(seq, depth, q_start, R)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w)


def _frontier_case(B, w, K, D, H, dtype, dev="cpu", strided=False):
    """A plan's draft buffers as ``PlanBuffers`` shapes them (working tree of 1 + max(D - 1, 1) w
    nodes inside a decoder scratch of more, its candidate -> node table, per-layer [3, B]
    metadata) with random contents: depth, every bit of anc, features with NaN/inf/-0. Strided:
    the tree and feature tensors are column slices of wider ones."""
    g = torch.Generator().manual_seed(B * 1000 + w * 100 + K * 10 + D)
    nd = 1 + max(D - 1, 1) * w
    Nd = nd + 5  # the decoder's widest working tree
    Wd = anc_words(nd)
    C = w * K
    c = torch.arange(D * C)
    lay = c // C
    row = torch.where(lay > 0, 1 + (lay - 1) * w + (c - lay * C) // K, 0)
    cand_node = torch.cat([row, row.new_zeros(1)])
    self_bits = torch.zeros(Nd, anc_words(Nd), dtype=torch.int32)
    for k in range(Nd):
        self_bits[k, k // 32] = bit_value(k)
    s = 2 if strided else 1
    depth = torch.randint(0, 50, (B, nd * s), generator=g, dtype=torch.int32)[:, ::s]
    anc = torch.randint(-(2**31), 2**31, (B, nd * s, Wd), generator=g, dtype=torch.int32)[:, ::s]
    hid = torch.randn(B, nd, H * s, generator=g)[:, :, ::s]
    hid[0, 0, :3] = torch.tensor([float("nan"), float("-inf"), -0.0])
    hid = hid.to(dtype)
    feat = torch.randn(B, w * s, H, generator=g).to(dtype)[:, ::s]
    meta = torch.randint(0, 99, (D, 3, B), generator=g, dtype=torch.int32)
    meta_out = torch.full((3, B), -7, dtype=torch.int32)
    ts = [cand_node, depth, anc, self_bits, hid, feat, meta, meta_out]
    return [t.to(dev) for t in ts], C


def _check_frontier_inputs(B, w, K, D, H, dtype, dev, strided):
    """Every layer i >= 1 of a draft, in order, by the kernel and by the PyTorch ops on copies of
    the same buffers: equal bit for bit after each layer, rows outside the frontier untouched."""
    (cand_node, depth, anc, bits, hid, feat, meta, meta_out), C = _frontier_case(
        B, w, K, D, H, dtype, dev, strided
    )
    ref = [t.clone() for t in (depth, anc, feat, meta_out)]
    g = torch.Generator().manual_seed(7)
    for i in range(1, D):
        # candidates of layers < i (nodes before q_start) or -1 (unused: the root)
        frontier = torch.randint(-1, i * C, (B, w), generator=g, dtype=torch.int32)
        frontier[0, -1] = -1
        frontier = frontier.to(dev)
        qs = 1 + (i - 1) * w
        before = depth.clone(), anc.clone()
        fused.frontier_inputs(frontier, cand_node, qs, depth, anc, bits, hid, feat, meta[i],
                              meta_out)  # fmt: skip
        fused.frontier_inputs_torch(frontier, cand_node, qs, ref[0], ref[1], bits, hid, ref[2],
                                    meta[i], ref[3])  # fmt: skip
        assert torch.equal(depth, ref[0]) and torch.equal(anc, ref[1])
        assert torch.equal(meta_out, meta[i]) and torch.equal(meta_out, ref[3])
        # a copy: bit for bit, -0 and NaN payloads too (PyTorch's CPU gather of bf16 rewrites a
        # NaN's bits: NaN there, the same bits elsewhere)
        ib = {torch.float32: torch.int32}.get(dtype, torch.int16)
        p = cand_node[frontier.long()]
        hb = hid.view(ib).gather(1, p[:, :, None].expand(B, w, H))
        assert torch.equal(feat.view(ib), hb)
        nan = ref[2].isnan()
        assert torch.equal(feat.isnan(), nan) and nan[0, -1, 0]  # (the root's, row -1 reads)
        assert torch.equal(feat.view(ib)[~nan], ref[2].view(ib)[~nan])
        out = torch.ones(depth.shape[1], dtype=torch.bool, device=dev)
        out[qs : qs + w] = False
        assert torch.equal(depth[:, out], before[0][:, out])
        assert torch.equal(anc[:, out], before[1][:, out])
        assert torch.equal(depth[:, qs : qs + w], before[0].gather(1, p) + 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("B", "w", "K", "D", "H"),
                         [(1, 1, 1, 2, 8), (3, 4, 3, 5, 40), (2, 8, 2, 6, 96),
                          (2, 16, 4, 4, 33), (1, 3, 2, 2, 3000)])  # fmt: skip
@pytest.mark.parametrize("strided", [False, True])
def test_frontier_inputs(B, w, K, D, H, dtype, strided):
    """The draft's per-layer frontier inputs in one kernel equal the PyTorch ops exactly (the
    feature copy moves bits: bf16 too, in the interpreter); Wd = 1 and 2 words, H over one
    block (3000)."""
    _check_frontier_inputs(B, w, K, D, H, dtype, "cpu", strided)


# ------------------------------------------------------------------------------ the models
CFG = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  tie_word_embeddings=False)  # fmt: skip


@pytest.fixture(scope="module")
def models():
    return Target(CFG, seed=0), Draft(CFG, seed=1)


def _tree(B=2, N=7):
    tok = torch.randint(0, CFG.vocab_size, (B, N))
    par = torch.tensor([[-1, 0, 0, 1, 1, 2, 3], [-1, 0, 1, 2, 0, 4, 5]], dtype=torch.int32)
    return Tree.from_parents(par[:B, :N], torch.tensor([7, 5], dtype=torch.int32)[:B], tok)


def _cache(model, B, seed, dtype):
    kv = model.make_cache(B, 64)
    g = torch.Generator().manual_seed(seed)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g))
    kv.k, kv.v = kv.k.to(dtype), kv.v.to(dtype)
    return kv


def _target_run(target, fn, tree, seq, dtype):
    kv = _cache(target, tree.batch_size, 1, dtype)
    logits, h = fn(tree.tokens, kv, seq, tree)
    return logits, h, kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("chain", [False, True])
def test_target_fused_equals_unfused(dtype, chain):
    """A verification tree and a prefill chain: logits, hidden and the cache writes."""
    target = Target(CFG, seed=0).to(dtype)
    tree = _tree()
    if chain:
        tree = chain_tree(tree.tokens, torch.tensor([7, 4], dtype=torch.int32))
    seq = torch.tensor([5, 9], dtype=torch.int32)
    ref = _target_run(target, target.forward_unfused, tree, seq, dtype)
    cpu = _target_run(target, target.forward, tree, seq, dtype)
    for a, b in zip(ref[:2], cpu[:2]):
        assert torch.equal(a, b)  # the CPU path is the unfused math, op for op
    assert torch.equal(ref[2].k, cpu[2].k) and torch.equal(ref[2].v, cpu[2].v)
    with fused.on_cpu():
        got = _target_run(target, target.forward, tree, seq, dtype)
    rows = torch.arange(7)[None, :] < tree.num_nodes[:, None]  # padding rows: unused
    tol = dict(atol=3e-2, rtol=3e-2) if dtype == torch.float16 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[0][rows], ref[0][rows], **tol)
    torch.testing.assert_close(got[1][rows], ref[1][rows], **tol)
    torch.testing.assert_close(got[2].k, ref[2].k, **tol)
    torch.testing.assert_close(got[2].v, ref[2].v, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_target_logits_native_and_none(dtype):
    """``logits="native"``: the head's output in the weights' dtype, whose float32 cast is the
    default's logits exactly; ``"none"``: no head, the same hidden states and cache writes; any
    other value a ValueError naming the argument."""
    target = Target(CFG, seed=0).to(dtype)
    tree = _tree()
    seq = torch.tensor([5, 9], dtype=torch.int32)
    for ctx in (fused.on_cpu(), torch.no_grad()):
        with ctx:
            ref = _target_run(target, target.forward, tree, seq, dtype)
            native = _target_run(target, lambda *a: target.forward(*a, logits="native"), tree,
                                 seq, dtype)  # fmt: skip
            none = _target_run(target, lambda *a: target.forward(*a, logits="none"), tree, seq,
                               dtype)  # fmt: skip
        assert native[0].dtype == dtype and torch.equal(native[0].float(), ref[0])
        assert none[0] is None and torch.equal(none[1], ref[1])
        assert torch.equal(none[2].k, ref[2].k) and torch.equal(none[2].v, ref[2].v)
    with pytest.raises(ValueError, match="logits"):
        target.forward(tree.tokens, _cache(target, 2, 1, dtype), seq, tree, logits="bf16")


@pytest.mark.parametrize("frontier", [True, False])
def test_draft_fused_equals_unfused(models, frontier):
    """The draft's frontier forward (rows q_start .. q_start + q_len - 1; the rest ignored) and
    its whole-tree forward (catch-up)."""
    target, draft = models
    tree = _tree()
    B = 2
    seq = torch.tensor([5, 9], dtype=torch.int32)
    if frontier:
        R = 3
        qs, ql = torch.tensor([1, 4], dtype=torch.int32), torch.tensor([3, 1], dtype=torch.int32)
        valid = torch.arange(R)[None, :] < ql[:, None]
    else:
        R, qs, ql = 7, None, None
        valid = torch.arange(R)[None, :] < tree.num_nodes[:, None]
    tok = tree.tokens[:, :R]
    feats = torch.randn(B, R, CFG.hidden_size)

    def run(fn):
        kv = _cache(draft, B, 2, torch.float32)
        logits, h = fn(target, tok, feats, kv, seq, tree, qs, ql)
        return logits, h, kv

    ref = run(draft.forward_unfused)
    cpu = run(draft.forward)
    assert torch.equal(ref[0][valid], cpu[0][valid]) and torch.equal(ref[1][valid], cpu[1][valid])
    assert torch.equal(ref[2].k, cpu[2].k) and torch.equal(ref[2].v, cpu[2].v)
    with fused.on_cpu():
        got = run(draft.forward)
    torch.testing.assert_close(got[0][valid], ref[0][valid], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1][valid], ref[1][valid], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[2].k, ref[2].k, atol=1e-5, rtol=1e-5)


def test_concatenated_weights_follow_the_parameters():
    """Built once and reused; an in-place update (or a dtype change) rebuilds them, into the
    same tensor when the shape, dtype and device stay (CUDA graphs captured with it see the new
    weights); the separate parameters (training) are untouched."""
    target = Target(CFG, seed=3)
    attn, mlp = target.model.layers[0].self_attn, target.model.layers[0].mlp
    target.fuse()
    w = attn.wqkv()
    assert attn.wqkv() is w and mlp.wgu() is mlp.wgu()
    torch.testing.assert_close(w, torch.cat([attn.q_proj.weight, attn.k_proj.weight,
                                             attn.v_proj.weight]), atol=0, rtol=0)  # fmt: skip
    with torch.no_grad():
        attn.k_proj.weight.mul_(2)
        mlp.up_proj.weight.add_(1)
    w2 = attn.wqkv()
    assert w2 is w  # rebuilt in place
    H = CFG.num_attention_heads * CFG.head_dim
    assert torch.equal(w2[H : H + attn.k_proj.weight.shape[0]], attn.k_proj.weight)
    assert torch.equal(mlp.wgu()[CFG.intermediate_size :], mlp.up_proj.weight)
    target.half()
    assert attn.wqkv().dtype == torch.float16 and attn.wqkv() is not w
    assert not attn.wqkv().requires_grad
    assert all(p.grad is None for p in target.parameters())


# ------------------------------------------------------------------------- launch sites, syncs
_VIEWS = {"view", "_unsafe_view", "t", "slice", "expand", "empty", "empty_strided", "unsqueeze",
          "select", "alias", "detach", "as_strided", "transpose", "reshape"}  # fmt: skip
_TREEOPS = ("kv_append", "tree_attention")
_FUSED = ("add_rmsnorm", "swiglu", "embed_cat", "tree_index")


class _Sites(TorchDispatchMode):
    """Records every aten op that would launch work (views and allocations aside) and every call
    of the wrapped ops (their insides not recorded)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.depth = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if self.depth == 0 and name not in _VIEWS:
            self.ops.append(name)
        return func(*args, **(kwargs or {}))

    def wrap(self, name, fn):
        def call(*a, **k):
            if self.depth == 0:
                self.ops.append(name)
            self.depth += 1
            try:
                return fn(*a, **k)
            finally:
                self.depth -= 1

        return call


@pytest.mark.parametrize("frontier", [True, False])
def test_draft_cache_only_forward_writes_the_same_cache(models, frontier):
    """``outputs=False`` (a catch-up or prefill: nobody reads the logits or hidden states)
    appends the same K and V as the whole forward and returns None, on the CPU path exactly and
    on the fused path (one k/v GEMM over the concatenated weight's rows) to rounding; with
    ``logits_out`` the logits land in the given (strided) buffer, equal to the returned ones."""
    target, draft = models
    tree = _tree()
    B = 2
    seq = torch.tensor([5, 9], dtype=torch.int32)
    R, qs, ql = 7, None, None
    if frontier:
        R, qs, ql = (
            3,
            torch.tensor([1, 4], dtype=torch.int32),
            torch.tensor([3, 1], dtype=torch.int32),
        )
    tok = tree.tokens[:, :R]
    feats = torch.randn(B, R, CFG.hidden_size)

    def run(**kw):
        kv = _cache(draft, B, 2, torch.float32)
        return draft.forward(target, tok, feats, kv, seq, tree, qs, ql, **kw), kv

    (logits, _), full = run()
    none, kv_only = run(outputs=False)
    assert none is None
    assert torch.equal(kv_only.k, full.k) and torch.equal(kv_only.v, full.v)
    store = torch.full((B, R + 2, CFG.vocab_size), float("nan"))
    (out, _), _ = run(logits_out=store[:, 1 : R + 1])
    assert out.data_ptr() == store[:, 1].data_ptr() and torch.equal(out, logits)
    assert store[:, 0].isnan().all() and store[:, R + 1].isnan().all()
    with fused.on_cpu():
        (_, _), full = run()
        none, kv_only = run(outputs=False)
    assert none is None
    torch.testing.assert_close(kv_only.k, full.k, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(kv_only.v, full.v, atol=1e-6, rtol=1e-6)


def test_fused_forward_launch_sites(models, monkeypatch):
    """Per target layer: 2 add+RMSNorm, 4 GEMMs (q/k/v, o, gate/up, down), SwiGLU, kv_append
    (which rotates q too), tree_attention and nothing else (no cast, no elementwise op); per
    forward the final norm and the LM head. The draft's frontier forward: its index math, its fc
    input (one kernel) and GEMM, its layer, the scatter/gather around attention, its norm and
    head; its cache-only forward (a catch-up): the fc input and GEMM, the input norm, one k/v
    GEMM and kv_append."""
    target, draft = models
    # the unpoisoned allocator (tests/conftest.py fills torch.empty's memory: a fill_ to ignore)
    monkeypatch.setattr(torch, "empty", torch._C._VariableFunctions.empty)
    s = _Sites()
    for name in _TREEOPS:
        monkeypatch.setattr(M, name, s.wrap(name, getattr(M, name)))
    for name in _FUSED:
        monkeypatch.setattr(fused, name, s.wrap(name, getattr(fused, name)))
    tree = _tree()
    seq = torch.tensor([5, 9], dtype=torch.int32)
    kv, dkv = _cache(target, 2, 1, torch.float32), _cache(draft, 2, 2, torch.float32)
    feats = torch.randn(2, 3, CFG.hidden_size)
    qs, ql = torch.tensor([1, 4], dtype=torch.int32), torch.tensor([3, 1], dtype=torch.int32)
    L = CFG.num_hidden_layers
    with fused.on_cpu(), torch.no_grad():
        target.fuse()
        draft.fuse()
        with s:
            target(tree.tokens, kv, seq, tree)
        per_layer = {"add_rmsnorm": 2, "mm": 4, "swiglu": 1, "kv_append": 1,
                     "tree_attention": 1}  # fmt: skip
        want = Counter({k: v * L for k, v in per_layer.items()})
        want.update({"add_rmsnorm": 1, "mm": 1})  # final norm, head
        assert Counter(s.ops) == want, s.ops
        s.ops.clear()
        with s:
            draft(target, tree.tokens[:, :3], feats, dkv, seq, tree, qs, ql)
        want = Counter({k: v for k, v in per_layer.items()})
        # fc input and GEMM, the final norm, the head, the index math, scatter/gather
        want.update({"embed_cat": 1, "mm": 2, "add_rmsnorm": 1, "tree_index": 1, "scatter_": 1,
                     "gather": 1})  # fmt: skip
        assert Counter(s.ops) == want, s.ops
        s.ops.clear()
        feats = torch.randn(2, 7, CFG.hidden_size)
        with s:  # a catch-up: K and V only (fc input and GEMM, the input norm, one k/v GEMM)
            draft(target, tree.tokens, feats, dkv, seq, tree, outputs=False)
        want = Counter({"embed_cat": 1, "mm": 2, "add_rmsnorm": 1, "kv_append": 1})
        assert Counter(s.ops) == want, s.ops


def test_fused_forward_never_syncs(models, monkeypatch):
    """The fused forwards' glue (everything but the kernels, which run in the interpreter here)
    under ``NoHostSync``: no host read, no value-dependent shape."""
    target, draft = models
    check = NoHostSync()
    for name in _TREEOPS:
        monkeypatch.setattr(M, name, check.opaque(getattr(M, name)))
    for name in _FUSED:
        monkeypatch.setattr(fused, name, check.opaque(getattr(fused, name)))
    tree = _tree()
    seq = torch.tensor([5, 9], dtype=torch.int32)
    kv, dkv = _cache(target, 2, 1, torch.float32), _cache(draft, 2, 2, torch.float32)
    feats = torch.randn(2, 3, CFG.hidden_size)
    qs, ql = torch.tensor([1, 4], dtype=torch.int32), torch.tensor([3, 1], dtype=torch.int32)
    with fused.on_cpu(), torch.no_grad():
        target.fuse()
        draft.fuse()
        with check:
            target(tree.tokens, kv, seq, tree)
            draft(target, tree.tokens[:, :3], feats, dkv, seq, tree, qs, ql)
            draft(target, tree.tokens, torch.randn(2, 7, CFG.hidden_size), dkv, seq, tree)
    assert check.ops_checked > 20


def _friendly_pair() -> tuple[Target, Draft]:
    """A tiny fp32 pair whose target is close to its bigram draft (deep acceptance)."""
    cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      tie_word_embeddings=False)  # fmt: skip
    target = Target(cfg, seed=0)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.mul_(0.1)
    return target, Draft(cfg, seed=1).bigram_init(target)


@pytest.mark.parametrize(
    ("policy", "kw"),
    [("EagleStatic", {}), ("Cast", {"static_shapes": True}),
     ("EagleStatic", {"static_shapes": True, "step_graphs": True})],
)  # fmt: skip
def test_decoder_on_the_fused_forwards(policy, kw):
    """The decoder on the fused forwards (forced onto the CPU) gives the CPU decoder's greedy
    tokens and acceptance (a target close to its bigram draft: deep acceptance)."""
    target, draft = _friendly_pair()
    prompts = [[5, 17, 3, 99, 42, 7, 8], [11, 64]]

    def dec():
        # (Cast with thresholds: its sizes follow the scores, not the measured step times)
        pol = make_policy(policy, depth=3, topk=3, budget=12, C1=0.3)
        return Decoder(target, draft, pol, **kw)

    ref = dec().generate(prompts, 8)
    with fused.on_cpu():
        got = dec().generate(prompts, 8)
    assert got.tokens == ref.tokens and got.emitted == ref.emitted
    assert ref.mean_accepted > 1.0


# ---------------------------------------------------------------------- compiled (GPU only)
def _gpu_tol(dtype):
    return {
        torch.float32: dict(atol=1e-5, rtol=1e-5),
        torch.float16: dict(atol=2e-3, rtol=2e-3),
        torch.bfloat16: dict(atol=2e-2, rtol=2e-2),  # one bf16 rounding step
    }[dtype]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernels_compiled_match_torch(dtype):
    """The compiled kernels against their PyTorch forms on CUDA, at the trained H200 pair's
    sizes (H = 640, I = 1728) and odd ones; bf16 included (the interpreter cannot do bf16)."""
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g, device=dev)).to(dtype)

    for lead, H in (((1, 1), 640), ((4, 60), 640), ((3, 7), 100)):
        x, d, w = rnd(*lead, H), rnd(*lead, H), 1 + rnd(H, scale=0.1)
        xo, y = fused.add_rmsnorm(x, d, w, 1e-6)
        xr, yr = fused.add_rmsnorm_torch(x, d, w, 1e-6)
        assert torch.equal(xo, xr)
        torch.testing.assert_close(y, yr, **_gpu_tol(dtype))
        if dtype != torch.float32:  # the output's rounding differs only near ties
            assert (y == yr).float().mean() > 0.95
        _, y0 = fused.add_rmsnorm(x, None, w, 1e-6)
        torch.testing.assert_close(y0, fused.add_rmsnorm_torch(x, None, w, 1e-6)[1],
                                   **_gpu_tol(dtype))  # fmt: skip
    table = rnd(512, 640)
    tokens = torch.randint(0, 512, (4, 9), device=dev)[:, 1:]
    xo, y = fused.add_rmsnorm(table, None, w := 1 + rnd(640, scale=0.1), 1e-6, tokens=tokens)
    emb = torch.nn.functional.embedding(tokens, table)
    assert torch.equal(xo, emb)
    torch.testing.assert_close(y, fused.add_rmsnorm_torch(emb, None, w, 1e-6)[1],
                               **_gpu_tol(dtype))  # fmt: skip
    for shape in ((1, 1, 2 * 1728), (4, 60, 2 * 1728), (5, 2 * 77)):
        gu = rnd(*shape, scale=3.0)
        out, ref = fused.swiglu(gu), fused.swiglu_torch(gu)
        torch.testing.assert_close(out, ref, **_gpu_tol(dtype))
        if dtype != torch.float32:
            assert (out == ref).float().mean() > 0.95
    feats = rnd(4, 12, 640)[:, 2:10]
    tok = torch.randint(0, 512, (4, 8), device=dev)
    assert torch.equal(fused.embed_cat(tok, feats, table, dtype),
                       fused.embed_cat_torch(tok, feats, table, dtype))  # fmt: skip
    seq = torch.tensor([0, 17, 300, 5], dtype=torch.int32, device=dev)
    depth = torch.randint(0, 7, (4, 51), dtype=torch.int32, device=dev)
    qs = torch.tensor([1, 11, 41, 45], dtype=torch.int32, device=dev)
    for got, want in zip(fused.tree_index(seq, depth, qs, 10),
                         fused.tree_index_torch(seq, depth, qs, 10)):  # fmt: skip
        assert torch.equal(got, want)
    assert torch.equal(fused.tree_index(seq, depth)[0], fused.tree_index_torch(seq, depth)[0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strided", [False, True])
def test_frontier_inputs_compiled(dtype, strided):
    """The compiled frontier-inputs kernel against the PyTorch ops on CUDA (H = 640: the trained
    H200 pair's; Wd = 2)."""
    _check_frontier_inputs(4, 8, 4, 6, 640, dtype, "cuda", strided)


GPU_CFG = ModelConfig(vocab_size=512, hidden_size=640, intermediate_size=1728,
                      num_hidden_layers=2, num_attention_heads=10, num_key_value_heads=2,
                      head_dim=64, tie_word_embeddings=True)  # fmt: skip


def _gpu_inputs(B=3, N=9, ctx=40):
    dev = "cuda"
    g = torch.Generator().manual_seed(4)
    tok = torch.randint(0, GPU_CFG.vocab_size, (B, N), generator=g)
    par = torch.stack([torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g))
                                            for i in range(1, N)]) for _ in range(B)])  # fmt: skip
    num = torch.tensor([N, N - 3, 1][:B], dtype=torch.int32)
    tree = Tree.from_parents(par.to(torch.int32), num, tok).to(dev)
    seq = torch.tensor([ctx, ctx // 2, 3][:B], dtype=torch.int32, device=dev)
    return tree, seq


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_fused_forward_on_gpu_equals_unfused(dtype):
    """The fused CUDA forwards (Triton kernels, concatenated GEMMs) against the unfused ones on
    the same GPU: target tree forward, draft frontier forward, cache writes. fp32: equal up to
    rounding. bf16: both are compared with the fp32 unfused forward of the same weights and
    inputs, and the fused one's error may not exceed the unfused one's by much (two bf16
    forwards differ by about as much as either differs from fp32)."""
    import copy

    torch.backends.cuda.matmul.allow_tf32 = False
    t32 = Target(GPU_CFG, seed=0).cuda()
    d32 = Draft(GPU_CFG, seed=1).cuda()
    target, draft = copy.deepcopy(t32).to(dtype), copy.deepcopy(d32).to(dtype)
    tree, seq = _gpu_inputs()
    B, N = tree.tokens.shape
    rows = torch.arange(N, device="cuda")[None, :] < tree.num_nodes[:, None]

    def caches(model, m32, seed):
        kv, kv32 = _cache(model, B, seed, dtype), _cache(m32, B, seed, torch.float32)
        kv32.k.copy_(kv.k.float())  # the same (representable) values
        kv32.v.copy_(kv.v.float())
        return kv, kv32

    def compare(fused_out, unfused_out, ref32):
        f, u = fused_out.float(), unfused_out.float()
        if dtype == torch.float32:
            tol = 1e-4 * u.std().item()
            torch.testing.assert_close(f, u, atol=tol, rtol=1e-4)
            return
        ef, eu = (f - ref32).abs(), (u - ref32).abs()
        assert ef.mean() <= 1.5 * eu.mean() + 1e-6, (ef.mean(), eu.mean())
        assert ef.max() <= 2.0 * eu.max() + 1e-6, (ef.max(), eu.max())

    (kv_f, kv32), (kv_u, _) = caches(target, t32, 1), caches(target, t32, 1)
    lf, hf = target(tree.tokens, kv_f, seq, tree)
    lu, hu = target.forward_unfused(tree.tokens, kv_u, seq, tree)
    l32, h32 = t32.forward_unfused(tree.tokens, kv32, seq, tree)
    compare(lf[rows], lu[rows], l32[rows])
    compare(hf[rows], hu[rows], h32[rows])
    compare(kv_f.k, kv_u.k, kv32.k)
    compare(kv_f.v, kv_u.v, kv32.v)

    qs = torch.tensor([1, 2, 0], dtype=torch.int32, device="cuda")
    ql = torch.tensor([4, 3, 1], dtype=torch.int32, device="cuda")
    feats32 = torch.randn(B, 4, GPU_CFG.hidden_size, device="cuda")
    feats = feats32.to(dtype)
    feats32 = feats.float()
    valid = torch.arange(4, device="cuda")[None, :] < ql[:, None]
    tok = tree.tokens[:, :4]
    (kv_f, kv32), (kv_u, _) = caches(draft, d32, 2), caches(draft, d32, 2)
    lf, hf = draft(target, tok, feats, kv_f, seq, tree, qs, ql)
    lu, hu = draft.forward_unfused(target, tok, feats, kv_u, seq, tree, qs, ql)
    l32, h32 = d32.forward_unfused(t32, tok, feats32, kv32, seq, tree, qs, ql)
    compare(lf[valid], lu[valid], l32[valid])
    compare(hf[valid], hu[valid], h32[valid])
    compare(kv_f.k, kv_u.k, kv32.k)


@pytest.mark.gpu
def test_fused_forward_in_a_cuda_graph():
    """The fused forwards capture (after an eager warm-up), replay to the eager outputs, and a
    weight changed in place reaches the graph after the next eager forward refreshes the
    concatenated weights (the decoder's prefill is one)."""
    dtype = torch.bfloat16
    target = Target(GPU_CFG, seed=0).to("cuda", dtype)
    draft = Draft(GPU_CFG, seed=1).to("cuda", dtype)
    tree, seq = _gpu_inputs()
    B = tree.batch_size
    kv, dkv = _cache(target, B, 1, dtype), _cache(draft, B, 2, dtype)
    qs = torch.tensor([1, 2, 0], dtype=torch.int32, device="cuda")
    ql = torch.tensor([4, 3, 1], dtype=torch.int32, device="cuda")
    feats = torch.randn(B, 4, GPU_CFG.hidden_size, device="cuda").to(dtype)

    def body():
        lt, _ = target(tree.tokens, kv, seq, tree)
        ld, _ = draft(target, tree.tokens[:, :4], feats, dkv, seq, tree, qs, ql)
        return lt, ld

    with torch.no_grad():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                body()
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = body()
        valid = [
            torch.arange(tree.capacity, device="cuda")[None, :] < tree.num_nodes[:, None],
            torch.arange(4, device="cuda")[None, :] < ql[:, None],
        ]

        def check(want, other=None):
            graph.replay()
            torch.cuda.synchronize()
            for a, b, m in zip(out, want, valid):
                # the same kernels; a GEMM captured on another stream may pick another algorithm
                tol = 2e-2 * b[m].std().item()
                torch.testing.assert_close(a[m], b[m], atol=tol, rtol=2e-2)
            if other is not None:  # the new weights changed the outputs well beyond that
                assert any((a[m] - o[m]).abs().max() > 0.2 * o[m].std() for a, o, m in
                           zip(out, other, valid))  # fmt: skip

        old = [t.clone() for t in body()]
        check(old)
        target.model.layers[1].mlp.up_proj.weight.mul_(1.5)
        draft.layer.self_attn.k_proj.weight.mul_(0.5)
        new = [t.clone() for t in body()]  # eager: refreshes the concatenated weights
        check(new, other=old)


@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["autoregressive", "EagleStatic", "Cast"])
def test_fused_decoder_on_gpu_equals_cpu(policy):
    """Greedy decoding on the fused CUDA forwards with CUDA graphs (tiny fp32 pair) gives the
    CPU decoder's tokens."""
    torch.backends.cuda.matmul.allow_tf32 = False
    target, draft = _friendly_pair()
    prompts = [[5, 17, 3, 99, 42, 7, 8], [11, 64], [23, 1, 2, 3]]
    pol = make_policy(policy, depth=3, topk=3, budget=12, C1=0.3)  # Cast: per-forward graphs
    d = None if policy == "autoregressive" else draft
    ref = Decoder(target, d, pol).generate(prompts, 10)
    gpu = Decoder(target.cuda(), None if d is None else d.cuda(), pol, cuda_graphs=True)
    got = gpu.generate(prompts, 10)
    assert got.tokens == ref.tokens and got.graphs_captured > 0

"""A Llama-style target and an EAGLE-style draft whose attention runs on treeops.

Both models keep a paged KV cache (``PagedKV``: stacked ``[L, num_pages, page_size, H_kv, D]``
K and V, one block table ``[B, max_pages]`` int32) and run every forward as a *tree* forward:
the inputs are the nodes of a ``treeops.Tree`` (a verification tree, a draft frontier, or a
chain for prefill), their K/V go into slots ``seq_lens[b] + i`` through ``treeops.kv_append``
(K rotated at ``seq_lens[b] + depth[i]``), which rotates the queries in place at the same
positions (``q=``, the same launch), and attention is ``treeops.tree_attention`` (prefix +
ancestors).

On CUDA the forwards run fused, as an inference engine would (``fused.py``: hand-written Triton
for add + RMSNorm, SwiGLU, the draft's fc input and the per-forward index math; one GEMM over
concatenated q/k/v weights and one over gate/up, built once and cached, ``Attention.wqkv`` /
``MLP.wgu``), every residual add folded into the next norm: per layer one add + RMSNorm, the
q/k/v GEMM, ``kv_append`` (K/V into the cache, K and q rotated), ``tree_attention``, o_proj, one
add + RMSNorm, the gate/up GEMM, SwiGLU, down_proj; per forward the frontier's index math (a
draft frontier only). On the CPU the same forwards run the same math as PyTorch ops (separate
projections), equal to ``forward_unfused`` (the per-layer modules). The training forwards
(``forward_train``, causal SDPA) and ``reference_forward`` use the separate weights.

Weights use Hugging Face Llama names (``model.layers.{i}.self_attn.q_proj.weight`` ...), so a
local directory with ``config.json`` + ``*.safetensors`` loads with ``Target.from_pretrained``
when the optional ``safetensors`` package is installed.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from torch import nn

from .._runtime import refuse_in_capture
from ..kv_append import kv_append
from ..tree import Tree
from ..tree_attention import tree_attention
from . import fused

__all__ = [
    "ModelConfig",
    "PagedKV",
    "Target",
    "Draft",
    "chain_tree",
    "reference_forward",
    "rope_tables",
]


@dataclass
class ModelConfig:
    """Llama hyper-parameters (HF ``config.json`` names). ``head_dim`` must be 64, 128 or 256
    (treeops' attention kernels)."""

    vocab_size: int = 128
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    eos_token_id: int | None = None

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        if "head_dim" not in d and "hidden_size" in d and "num_attention_heads" in d:
            kw["head_dim"] = d["hidden_size"] // d["num_attention_heads"]
        if isinstance(kw.get("eos_token_id"), list):
            kw["eos_token_id"] = kw["eos_token_id"][0]
        return cls(**kw)

    def to_dict(self) -> dict:
        return asdict(self)


class PagedKV:
    """One model's paged KV cache: ``k``, ``v`` [L, num_pages, page_size, H_kv, D] and a block
    table [B, max_pages] int32 giving each request ``max_pages`` pages (shuffled, to exercise
    the indirection)."""

    def __init__(
        self,
        layers: int,
        batch: int,
        max_len: int,
        h_kv: int,
        d: int,
        *,
        page_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        seed: int = 0,
    ):
        pages = -(-max_len // page_size)
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(batch * pages, generator=g).to(torch.int32)
        self.block_table = perm.view(batch, pages).to(device)
        shape = (layers, batch * pages, page_size, h_kv, d)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = pages * page_size

    def rows(self, idx: torch.Tensor) -> PagedKV:
        """The cache of requests ``idx`` [R] (int64, on its device): their block-table rows over
        the same page pools (a prefill through it writes those requests' pages)."""
        view = PagedKV.__new__(PagedKV)
        view.block_table = self.block_table.index_select(0, idx)
        view.k, view.v, view.capacity = self.k, self.v, self.capacity
        return view


def chain_tree(tokens: torch.Tensor, lengths: torch.Tensor) -> Tree:
    """A chain (prompt-as-tree): node i's parent is i-1; ``lengths[b]`` valid nodes."""
    B, N = tokens.shape
    parents = (torch.arange(N, dtype=torch.int32, device=tokens.device) - 1).expand(B, N)
    return Tree.from_parents(parents.contiguous(), lengths.to(torch.int32), tokens)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        H, Hq, Hkv, D = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.cfg = cfg
        self.q_proj = nn.Linear(H, Hq * D, bias=False)
        self.k_proj = nn.Linear(H, Hkv * D, bias=False)
        self.v_proj = nn.Linear(H, Hkv * D, bias=False)
        self.o_proj = nn.Linear(Hq * D, H, bias=False)

    def forward(self, x, kv: PagedKV, layer: int, seq_lens, tree: Tree, q_start=None, q_len=None):
        """x [B, R, H]: every node of ``tree`` (R = N), or with ``q_start``/``q_len`` the R rows
        of nodes ``q_start[b] + j`` (a draft frontier; rows j >= q_len[b] are ignored)."""
        cfg = self.cfg
        B, R, _ = x.shape
        Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q = self.q_proj(x).view(B, R, Hq, D)
        k = self.k_proj(x).view(B, R, Hkv, D)
        v = self.v_proj(x).view(B, R, Hkv, D)
        kc, vc, bt = kv.k[layer], kv.v[layer], kv.block_table
        theta = cfg.rope_theta
        if q_start is None:
            # q rotated in place at K's positions, tree.positions(seq_lens); rows past
            # num_nodes stay unrotated, and tree_attention's output there is 0 whatever q holds
            kv_append(k, v, kc, vc, bt, seq_lens, tree.num_nodes, tree.depth, q=q,
                      rope_theta=theta)  # fmt: skip
            o = tree_attention(q, kc, vc, bt, seq_lens, tree)
            return self.o_proj(o.reshape(B, R, -1))
        # Frontier rows only. kv_append has no row offset, so shift its base instead: row j lands
        # in slot (seq_lens + q_start) + j and K is rotated at (seq_lens + q_start) +
        # (depth - q_start) = seq_lens + depth; the relative depth may be negative, which the
        # op's arithmetic allows (a workaround, see the package docstring). Row j < q_len of q
        # is rotated at that same position, seq_lens + depth[q_start + j]; rows j >= q_len stay
        # unrotated and land on nodes tree_attention does not query.
        N = tree.capacity
        q_start = q_start.to(torch.int32)
        q_len = q_len.to(torch.int32)
        idx = q_start.long()[:, None] + torch.arange(R, device=x.device)[None, :]  # [B, R]
        idx = idx.clamp(max=N - 1)
        dep = tree.depth.gather(1, idx)
        base = seq_lens.to(torch.int32) + q_start
        rel = (dep - q_start[:, None]).to(torch.int32)
        kv_append(k, v, kc, vc, bt, base, q_len, rel, q=q, rope_theta=theta)
        qf = torch.zeros(B, N, Hq, D, dtype=q.dtype, device=q.device)
        qf.scatter_(1, idx[:, :, None, None].expand(B, R, Hq, D), q)
        o = tree_attention(qf, kc, vc, bt, seq_lens, tree, q_start, q_len)
        o = o.gather(1, idx[:, :, None, None].expand(B, R, Hq, D))
        return self.o_proj(o.reshape(B, R, -1))

    def wqkv(self) -> torch.Tensor:
        """The inference weight ``cat([q_proj, k_proj, v_proj])`` [(H_q + 2 H_kv) D, H]."""
        return _concat(self, "_wqkv", (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight))

    def forward_fused(
        self, h: torch.Tensor, f: _Fwd, kv: PagedKV, layer: int, kv_only: bool = False
    ) -> torch.Tensor | None:
        """``forward`` of the normed input ``h`` [B, R, H] with the forward's shared index math
        ``f``: on the fused path one GEMM for q/k/v (strided views of its output feed the
        treeops ops; ``kv_append`` rotates the q view in place), otherwise the three
        projections as ``forward``. Returns o_proj's output (the residual's delta); with
        ``kv_only`` only K and V are computed and appended (no q, no attention) and it returns
        None."""
        cfg = self.cfg
        B, R, _ = h.shape
        Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        kc, vc, bt = kv.k[layer], kv.v[layer], kv.block_table
        theta, tree = cfg.rope_theta, f.tree
        if kv_only:
            if f.kernels:  # the k/v rows of the concatenated weight: one GEMM
                kv_ = nn.functional.linear(h, self.wqkv()[Hq * D :])
                k = kv_[..., : Hkv * D].unflatten(-1, (Hkv, D))
                v = kv_[..., Hkv * D :].unflatten(-1, (Hkv, D))
            else:
                k = self.k_proj(h).view(B, R, Hkv, D)
                v = self.v_proj(h).view(B, R, Hkv, D)
            if f.q_start is None:
                kv_append(k, v, kc, vc, bt, f.seq_lens, tree.num_nodes, tree.depth,
                          rope_theta=theta)  # fmt: skip
            else:
                kv_append(k, v, kc, vc, bt, f.base, f.q_len, f.rel, rope_theta=theta)
            return None
        if f.kernels:
            qkv = nn.functional.linear(h, self.wqkv())
            q = qkv[..., : Hq * D].unflatten(-1, (Hq, D))
            k = qkv[..., Hq * D : (Hq + Hkv) * D].unflatten(-1, (Hkv, D))
            v = qkv[..., (Hq + Hkv) * D :].unflatten(-1, (Hkv, D))
        else:
            q = self.q_proj(h).view(B, R, Hq, D)
            k = self.k_proj(h).view(B, R, Hkv, D)
            v = self.v_proj(h).view(B, R, Hkv, D)
        # q rotated in place by kv_append at K's positions (see ``forward``)
        if f.q_start is None:
            kv_append(k, v, kc, vc, bt, f.seq_lens, tree.num_nodes, tree.depth, q=q,
                      rope_theta=theta)  # fmt: skip
            o = tree_attention(q, kc, vc, bt, f.seq_lens, tree)
        else:  # frontier rows only (see ``forward``); rows outside them are never read
            kv_append(k, v, kc, vc, bt, f.base, f.q_len, f.rel, q=q, rope_theta=theta)
            new = torch.empty if f.kernels else torch.zeros
            qf = new(B, tree.capacity, Hq, D, dtype=q.dtype, device=q.device)
            qf.scatter_(1, f.idx4, q)
            o = tree_attention(qf, kc, vc, bt, f.seq_lens, tree, f.q_start, f.q_len)
            o = o.gather(1, f.idx4)
        return self.o_proj(o.reshape(B, R, -1))

    def forward_causal(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Training path: x [B, T, H] is a whole sequence at positions 0..T-1, causal SDPA, no
        cache. ``cos``/``sin`` [T, D] from ``rope_tables``."""
        cfg = self.cfg
        B, T, _ = x.shape
        Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q = _rotate(self.q_proj(x).view(B, T, Hq, D), cos, sin).transpose(1, 2)
        k = _rotate(self.k_proj(x).view(B, T, Hkv, D), cos, sin).transpose(1, 2)
        v = self.v_proj(x).view(B, T, Hkv, D).transpose(1, 2)
        if Hq != Hkv:
            k = k.repeat_interleave(Hq // Hkv, dim=1)
            v = v.repeat_interleave(Hq // Hkv, dim=1)
        o = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, Hq * D))


def rope_tables(
    T: int, d: int, theta: float, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, D] fp32 for positions 0..T-1, the angles ``treeops.rope`` uses (HF Llama's
    ``inv_freq``, rotate-half layout)."""
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64, device=device).float() / d))
    ang = torch.arange(T, device=device).float()[:, None] * inv[None, :]
    return torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on x [B, T, H, D] with cos/sin [T, D]: fp32 math, x's dtype (as ``treeops.rope``)."""
    d = x.shape[-1]
    xf = x.float()
    rot = torch.cat([-xf[..., d // 2 :], xf[..., : d // 2]], -1)
    return (xf * cos[:, None, :] + rot * sin[:, None, :]).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    def wgu(self) -> torch.Tensor:
        """The inference weight ``cat([gate_proj, up_proj])`` [2I, H]."""
        return _concat(self, "_wgu", (self.gate_proj.weight, self.up_proj.weight))

    def forward_fused(self, h: torch.Tensor, f: _Fwd) -> torch.Tensor:
        """``forward``; on the fused path one gate/up GEMM, the SwiGLU kernel, the down GEMM."""
        if not f.kernels:
            return self.forward(h)
        return self.down_proj(fused.swiglu(nn.functional.linear(h, self.wgu())))


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, kv, layer, seq_lens, tree, q_start=None, q_len=None):
        x = x + self.self_attn(self.input_layernorm(x), kv, layer, seq_lens, tree, q_start, q_len)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_causal(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn.forward_causal(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, x, h, f: _Fwd, kv: PagedKV, layer: int, kv_only: bool = False):
        """The layer with its residual adds folded into the norms: ``x`` [B, R, H] is the
        residual stream, ``h`` its ``input_layernorm``; returns ``(x', delta)`` with the layer's
        output ``x' + delta`` left to the caller's next ``f.norm`` (the next layer's input norm,
        or the final one). ``kv_only``: only the layer's K and V appended to ``kv`` (what a
        forward whose outputs nobody reads must do); returns None."""
        if kv_only:
            return self.self_attn.forward_fused(h, f, kv, layer, kv_only=True)
        delta = self.self_attn.forward_fused(h, f, kv, layer)
        x, h = f.norm(x, delta, self.post_attention_layernorm)
        return x, self.mlp.forward_fused(h, f)

    def fuse(self) -> None:
        """Build (or refresh) the concatenated inference weights."""
        self.self_attn.wqkv()
        self.mlp.wgu()


class _Fwd:
    """What every layer of one tree forward shares, computed once per forward: the tree and
    ``seq_lens``, and for a draft frontier (``q_start`` / ``q_len``, R rows) the rows' node index
    as ``idx4`` [B, R, H_q, D] (for the scatter/gather around attention) and kv_append's shifted
    ``base`` and relative depths ``rel`` (its K, and so q, rotated at ``seq_lens + depth``). A
    whole tree needs no index math: kv_append takes ``seq_lens`` and ``tree.depth`` as they are.
    ``kernels``: the fused path (``fused.use_kernels``: CUDA) or the same math in PyTorch ops."""

    q_start: torch.Tensor | None
    # set for a frontier only
    q_len: torch.Tensor
    base: torch.Tensor
    rel: torch.Tensor
    idx4: torch.Tensor

    def __init__(self, cfg: ModelConfig, seq_lens, tree: Tree, R: int, q_start=None, q_len=None,
                 *, kernels: bool):  # fmt: skip
        self.kernels = kernels
        self.seq_lens, self.tree = seq_lens, tree
        self.q_start = None
        if q_start is None or q_len is None:
            return
        index = fused.tree_index if kernels else fused.tree_index_torch
        self.q_start = q_start.to(torch.int32)
        self.q_len = q_len.to(torch.int32)
        _, idx, base, rel = index(seq_lens, tree.depth, self.q_start, R)  # pos: kv_append rotates q
        assert idx is not None and base is not None and rel is not None
        self.base, self.rel = base, rel
        B = idx.shape[0]
        self.idx4 = idx[:, :, None, None].expand(B, R, cfg.num_attention_heads, cfg.head_dim)

    def norm(self, x, delta, norm: RMSNorm, tokens=None):
        """``(x + delta, norm(x + delta))`` (x itself without delta; with ``tokens``, x is the
        embedding table and the rows are ``x[tokens]``): one kernel on the fused path."""
        if self.kernels:
            return fused.add_rmsnorm(x, delta, norm.weight, norm.eps, tokens)
        if tokens is not None:
            x = nn.functional.embedding(tokens, x)
        if delta is not None:
            x = x + delta
        return x, norm(x)


def _concat(owner: nn.Module, name: str, parts: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """``cat(parts, 0)``, cached on ``owner`` for inference and rebuilt when a part changes (its
    storage, dtype, device or version counter: an in-place update). Training uses the separate
    parameters and never sees it. A rebuild of the same shape is written into the cached tensor,
    so that CUDA graphs captured with it read the new weights after the next eager forward (the
    decoder's prefill is one). Built on a forward's first call, outside any capture (the
    decoder's warm-up runs), or by ``fuse()``."""
    key = tuple((p.data_ptr(), p._version, p.dtype, p.device, tuple(p.shape)) for p in parts)
    ent = owner.__dict__.get(name)
    if ent is not None and ent[0] == key:
        return ent[1]
    refuse_in_capture("the example decoder's concatenated q/k/v and gate/up weights")
    with torch.no_grad():
        w = torch.cat([p.detach() for p in parts], 0)
        old = None if ent is None else ent[1]
        if (
            old is not None
            and (old.shape, old.dtype, old.device) == (w.shape, w.dtype, w.device)
            and not old.is_inference()
        ):
            old.copy_(w)
            w = old
    owner.__dict__[name] = (key, w)
    return w


class _Inner(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def _init(module: nn.Module, seed: int, std: float) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in module.named_parameters():
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            continue
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=g) * std)


class Target(nn.Module):
    """Llama: embed -> L x (RMSNorm, GQA attention with RoPE, RMSNorm, SwiGLU) -> RMSNorm -> head.

    ``forward(tokens, kv, seq_lens, tree)`` runs the tree's nodes ([B, N] tokens) against the
    cache and returns ``(logits [B, N, V] float32, hidden [B, N, H])``; ``hidden`` is the final
    normed state (the LM head's input), the feature the draft consumes."""

    def __init__(self, cfg: ModelConfig, seed: int = 0, std: float = 0.08):
        super().__init__()
        self.cfg = cfg
        self.model = _Inner(cfg)
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        _init(self, seed, std)

    def head(
        self, h: torch.Tensor, out: torch.Tensor | None = None, native: bool = False
    ) -> torch.Tensor:
        """Logits [.., V] float32 of hidden states ``h`` [.., H]; with ``out`` (float32, h's
        leading shape, any strides) written there by the GEMM's one converting copy instead of
        a cast to new memory (one kernel and one float32 write fewer), and ``out`` returned;
        ``native``: the GEMM's output as it is, in the weights' dtype."""
        w = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if native:
            return h @ w.t()
        if out is None:
            return (h @ w.t()).float()
        return out.copy_(h @ w.t())

    def forward(self, tokens, kv: PagedKV, seq_lens, tree: Tree, logits: str = "float32"):
        """The tree forward (class docstring). On CUDA the fused path: per layer one add +
        RMSNorm kernel, the q/k/v GEMM, kv_append (K, V and q), tree_attention, o_proj, add +
        RMSNorm, the gate/up GEMM, SwiGLU, down_proj (the embedding gathers inside the first
        norm). On the CPU the same math in PyTorch ops, as
        ``forward_unfused``. ``logits``: ``"float32"`` (the head's output cast), ``"native"``
        (the head's output in the weights' dtype: what a consumer that upcasts after each load,
        as treeops' acceptance does, reads at half the bytes, with no cast kernel; the values
        are the same) or ``"none"`` (no LM head: a prefill whose logits nobody reads; the
        first result is then None)."""
        if logits not in ("float32", "native", "none"):
            raise ValueError(
                f"Invalid value of logits: expected 'float32', 'native' or 'none', got {logits!r}"
            )
        f = _Fwd(self.cfg, seq_lens, tree, tokens.shape[1], kernels=fused.use_kernels(tokens))
        layers = self.model.layers
        norms = [layer.input_layernorm for layer in layers] + [self.model.norm]
        x, h = f.norm(self.model.embed_tokens.weight, None, norms[0], tokens=tokens)
        for i, layer in enumerate(layers):
            x, delta = layer.forward_fused(x, h, f, kv, i)
            x, h = f.norm(x, delta, norms[i + 1])
        if logits == "none":
            return None, h
        return self.head(h, native=logits == "native"), h

    def forward_unfused(self, tokens, kv: PagedKV, seq_lens, tree: Tree):
        """``forward`` through the per-layer modules (``Layer.forward``: separate GEMMs, norms
        and activations as PyTorch ops, index math per layer): the reference the fused forward
        is tested against."""
        x = self.model.embed_tokens(tokens)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, kv, i, seq_lens, tree)
        h = self.model.norm(x)
        return self.head(h), h

    def fuse(self) -> Target:
        """Build the concatenated inference weights now (``forward`` builds them on its first
        CUDA call and rebuilds them after the weights change; that call must not be inside a
        CUDA-graph capture: the decoder's warm-up runs come first)."""
        for layer in self.model.layers:
            layer.fuse()
        return self

    def forward_train(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Training forward: whole sequences ``tokens`` [B, T] at positions 0..T-1 with a causal
        mask (PyTorch SDPA, no cache, no treeops), the same weights as ``forward``. Returns
        ``(logits [B, T, V] float32, hidden [B, T, H])``, ``hidden`` being the feature the draft
        consumes (as in ``forward``)."""
        h = self.features_train(tokens)
        return self.head(h), h

    def features_train(self, tokens: torch.Tensor) -> torch.Tensor:
        """``forward_train``'s hidden [B, T, H] only (the training loss applies the head itself,
        in the autocast dtype)."""
        cos, sin = rope_tables(
            tokens.shape[1], self.cfg.head_dim, self.cfg.rope_theta, tokens.device
        )
        x = self.model.embed_tokens(tokens)
        for layer in self.model.layers:
            x = layer.forward_causal(x, cos, sin)
        return self.model.norm(x)

    def make_cache(self, batch, max_len, **kw) -> PagedKV:
        c = self.cfg
        return PagedKV(
            c.num_hidden_layers,
            batch,
            max_len,
            c.num_key_value_heads,
            c.head_dim,
            dtype=self.model.embed_tokens.weight.dtype,
            device=self.model.embed_tokens.weight.device,
            **kw,
        )

    @classmethod
    def from_state_dict(
        cls, cfg: ModelConfig, state: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
    ) -> Target:
        """A target from HF Llama-named tensors (``model.embed_tokens.weight``,
        ``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight``, ``...mlp.{gate,up,down}_proj``,
        ``...input_layernorm``/``post_attention_layernorm``, ``model.norm``, ``lm_head``)."""
        model = cls(cfg)
        state = {k: v for k, v in state.items() if "rotary_emb" not in k}
        if cfg.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        model.load_state_dict(state, strict=True)
        return model.to(dtype)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> Target:
        """Load a local HF Llama directory: ``config.json`` and ``*.safetensors`` (needs the
        optional ``safetensors`` package) or, failing those, ``*.bin`` (``torch.load``)."""
        path = Path(path)
        cfg = ModelConfig.from_dict(json.loads((path / "config.json").read_text()))
        state: dict[str, torch.Tensor] = {}
        files = sorted(path.glob("*.safetensors"))
        if files:
            try:
                from safetensors.torch import load_file
            except ImportError as e:  # optional dependency
                raise ImportError(f"{path} holds safetensors: install 'safetensors'") from e
            for f in files:
                state.update(load_file(str(f)))
        else:
            for f in sorted(path.glob("*.bin")):
                state.update(torch.load(f, map_location="cpu", weights_only=True))
        if not state:
            raise FileNotFoundError(f"no *.safetensors or *.bin weights in {path}")
        return cls.from_state_dict(cfg, state, dtype)

    def save_pretrained(self, path: str | Path, safetensors: bool = True) -> None:
        """Write ``config.json`` and ``model.safetensors`` (needs the ``safetensors`` package)
        or, with ``safetensors=False``, ``pytorch_model.bin``."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(self.cfg.to_dict(), indent=1))
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        if safetensors:
            from safetensors.torch import save_file

            save_file(state, str(path / "model.safetensors"))
        else:
            torch.save(state, path / "pytorch_model.bin")


class Draft(nn.Module):
    """EAGLE-2 draft: one Llama decoder layer over ``fc(concat(embed(token), feature))``, sharing
    the target's embedding and LM head (not owned: passed at call time). Its own RMSNorm sits
    before the shared head; its output hidden is the feature of its children."""

    def __init__(self, cfg: ModelConfig, seed: int = 1, std: float = 0.08):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layer = Layer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        _init(self, seed, std)

    def forward(
        self, target: Target, tokens, feats, kv: PagedKV, seq_lens, tree, q_start=None, q_len=None,
        logits_out: torch.Tensor | None = None, outputs: bool = True,
    ):  # fmt: skip
        """tokens [B, N], feats [B, N, H] (the parent position's feature of each node) ->
        (logits [B, N, V] float32, hidden [B, N, H]). With ``q_start``/``q_len`` the R rows of
        ``tokens``/``feats`` are the nodes ``q_start[b] + j`` (a frontier; written to the cache
        and attended; rows ``j >= q_len[b]`` are ignored). ``logits_out`` ([B, N, V] float32):
        the logits are written there (``Target.head``'s ``out``) and it is returned.
        ``outputs=False``: only the cache is written (a catch-up or a prefill, whose logits and
        hidden states nobody reads): the layer's K and V, no attention, MLP, final norm or LM
        head; returns None. On CUDA the fused path (as ``Target.forward``; the fc input gathered
        and concatenated by one kernel, the frontier's index math one kernel per forward); on
        the CPU PyTorch ops, as ``forward_unfused``."""
        kern = fused.use_kernels(tokens)
        f = _Fwd(self.cfg, seq_lens, tree, tokens.shape[1], q_start, q_len, kernels=kern)
        cat = fused.embed_cat if kern else fused.embed_cat_torch
        x = self.fc(cat(tokens, feats, target.model.embed_tokens.weight, self.fc.weight.dtype))
        x, h = f.norm(x, None, self.layer.input_layernorm)
        if not outputs:
            return self.layer.forward_fused(x, h, f, kv, 0, kv_only=True)
        x, delta = self.layer.forward_fused(x, h, f, kv, 0)
        x, h = f.norm(x, delta, self.norm)
        return target.head(h, out=logits_out), x

    def forward_unfused(
        self, target: Target, tokens, feats, kv: PagedKV, seq_lens, tree, q_start=None, q_len=None
    ):
        """``forward`` through the per-layer modules (the unfused reference, as
        ``Target.forward_unfused``)."""
        x = self.fc(
            torch.cat([target.model.embed_tokens(tokens), feats.to(self.fc.weight.dtype)], -1)
        )
        h = self.layer(x, kv, 0, seq_lens, tree, q_start, q_len)
        return target.head(self.norm(h)), h

    def fuse(self) -> Draft:
        """Build the concatenated inference weights now (see ``Target.fuse``)."""
        self.layer.fuse()
        return self

    def forward_train(
        self, target: Target, tokens: torch.Tensor, feats: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Training forward over whole sequences: ``tokens`` [B, T], ``feats`` [B, T, H] (the
        parent position's feature of each token, zeros at position 0, as the decoder's
        prefill feeds it) -> ``(logits [B, T, V] float32, hidden [B, T, H])``; causal SDPA at
        positions 0..T-1, no cache, the same weights as ``forward``."""
        cos, sin = rope_tables(
            tokens.shape[1], self.cfg.head_dim, self.cfg.rope_theta, tokens.device
        )
        x = self.fc(
            torch.cat([target.model.embed_tokens(tokens), feats.to(self.fc.weight.dtype)], -1)
        )
        h = self.layer.forward_causal(x, cos, sin)
        return target.head(self.norm(h)), h

    @torch.no_grad()
    def bigram_init(self, target: Target) -> Draft:
        """Make this draft the target's bigram approximation without training: ``fc`` passes the
        token embedding through, the decoder layer adds nothing (o_proj, down_proj = 0) and the
        norm is the target's final norm, so the draft proposes ``head(norm(embed(token)))``. With a
        target whose layers perturb the residual stream only a little this accepts well; tests
        use it to exercise deep acceptance and compaction without a trained pair."""
        H = self.cfg.hidden_size
        self.fc.weight.zero_()
        self.fc.weight[:, :H] = torch.eye(H, dtype=self.fc.weight.dtype)
        self.layer.self_attn.o_proj.weight.zero_()
        self.layer.mlp.down_proj.weight.zero_()
        self.norm.weight.copy_(target.model.norm.weight)
        return self

    def make_cache(self, batch, max_len, **kw) -> PagedKV:
        c = self.cfg
        return PagedKV(
            1,
            batch,
            max_len,
            c.num_key_value_heads,
            c.head_dim,
            dtype=self.fc.weight.dtype,
            device=self.fc.weight.device,
            **kw,
        )


def reference_forward(target: Target, tokens: torch.Tensor) -> torch.Tensor:
    """Plain full-recompute forward of one sequence ([T] tokens) with a causal mask and RoPE
    written out here (no cache, no treeops): logits [T, V]. The baseline tests compare with."""
    cfg = target.cfg
    T = tokens.shape[0]
    D = cfg.head_dim
    pos = torch.arange(T, dtype=torch.float64)
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    ang = pos[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None, :]

    def rot(x):
        x1, x2 = x[..., : D // 2], x[..., D // 2 :]
        xd = x.double()
        return (xd * cos + torch.cat([-x2, x1], -1).double() * sin).to(x.dtype)

    mask = torch.ones(T, T, dtype=torch.bool).tril()
    x = target.model.embed_tokens(tokens)
    G = cfg.num_attention_heads // cfg.num_key_value_heads
    for layer in target.model.layers:
        a = layer.self_attn
        y = layer.input_layernorm(x)
        q = rot(a.q_proj(y).view(T, cfg.num_attention_heads, D))
        k = rot(a.k_proj(y).view(T, cfg.num_key_value_heads, D)).repeat_interleave(G, 1)
        v = a.v_proj(y).view(T, cfg.num_key_value_heads, D).repeat_interleave(G, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
        s = s.masked_fill(~mask, float("-inf"))
        o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(T, -1)
        x = x + a.o_proj(o)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return target.head(target.model.norm(x))

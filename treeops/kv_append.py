"""KV append with RoPE (docs/design.md op 2).

``kv_append`` writes the tree's K/V into the paged cache at slots ``seq_lens[b] + i``, rotating K
by RoPE at position ``seq_lens[b] + depth[b, i]`` on the way in; given the queries (``q=``) it
rotates them in place at the same positions in the same launch, which saves an attention layer
its separate query RoPE launch. CUDA tensors run the Triton kernel
(``treeops.kernels.kv_append``); CPU tensors run the PyTorch reference
(``treeops.reference.kv_append``). No host sync, so it can be captured in a CUDA graph.
``rope`` rotates any tensor (queries at positions that differ from the appended K's, say) the same
way, out of place.
"""

from __future__ import annotations

import torch

from ._checks import (
    FLOAT_DTYPES,
    Memo,
    check_head_dim,
    check_paged_batch,
    check_range,
    check_same_device,
    check_tensor,
    cuda_device,
    signature,
)
from ._library import define
from .kernels import kv_append as _k
from .kernels._replay import MISS, Replays
from .reference import kv_append as _ref_kv

__all__ = ["kv_append", "rope"]


def _kv_append_cuda(
    k, v, k_cache, v_cache, block_table, seq_lens, num_tokens, depth, rope_theta, q=None
):
    with cuda_device(k):
        _k.kv_append_fwd(
            k, v, k_cache, v_cache, block_table, seq_lens, num_tokens, depth, rope_theta, q
        )


def _kv_append_cpu(
    k, v, k_cache, v_cache, block_table, seq_lens, num_tokens, depth, rope_theta, q=None
):
    _ref_kv.kv_append(
        k, v, k_cache, v_cache, block_table, seq_lens, num_tokens, depth, q=q,
        rope_theta=rope_theta,
    )  # fmt: skip


_PASSED = Memo()
"""Signatures (``treeops._checks.signature``) of ``kv_append`` and ``rope`` calls whose checks
passed (with ``validate=False``): a repeated call skips them."""
_APPEND_REPLAYS = Replays("kv_append")
_ROPE_REPLAYS = Replays("rope")
"""Calls per signature replayed without the ops' Python layers (``treeops.kernels._replay``)."""


def _check_kv_append(
    k, v, k_cache, v_cache, block_table, seq_lens, num_tokens, depth, q, rope_theta, validate
) -> None:
    sizes: dict[str, int] = {}
    check_tensor("k", k, shape=("B", "N", "H_kv", "D"), dtype=FLOAT_DTYPES, sizes=sizes)
    check_head_dim("k", sizes["D"])
    check_tensor("v", v, shape=("B", "N", "H_kv", "D"), dtype=k.dtype, sizes=sizes)
    check_tensor(
        "k_cache", k_cache, shape=("P", "page_size", "H_kv", "D"), dtype=k.dtype, sizes=sizes
    )
    check_tensor(
        "v_cache", v_cache, shape=("P", "page_size", "H_kv", "D"), dtype=k.dtype, sizes=sizes
    )
    check_paged_batch(block_table, seq_lens, sizes)
    check_tensor(
        "num_tokens", num_tokens, shape=("B",), dtype=torch.int32, sizes=sizes, unit_last=True
    )
    if depth is not None:
        check_tensor("depth", depth, shape=("B", "N"), dtype=torch.int32, sizes=sizes)
    if q is not None:
        check_tensor("q", q, shape=("B", "N", None, "D"), dtype=k.dtype, sizes=sizes)
        if q.shape[2] % sizes["H_kv"]:
            raise ValueError(
                f"Invalid shape of q: expected a multiple of H_kv = {sizes['H_kv']} query heads "
                f"(dim 2), got {q.shape[2]}"
            )
        if any(st == 0 and n > 1 for st, n in zip(q.stride(), q.shape, strict=True)):
            # rotated in place: elements sharing memory would be written more than once
            raise ValueError(
                f"Invalid stride of q: expected no stride-0 (expanded) dimension, q is written "
                f"in place, got strides {tuple(q.stride())}"
            )
    if not (isinstance(rope_theta, (int, float)) and rope_theta > 0):
        raise ValueError(
            f"Invalid value of rope_theta: expected a positive float, got {rope_theta!r}"
        )
    check_same_device(
        k=k,
        v=v,
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=block_table,
        seq_lens=seq_lens,
        num_tokens=num_tokens,
        depth=depth,
        q=q,
    )
    if validate:
        capacity = block_table.shape[1] * sizes["page_size"]
        check_range("seq_lens", seq_lens, 0, None)
        check_range("num_tokens", num_tokens, 0, sizes["N"] + 1)
        check_range("block_table", block_table, 0, sizes["P"])
        if int((seq_lens.long() + num_tokens.long()).max()) > capacity:
            raise ValueError(
                f"Invalid value in seq_lens: seq_lens + num_tokens exceeds the "
                f"block table's capacity of {capacity} slots"
            )


_kv_append_op = define(
    "kv_append(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor block_table, "
    "Tensor seq_lens, Tensor num_tokens, Tensor? depth, float rope_theta, Tensor(c!)? q=None) "
    "-> ()",
    cpu=_kv_append_cpu,
    cuda=_kv_append_cuda,
)


def _rope_cuda(x, positions, theta):
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.dim() == 4:  # the kernel's own layout: x [B, N, H, D], positions [B, N]
        with cuda_device(x):
            _k.rope_fwd(x, positions, theta, y)
        return y
    # other ranks as views of that shape
    while x.dim() < 4:
        x, positions = x.unsqueeze(0), positions.unsqueeze(0)
    x4, p2 = x.flatten(0, -4), positions.flatten(0, -2)
    with cuda_device(x):
        _k.rope_fwd(x4, p2, theta, y.view(x4.shape))
    return y


def _rope_cpu(x, positions, theta):
    return _ref_kv.rope(x, positions, theta)


def _rope_fake(x, positions, theta):
    return x.new_empty(x.shape)


_rope_op = define(
    "rope(Tensor x, Tensor positions, float theta) -> Tensor",
    cpu=_rope_cpu,
    cuda=_rope_cuda,
    fake=_rope_fake,
)


def kv_append(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    num_tokens: torch.Tensor,
    depth: torch.Tensor | None = None,
    *,
    q: torch.Tensor | None = None,
    rope_theta: float = 10000.0,
    validate: bool = False,
) -> None:
    """Write new K/V into the paged caches, rotating K by RoPE on the way (in place); optionally
    rotate the queries ``q`` in place at the same positions.

    Args:
        k, v: [B, N, H_kv, D] (the forward's K/V projections of the tree nodes, or of a prefill
            chunk), fp16/bf16/fp32, any strides; D in {64, 128, 256}.
        k_cache, v_cache: [num_pages, page_size, H_kv, D], k's dtype, any strides.
        block_table: [B, max_pages] int32 (unit stride along max_pages).
        seq_lens: [B] int32 or int64.
        num_tokens: [B] int32, tokens of request b to write (``tree.num_nodes`` when verifying).
            The [B] inputs need unit stride (no stride-0 ``expand``).
        depth: [B, N] int32 (``tree.depth``), or None for consecutive positions (prefill).
        q: optional [B, N, H_q, D] queries, k's dtype and device, H_q a multiple of H_kv, any
            strides (a view of a fused QKV projection's output is fine) but no stride-0
            (expanded) dimension, and not overlapping k, v or the caches. Mutated: row i <
            ``num_tokens[b]`` is rotated at K's position for token i (what ``rope(q,
            tree.positions(seq_lens))`` computes for those rows); rows i >= ``num_tokens[b]``
            are left unchanged.
        rope_theta: RoPE base (Llama's ``rope_theta``); layout is Llama's ``rotate_half``.
        validate: also check value ranges (syncs with the host).

    Token i < ``num_tokens[b]`` lands in slot ``seq_lens[b] + i``; K is rotated at position
    ``seq_lens[b] + depth[b, i]`` (``seq_lens[b] + i`` without ``depth``), and so is q's row i.
    One launch for the batch, K, V and q, on CUDA; no host sync.

    Shapes, dtypes, devices and strides are always checked; values are the caller's
    responsibility when ``validate=False``: out-of-range indices (``block_table`` entries outside
    the cache, ``seq_lens + num_tokens`` beyond the block table, ``num_tokens > N``, negative
    ``seq_lens``) are undefined behaviour (a write outside the cache); ``validate=True`` checks
    them (with a host sync).

    Example:
        >>> import torch, treeops
        >>> k_cache = torch.zeros(4, 16, 2, 64); v_cache = torch.zeros(4, 16, 2, 64)
        >>> bt = torch.tensor([[2, 3]], dtype=torch.int32)
        >>> k = torch.randn(1, 3, 2, 64); v = torch.randn(1, 3, 2, 64)
        >>> treeops.kv_append(k, v, k_cache, v_cache, bt, torch.tensor([15], dtype=torch.int32),
        ...                   torch.tensor([3], dtype=torch.int32), validate=True)
        >>> bool((v_cache[3, 0] == v[0, 1]).all())
        True
        >>> q = torch.randn(1, 3, 4, 64); q0 = q.clone()  # 4 query heads share the 2 KV heads
        >>> treeops.kv_append(k, v, k_cache, v_cache, bt, torch.tensor([15], dtype=torch.int32),
        ...                   torch.tensor([2], dtype=torch.int32), q=q)
        >>> pos = torch.tensor([[15, 16]])  # rows 0 and 1 at slots 15 and 16; row 2 not written
        >>> torch.equal(q[:, :2], treeops.rope(q0[:, :2], pos)), torch.equal(q[:, 2], q0[:, 2])
        (True, True)
    """
    key = tensors = None
    if not validate:
        tensors = (k, v, k_cache, v_cache, block_table, seq_lens, num_tokens, depth, q)
        key = signature(tensors, (rope_theta,))
        if _APPEND_REPLAYS.run(key, tensors) is not MISS:
            return None
    if _PASSED.get(key) is None:
        _check_kv_append(
            k, v, k_cache, v_cache, block_table, seq_lens, num_tokens, depth, q, rope_theta,
            validate,
        )  # fmt: skip
        _PASSED.put(key, True)
    args = (k, v, k_cache, v_cache, block_table, seq_lens, num_tokens, depth, float(rope_theta), q)
    _APPEND_REPLAYS.call(key, tensors, _kv_append_op, *args)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotate ``x`` [..., H, D] by RoPE at integer ``positions`` [...] (Llama ``rotate_half``
    layout, fp32 math, x's dtype out); e.g. ``rope(q, tree.positions(seq_lens))`` for queries
    (``kv_append(..., q=q)`` does that in place in its own launch where the positions are K's).

    Example:
        >>> import torch, treeops
        >>> x = torch.randn(2, 4, 8, 64)
        >>> y = treeops.rope(x, torch.zeros(2, 4, dtype=torch.int64))
        >>> bool(torch.allclose(x, y))
        True
    """
    tensors = (x, positions)
    key = signature(tensors, ("rope",))  # theta is not checked
    # theta is launched: a replay is kept per (signature, theta)
    plain = key is not None and theta.__class__ in (int, float)
    key_theta = (key, theta.__class__, theta) if plain else None
    y = _ROPE_REPLAYS.run(key_theta, tensors)
    if y is not MISS:
        return y
    if _PASSED.get(key) is None:
        _check_rope(x, positions)
        _PASSED.put(key, True)
    return _ROPE_REPLAYS.call(key_theta, tensors, _rope_op, x, positions, float(theta))


def _check_rope(x, positions) -> None:
    check_tensor("x", x, dtype=FLOAT_DTYPES)
    check_tensor(
        "positions", positions, shape=tuple(x.shape[:-2]), dtype=(torch.int32, torch.int64)
    )
    if x.shape[-1] % 2:
        raise ValueError(f"Invalid head dim of x: expected an even number, got {x.shape[-1]}")
    check_same_device(x=x, positions=positions)
    if x.is_cuda and x.dim() > 4:
        try:
            x.view(-1, *x.shape[-3:])
            positions.view(-1, positions.shape[-1])
        except RuntimeError:
            raise ValueError(
                "Invalid strides of x: on CUDA the leading dims of x and positions before the "
                "last two of positions must flatten without a copy"
            ) from None

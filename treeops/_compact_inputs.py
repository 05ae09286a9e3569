"""What KV compaction's public op and its reference share: the cache argument's two forms and the
input checks (the reference validates as the public op does, so both refuse the same inputs)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._checks import (
    SEQ_LEN_DTYPES,
    Memo,
    check_range,
    check_same_device,
    check_tensor,
    signature,
)
from .tree import Tree, check_tree

Caches = torch.Tensor | Sequence[torch.Tensor]


def layers(caches: Caches) -> list[torch.Tensor]:
    if isinstance(caches, torch.Tensor):
        return list(caches.unbind(0))
    return list(caches)


def _check_caches(name: str, caches: object) -> tuple[tuple[int, ...], torch.dtype]:
    if isinstance(caches, torch.Tensor):
        check_tensor(name, caches, shape=(None, None, None, None, None))
        if not caches.is_floating_point():
            raise ValueError(
                f"Invalid dtype of {name}: expected a floating dtype, got {caches.dtype}"
            )
        if caches.shape[0] < 1:
            raise ValueError(f"Invalid shape of {name}: expected at least one layer, got 0")
        return tuple(caches.shape[1:]), caches.dtype
    if not isinstance(caches, (list, tuple)) or not caches:
        raise ValueError(
            f"Invalid type of {name}: expected a [L, num_pages, page_size, H_kv, D] "
            f"tensor or a non-empty list of [num_pages, page_size, H_kv, D] tensors, "
            f"got {type(caches).__name__}"
        )
    first = caches[0]
    check_tensor(f"{name}[0]", first, shape=(None, None, None, None))
    if not first.is_floating_point():
        raise ValueError(
            f"Invalid dtype of {name}[0]: expected a floating dtype, got {first.dtype}"
        )
    for j, c in enumerate(caches):
        check_tensor(
            f"{name}[{j}]", c, shape=tuple(first.shape), dtype=first.dtype, device=first.device
        )
        if c.stride() != first.stride():
            raise ValueError(
                f"Invalid strides of {name}[{j}]: expected {first.stride()} (as "
                f"{name}[0]), got {c.stride()}"
            )
    return tuple(first.shape), first.dtype


_PASSED = Memo()
"""Signatures of inputs that passed ``check_compact_inputs`` with ``validate=False``."""


def _flat(caches: object) -> tuple[tuple, tuple]:
    """(tensors, values) of a cache argument for ``signature``: the list's or tuple's items with
    its type and length, or the argument itself as one item."""
    if caches.__class__ in (list, tuple):
        return tuple(caches), (caches.__class__, len(caches))  # type: ignore[arg-type]
    return (caches,), (None, 1)


def check_compact_inputs(
    k_caches, v_caches, block_table, seq_lens, tree, accepted, accept_len, out, validate
) -> tuple | None:
    """Shapes, dtypes, strides, devices and types of compaction's inputs (and their values under
    ``validate``); metadata that passed once is remembered (``_PASSED``). Returns the call's
    signature (None under ``validate``)."""
    key = None
    if not validate:
        (kt, kv), (vt, vv) = _flat(k_caches), _flat(v_caches)
        key = signature(
            (block_table, seq_lens, accepted, accept_len, out, *kt, *vt,
             *(tree.tensors() if isinstance(tree, Tree) else (tree,))),
            (*kv, *vv),
        )  # fmt: skip
        if _PASSED.get(key) is not None:
            return key
    _check_compact_inputs(
        k_caches, v_caches, block_table, seq_lens, tree, accepted, accept_len, out, validate
    )
    _PASSED.put(key, True)
    return key


def _check_compact_inputs(
    k_caches, v_caches, block_table, seq_lens, tree, accepted, accept_len, out, validate
) -> None:
    tree = check_tree(tree, validate=validate)
    k_shape, k_dtype = _check_caches("k_caches", k_caches)
    v_shape, v_dtype = _check_caches("v_caches", v_caches)
    if v_shape != k_shape:
        raise ValueError(
            f"Invalid shape of v_caches: expected per-layer {list(k_shape)} (as "
            f"k_caches), got {list(v_shape)}"
        )
    if v_dtype != k_dtype:
        raise ValueError(
            f"Invalid dtype of v_caches: expected {k_dtype} (as k_caches), got {v_dtype}"
        )
    nk = len(k_caches) if not isinstance(k_caches, torch.Tensor) else k_caches.shape[0]
    nv = len(v_caches) if not isinstance(v_caches, torch.Tensor) else v_caches.shape[0]
    if nk != nv:
        raise ValueError(f"Invalid number of layers in v_caches: expected {nk}, got {nv}")
    sizes = {"B": tree.batch_size, "N": tree.capacity}
    # the kernel gets block_table's and accepted's row strides; the rest is read unit-stride
    i32 = torch.int32
    check_tensor(
        "block_table", block_table, shape=("B", None), dtype=i32, sizes=sizes, unit_last=True
    )
    check_tensor(
        "seq_lens", seq_lens, shape=("B",), dtype=SEQ_LEN_DTYPES, sizes=sizes, unit_last=True
    )
    check_tensor("accepted", accepted, shape=("B", "N"), dtype=i32, sizes=sizes, unit_last=True)
    check_tensor("accept_len", accept_len, shape=("B",), dtype=i32, sizes=sizes, unit_last=True)
    if out is not None:
        check_tensor("out", out, shape=("B",), dtype=i32, sizes=sizes, unit_last=True)
    first_k = k_caches if isinstance(k_caches, torch.Tensor) else k_caches[0]
    first_v = v_caches if isinstance(v_caches, torch.Tensor) else v_caches[0]
    check_same_device(
        k_caches=first_k,
        v_caches=first_v,
        block_table=block_table,
        seq_lens=seq_lens,
        tree=tree.parents,
        accepted=accepted,
        accept_len=accept_len,
        out=out,
    )
    if validate:
        N = sizes["N"]
        check_range("accept_len", accept_len, 0, N + 1)
        check_range("accept_len", accept_len[tree.num_nodes > 0], 1, None)
        check_range("seq_lens", seq_lens, 0, None)
        ps = k_shape[1]
        cover = seq_lens.to(torch.int64) + N
        if bool((cover > block_table.shape[1] * ps).any()):
            raise ValueError(
                f"Invalid value in seq_lens: the block table covers "
                f"{block_table.shape[1] * ps} slots, but seq_lens + N needs "
                f"{int(cover.max())}"
            )
        check_range("block_table", block_table, 0, k_shape[0])
        d = torch.arange(N, device=accepted.device)
        live = d[None, :] < accept_len[:, None].to(torch.int64)
        acc = accepted.to(torch.int64)
        if bool((live & ((acc < 0) | (acc >= N))).any()):
            raise ValueError(
                "Invalid value in accepted: expected node indices in [0, N) within accept_len"
            )
        idx = acc.clamp(0, N - 1)
        if bool((live & (tree.depth.gather(1, idx).to(torch.int64) != d[None, :])).any()):
            raise ValueError("Invalid value in accepted: accepted[b, d] must be a node at depth d")

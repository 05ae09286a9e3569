"""Reference tree-masked paged attention: the specification of ``treeops.tree_attention``.

For request b, query node i (``q_start[b] <= i < q_start[b] + q_len[b]`` and ``i < num_nodes[b]``)
and query head h, the keys are the cache slots ``0 .. seq_lens[b] + num_nodes[b] - 1`` of the
request (logical slot p lives in page ``block_table[b, p // page_size]`` at row
``p % page_size``):

* slots ``p < seq_lens[b]`` (the prefix) are all visible;
* slot ``seq_lens[b] + j`` (tree node j) is visible iff ``j < num_nodes[b]`` and bit ``j % 32`` of
  ``tree.anc[b, i, j // 32]`` is set (j is an ancestor of i, or i itself).

Query head h reads KV head ``h // (H_q // H_kv)``. ``out[b, i, h] = softmax(scale · q·Kᵀ) V`` over
the visible keys and ``lse[b, i, h] = log Σ exp(scale · q·k)`` (natural log). Every other query row
(outside the range, a padding node, an inactive request, or a row that sees no key) is 0 with
LSE = -inf. Computed in fp32, one query row at a time.
"""

from __future__ import annotations

import math

import torch

from treeops.tree import Tree


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    tree: Tree,
    q_start: torch.Tensor | None = None,
    q_len: torch.Tensor | None = None,
    *,
    sm_scale: float | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    workspace: torch.Tensor | None = None,
    validate: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``treeops.tree_attention``; ``workspace`` and ``validate`` are ignored."""
    B, N, H_q, D = q.shape
    page_size, H_kv = k_cache.shape[1], k_cache.shape[2]
    group = H_q // H_kv
    scale = 1.0 / math.sqrt(D) if sm_scale is None else float(sm_scale)
    o = torch.zeros(B, N, H_q, D, dtype=torch.float32, device=q.device)
    l = torch.full((B, N, H_q), float("-inf"), dtype=torch.float32, device=q.device)
    visible_tree = tree.ancestor_mask()  # [B, N, N]
    kv_head = torch.arange(H_q, device=q.device) // group
    for b in range(B):
        s = int(seq_lens[b])
        n = int(tree.num_nodes[b])
        qs = 0 if q_start is None else int(q_start[b])
        ql = N if q_len is None else int(q_len[b])
        rows = range(max(qs, 0), min(qs + ql, n, N))
        if len(rows) == 0:
            continue
        slot = torch.arange(s + n, device=q.device)
        page = block_table[b, slot // page_size].long()
        k = k_cache[page, slot % page_size].float()[:, kv_head]  # [s + n, H_q, D]
        v = v_cache[page, slot % page_size].float()[:, kv_head]
        for i in rows:
            vis = torch.cat(
                [torch.ones(s, dtype=torch.bool, device=q.device), visible_tree[b, i, :n]]
            )
            if not bool(vis.any()):
                continue
            scores = torch.einsum("hd,lhd->hl", q[b, i].float(), k) * scale  # [H_q, s + n]
            scores = scores.masked_fill(~vis[None, :], float("-inf"))
            l[b, i] = torch.logsumexp(scores, dim=1)
            o[b, i] = torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=1), v)
    if out is None:
        out = o.to(q.dtype)
    else:
        out.copy_(o)
    if not return_lse:
        return out
    if lse is None:
        lse = l
    else:
        lse.copy_(l)
    return out, lse

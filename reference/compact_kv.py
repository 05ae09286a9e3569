"""Reference KV compaction (docs/design.md op 8), written the obvious way: one slot copy at a
time."""

from __future__ import annotations

import torch

from treeops._compact_inputs import check_compact_inputs, layers

__all__ = ["compact_kv"]


def compact_kv(
    k_caches,
    v_caches,
    block_table,
    seq_lens,
    tree,
    accepted,
    accept_len,
    *,
    out=None,
    validate=False,
) -> torch.Tensor:
    """Move the accepted path's K/V from slot ``s + accepted[b, d]`` to slot ``s + d`` (d = the
    node's depth) for every layer and KV head, in increasing depth, in place; return the new
    ``seq_lens = s + accept_len`` (int32). Slots outside ``[s, s + accept_len)`` are untouched."""
    check_compact_inputs(
        k_caches, v_caches, block_table, seq_lens, tree, accepted, accept_len, out, validate
    )
    B = block_table.shape[0]
    ps = layers(k_caches)[0].shape[1]
    bt = block_table.cpu()
    s_all = seq_lens.cpu().tolist()
    acc = accepted.cpu().tolist()
    lens = accept_len.cpu().tolist()
    for caches in (layers(k_caches), layers(v_caches)):
        for cache in caches:
            for b in range(B):
                s = int(s_all[b])
                for d in range(1, int(lens[b])):
                    i = int(acc[b][d])
                    if i == d:
                        continue
                    src, dst = s + i, s + d
                    sp, so = int(bt[b, src // ps]), src % ps
                    dp, do = int(bt[b, dst // ps]), dst % ps
                    cache[dp, do] = cache[sp, so]
    new = (seq_lens.to(torch.int64) + accept_len.to(torch.int64)).to(torch.int32)
    if out is not None:
        out.copy_(new)
        return out
    return new

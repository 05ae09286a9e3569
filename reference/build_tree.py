"""Tree build (docs/design.md op 3) with EAGLE or CAST decisions, written the obvious way.

One decoding step drafts layer after layer. Layer ``i`` (``state.layer``) reads the draft logits
of the current frontier ``[B, W, V]`` (row ``r`` of request ``b`` is a node already in the tree,
or the root at layer 0, where the logits may be ``[B, 1, V]``: the root's row alone) and:

1. softmax (temperature 1) per valid frontier row, computed in float64;
2. top-k per row: the ``K`` largest *logits*, ties to the lower token id; probability ``p`` of
   each rounded to float32;
3. candidate ``(i, r, j)`` (global index ``i*W*K + r*K + j``) gets path score
   ``frontier_scores[b, r] * p`` (one float32 multiply, so a child never outscores its parent),
   token, and parent ``frontier[b, r]`` (the parent's global index, -1 for the root);
4. the next frontier: each request's ``W`` best candidates of the layer in rank order (score
   descending, ties to the lower candidate index); only the first ``n_i`` rows stay valid, where
   ``n_i = W`` for EAGLE and Algorithm 1 with ``C1`` for CAST, its ``k`` capped at the most
   valid candidates of any active request (so ``n_i`` = the most valid frontier rows of any
   active request whenever Algorithm 1 would go past them; 1 with none active);
5. the decisions: ``widths[i] = n_i``, ``flags[i]`` = draft layer i+1 (EAGLE: ``i + 1 < depth``;
   CAST: the depth rule with ``C2``, and ``i + 1 < max_depth``).

After the last layer, rerank and emit: every candidate of the step sorted by (score descending,
candidate index ascending) — which is topological, since a child's score never exceeds its
parent's and its index is larger — the first ``n - 1`` behind the root become the tree, ``n`` being
the EAGLE budget or Algorithm 1 with ``C3``, its ``k`` capped at 1 + the most candidates of any
active request (so ``n <= max_b num_nodes[b]``, or 1 with none active); each request's tree then
holds ``min(n, 1 + its candidates)`` nodes.

The state (``treeops.DraftState``) and the policies (``treeops.EagleStatic``, ``treeops.Cast``)
live in ``treeops.build_tree``; these functions read and write the state's tensors in place.
"""

from __future__ import annotations

from typing import Any

import torch

from treeops._draft_state import DraftState
from treeops.tree import Tree

from .cast import cast_available, cast_depth, cast_select, cast_utility_sums

__all__ = ["build_tree_expand", "build_tree_emit", "build_tree"]


def build_tree_expand(logits: torch.Tensor, state: Any, policy: Any) -> None:
    """Expand draft layer ``state.layer`` from the frontier's logits ``[B, W, V]``, or at layer 0
    ``[B, 1, V]`` (the root's row alone: rows 1.. are not expanded); advance it."""
    i = state.layer
    B, W = state.frontier.shape
    V = logits.shape[2]
    K = policy.topk
    C = W * K
    dev = logits.device
    fs = state.frontier_scores.float()  # [B, W]
    row_ok = (fs >= 0) & state.active[:, None]  # [B, W]
    if logits.shape[1] < W:  # the root's row alone: the other rows' logits are never read
        row_ok[:, logits.shape[1] :] = False
        logits = torch.cat([logits, logits.new_zeros(B, W - logits.shape[1], V)], dim=1)

    x = logits.double()
    p = torch.softmax(x, dim=-1)  # [B, W, V] float64
    top = torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :K]  # [B, W, K]
    prob = p.gather(-1, top).float()
    score = fs[:, :, None] * prob  # float32 multiply
    ok = row_ok[:, :, None].expand(B, W, K)
    state.cand_scores[:, i] = torch.where(ok, score, -1.0).reshape(B, C)
    state.cand_tokens[:, i] = torch.where(ok, top, 0).reshape(B, C)
    par = state.frontier[:, :, None].expand(B, W, K)
    state.cand_parents[:, i] = torch.where(ok, par, -1).reshape(B, C).to(torch.int32)

    sc = state.cand_scores[:, i]  # [B, C]
    order = torch.sort(sc, dim=1, descending=True, stable=True).indices[:, :W]  # [B, W]
    nf_scores = sc.gather(1, order)
    nf_ok = nf_scores >= 0
    nf = torch.where(nf_ok, i * C + order, -1).to(torch.int32)
    nf_tokens = torch.where(nf_ok, state.cand_tokens[:, i].gather(1, order), 0)

    if policy.is_cast:
        table_t, table_d = _rows(policy, B)
        ctx = _max_ctx(state) + int(state.widths[:i].sum())
        k = policy.cost_table.bucket(ctx)
        costs = table_d[k, :W] / table_t[k, 0]
        total, n_act = cast_utility_sums(sc, W, state.active)
        # k capped at the most valid candidates of an active request (= its valid next-frontier
        # rows, as k <= W): the width never exceeds the rows the next draft forward can have
        cap = cast_available(sc, state.active)
        n = int(cast_select(total, costs, policy.C1 * n_act, cap))
        state.u_hist[i] = total[n - 1] / n_act
        deeper = bool(cast_depth(state.u_hist[: i + 1], costs[n - 1], policy.C2, policy.R))
        flag = deeper and i + 1 < policy.max_depth
    else:
        n = W
        flag = i + 1 < policy.max_depth
    keep = torch.arange(W, device=dev)[None, :] < n
    state.frontier_scores.copy_(torch.where(keep & nf_ok, nf_scores, -1.0))
    state.frontier.copy_(torch.where(keep & nf_ok, nf, -1))
    state.frontier_tokens.copy_(torch.where(keep & nf_ok, nf_tokens, 0))
    state.widths[i] = n
    state.flags[i] = int(flag)
    state.layer = i + 1


def build_tree_emit(state: Any, policy: Any, *, out: Tree | None = None) -> Tree:
    """Rerank every candidate of the step and emit the ``Tree`` (capacity ``policy.capacity``)."""
    B = state.active.shape[0]
    N = policy.capacity
    D = state.layer
    scores = state.cand_scores[:, :D].reshape(B, -1).float()  # [B, D*C], < 0 = none
    tokens = state.cand_tokens[:, :D].reshape(B, -1)
    parents = state.cand_parents[:, :D].reshape(B, -1)
    if policy.is_cast:
        table_t, _ = _rows(policy, B)
        k = policy.cost_table.bucket(_max_ctx(state))
        costs = table_t[k, :N] / table_t[k, 0]
        total, n_act = cast_utility_sums(scores, N, state.active, root=True)
        # k capped at 1 + the most candidates of an active request: the verify count is at most
        # max_b num_nodes[b] (each request's tree holds min(n, 1 + its candidates) nodes)
        cap = cast_available(scores, state.active, root=True)
        n = int(cast_select(total, costs, policy.C3 * n_act, cap))
    else:
        n = N
    state.verify[0] = n

    par = torch.full((B, N), -1, dtype=torch.int32)
    tok = torch.zeros(B, N, dtype=torch.int64)
    sc = torch.zeros(B, N, dtype=torch.float32)
    num = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        if not bool(state.active[b]):
            continue
        s = scores[b].cpu()
        order = torch.sort(s, descending=True, stable=True).indices
        chosen = [int(c) for c in order[: n - 1] if float(s[c]) >= 0]
        pos = {c: j + 1 for j, c in enumerate(chosen)}
        tok[b, 0] = int(state.root_tokens[b])
        sc[b, 0] = 1.0
        for j, c in enumerate(chosen):
            pc = int(parents[b, c])
            par[b, j + 1] = 0 if pc < 0 else pos[pc]  # KeyError = not ancestor-closed
            tok[b, j + 1] = int(tokens[b, c])
            sc[b, j + 1] = float(s[c])
        num[b] = 1 + len(chosen)
    dev = state.active.device
    tree = Tree.from_parents(par.to(dev), num.to(dev), tok.to(dev), sc.to(dev))
    if out is not None:
        for dst, src in zip(out.tensors(), tree.tensors(), strict=True):
            dst.copy_(src)
        return out
    return tree


def build_tree(
    policy: Any,
    draft_fn: Any,
    root_tokens: torch.Tensor,
    seq_lens: torch.Tensor,
    active: torch.Tensor | None = None,
    *,
    state: Any = None,
    out: Tree | None = None,
) -> Tree:
    """One decoding step: ``draft_fn(state) -> logits [B, W, V]`` per draft layer while the policy
    drafts (``state.flags``, at most ``max_depth`` layers), then rerank and emit."""
    if state is None:
        state = DraftState.new(policy, root_tokens, seq_lens, active)
    else:
        state.reset(root_tokens, seq_lens, active)
    while state.layer == 0 or (
        bool(state.flags[state.layer - 1]) and state.layer < policy.max_depth
    ):
        build_tree_expand(draft_fn(state), state, policy)
    return build_tree_emit(state, policy, out=out)


def _rows(policy: Any, B: int) -> tuple[torch.Tensor, torch.Tensor]:
    # the float32 rows the kernels read, so that both price candidates from the same numbers
    t, d = policy.cost_table.device_tables(B, "cpu")
    return t.double(), d.double()


def _max_ctx(state: Any) -> int:
    act = state.active.bool()
    if not bool(act.any()):
        return 0
    return int(state.seq_lens[act].max())

"""CAST (docs/design.md ops 4 and 5): Algorithm 1, written the obvious way.

Algorithm 1 (this project's robust form): given utilities ``u_1..u_K`` (non-decreasing) and costs
``c_1..c_K``, choose ``n`` = the *largest* ``k`` in ``[1, K]`` maximising ``u_k - C * c_k``.

* width (draft layer i): ``u_k`` = batch mean over active requests of the sum of their ``k`` best
  candidate scores at this layer; ``c_k = S_D(B)[select(ctx_i)][k] / S_T(B)[select(ctx_i)][1]``;
  threshold ``C1``.
* depth: the ratios ``phi_j = u^(j+1) / u^(j)`` of the widths' utilities, a FIFO of the last ``R``
  reset to ``{1}`` every decoding step, ``alpha`` its mean; draft layer i+1 iff
  ``alpha * u^(i) / c^(i) >= C2``.
* rerank: ``u_k`` = batch mean of the root (score 1) plus the ``k - 1`` best candidates of the
  whole step; ``c_k = S_T(B)[select(ctx)][k] / S_T(B)[select(ctx)][1]``; threshold ``C3``.

Width and rerank cap ``k`` at the candidates that exist (``cast_available``): the largest ``k``
searched is the most candidates (score >= 0) of any *active* request (+1 for the root in the
rerank; at least 1). Past that count every utility is flat, so on a plateau of costs the
"largest k" would otherwise name a width or a verify count no request can fill. The max over
active requests (not the min) because both decisions are batch-wide: each request uses
``min(n, what it has)``, so with non-decreasing costs (a ``CostTable``'s) and ``C >= 0`` the cap
is ``min(n, cap)`` and leaves every request's frontier and tree as they were; it only stops
over-sizing the batch. (The depth rule then prices the capped width: ``c^(i)_{n_i}`` of the
width actually drafted.)

Everything here computes in float64 on the host's view of the tensors; the Triton kernels compute
in float32. Algorithm 1 runs on the utility *sums* with the threshold scaled by the number of
active requests (``cast_utility_sums``), so that no division rounds before the comparison: both
agree exactly when the scores, costs and scaled thresholds are dyadic with few bits (the tests'
choice) and can differ only at near-ties otherwise.
"""

from __future__ import annotations

import torch

__all__ = [
    "cast_select",
    "cast_available",
    "cast_context_costs",
    "cast_utilities",
    "cast_utility_sums",
    "cast_width",
    "cast_depth",
    "cast_rerank",
]


def cast_select(
    u: torch.Tensor, c: torch.Tensor, C: float, limit: int | torch.Tensor | None = None
) -> torch.Tensor:
    """Algorithm 1: the largest ``k`` in ``[1, K]`` maximising ``u_k - C * c_k``.

    Args:
        u: [K] utilities (float), ``u[k - 1] = u_k``.
        c: [K] costs, ``c[k - 1] = c_k``.
        C: the threshold.
        limit: optional cap (int or 0-d integer tensor, no host sync): only ``k <= limit`` are
            candidates, i.e. the search runs over ``[1, min(K, max(limit, 1))]``. The CAST rules
            pass the number of candidates that exist (``cast_available``).

    Returns a 0-d int32 tensor on ``u``'s device.
    """
    obj = u.double() - float(C) * c.double()
    ks = torch.arange(1, obj.numel() + 1, device=u.device)
    if limit is not None:
        obj = torch.where(
            ks <= torch.as_tensor(limit, device=u.device).clamp(min=1), obj, -torch.inf
        )
    best = obj.max()
    return torch.where(obj == best, ks, 0).max().to(torch.int32)


def cast_available(
    scores: torch.Tensor, active: torch.Tensor | None = None, root: bool = False
) -> torch.Tensor:
    """The cap of Algorithm 1's ``k`` in the CAST rules: the most candidates that any active
    request has (entries of ``scores`` [B, M] that are >= 0; a negative entry is "no candidate"),
    plus 1 with ``root`` (the root is always a node), and at least 1 (Algorithm 1 returns
    ``k >= 1``; with no active request the cap is 1). 0-d int64 tensor, no host sync.

    Why the max over active requests: the width and the verify count are *batch* decisions (one
    frontier width, one verification bucket for the whole batch) and request ``b`` uses
    ``min(n, its own count)`` of them, so any ``n`` above the largest count only pads the batch:
    with this cap, ``width = max_b`` (valid frontier rows of b) whenever Algorithm 1 would go
    beyond it, and the verify count is at most ``max_b num_nodes[b]``."""
    ok = scores >= 0
    if active is not None:
        ok = ok & active.bool()[:, None]
    have = ok.sum(dim=1).max() if ok.shape[0] else ok.new_zeros((), dtype=torch.int64)
    return (have + int(root)).clamp(min=1)


def cast_utility_sums(
    scores: torch.Tensor, K: int, active: torch.Tensor | None = None, root: bool = False
) -> tuple[torch.Tensor, int]:
    """``(U, n_act)``: ``U[k - 1]`` = the sum over active requests of their ``k`` best scores
    (with ``root``, the root's score 1 counts as the first), [K] float64, and the number of
    active requests (at least 1). The batch mean is ``u_k = U_k / n_act``.

    Algorithm 1 is run on ``U`` with threshold ``C * n_act``: the same maximisers as ``u - C c``
    in exact arithmetic, and with dyadic inputs exact in floating point for any ``n_act``
    (dividing by 3 first would round and can break a tie, e.g. Theorem 4.1 with B = 3).

    ``scores`` is [B, M], negative entries mean "no candidate" (counted as 0).
    """
    s = scores.double().clamp(min=0)
    B, M = s.shape
    take = K - 1 if root else K
    best = torch.sort(s, dim=1, descending=True).values[:, :take]
    if best.shape[1] < take:
        best = torch.cat([best, best.new_zeros(B, take - best.shape[1])], dim=1)
    if root:
        best = torch.cat([best.new_ones(B, 1), best], dim=1)
    cum = torch.cumsum(best, dim=1)  # [B, K]
    act = torch.ones(B, dtype=torch.bool, device=s.device) if active is None else active.bool()
    total = torch.where(act[:, None], cum, 0.0).sum(dim=0)
    return total, max(int(act.sum()), 1)  # no active request: all utilities 0


def cast_context_costs(
    table: torch.Tensor,
    seq_lens: torch.Tensor,
    context_len: int,
    unit: torch.Tensor | None = None,
    active: torch.Tensor | None = None,
) -> torch.Tensor:
    """The cost vector of the batch's context from a per-context table (a ``CostTable``'s rows
    for one batch size): row ``r = min(ctx // context_len, M - 1)`` of ``table`` [M, K] divided
    by ``unit[r]`` (default ``table[r, 0]``), ``ctx`` = the longest ``seq_lens`` [B] of an
    active request (0 when none is active). [K] float64."""
    s = seq_lens.long()
    if active is not None:
        s = torch.where(active.bool(), s, 0)
    ctx = s.max().clamp(min=0) if s.numel() else s.new_zeros(())
    r = torch.clamp(ctx // int(context_len), max=table.shape[0] - 1)
    row = table.double().index_select(0, r.view(1))[0]
    u = row[0] if unit is None else unit.double().index_select(0, r.view(1))[0]
    return row / u


def _costs(costs, seq_lens, context_len, unit, active):
    if costs.dim() == 1:
        return costs
    return cast_context_costs(costs, seq_lens, context_len, unit, active)


def cast_utilities(
    scores: torch.Tensor, K: int, active: torch.Tensor | None = None, root: bool = False
) -> torch.Tensor:
    """``u_k``, k = 1..K: the mean over active requests of the sum of their ``k`` best scores
    (``cast_utility_sums`` divided by the active count). [K] float64."""
    total, n_act = cast_utility_sums(scores, K, active, root)
    return total / n_act


def cast_width(
    scores: torch.Tensor,
    costs: torch.Tensor,
    C1: float,
    active: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    context_len: int = 0,
    unit: torch.Tensor | None = None,
) -> torch.Tensor:
    """Width of the next frontier (docs/design.md op 5): Algorithm 1 with ``u_k`` = batch mean of
    the k best candidate scores of this layer (``scores`` [B, M], < 0 = none),
    ``c_k = costs[k - 1]`` (K = len(costs)) and threshold ``C1``. Returns a 0-d int32 tensor in
    [1, K].

    ``k`` only ranges over widths that can be filled: ``k <= cast_available(scores, active)``, the
    most candidates (score >= 0) of any active request (1 if none is active). Beyond that count
    the utility is flat, so on a plateau of costs Algorithm 1 alone would pick a width larger
    than any frontier the layer can have. With ``costs`` [M, K] (a table per context), the
    costs are ``cast_context_costs(costs, seq_lens, context_len, unit, active)``."""
    costs = _costs(costs, seq_lens, context_len, unit, active)
    K = costs.numel()
    total, n_act = cast_utility_sums(scores, K, active)
    return cast_select(total, costs, float(C1) * n_act, cast_available(scores, active))


def cast_depth(
    u_hist: torch.Tensor,
    c: torch.Tensor,
    C2: float,
    R: int,
    seq_lens: torch.Tensor | None = None,
    context_len: int = 0,
    unit: torch.Tensor | None = None,
    width: torch.Tensor | None = None,
) -> torch.Tensor:
    """Whether to draft the next layer (docs/design.md op 5).

    Args:
        u_hist: [i + 1] the utilities ``u^(0)_{n_0} .. u^(i)_{n_i}`` of the widths chosen so far
            in this decoding step (the FIFO's reset is the start of the step).
        c: 0-d, ``c^(i)_{n_i}``, the normalised draft cost of the current width.
        C2: the threshold.
        R: the FIFO length.

    The FIFO holds ``1`` then ``phi_j = u^(j+1) / u^(j)`` (0 where ``u^(j) = 0``) for j < i; only
    its last ``R`` entries count; ``alpha`` = their mean; returns ``alpha * u^(i) / c >= C2``
    (0-d bool). With ``c`` [M, K] (a table per context), ``c`` is entry ``width - 1`` of
    ``cast_context_costs(c, seq_lens, context_len, unit)`` (``width`` 0-d, in [1, K]).
    """
    if c.dim() == 2:
        c = cast_context_costs(c, seq_lens, context_len, unit).index_select(
            0, (width.long().view(1) - 1).clamp(0, c.shape[1] - 1)
        )[0]
    u = u_hist.double()
    seq = [torch.ones((), dtype=torch.float64, device=u.device)]
    for j in range(u.numel() - 1):
        seq.append(torch.where(u[j] > 0, u[j + 1] / torch.where(u[j] > 0, u[j], 1.0), 0.0))
    fifo = torch.stack(seq[-R:])
    alpha = fifo.mean()
    return (alpha * u[-1] / c.double()) >= C2


def cast_rerank(
    scores: torch.Tensor,
    costs: torch.Tensor,
    C3: float,
    active: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    context_len: int = 0,
    unit: torch.Tensor | None = None,
) -> torch.Tensor:
    """Number of nodes sent to verification (root included): Algorithm 1 with ``u_k`` = batch
    mean of the root's score 1 plus the ``k - 1`` best candidate scores of the step (``scores``
    [B, M], < 0 = none), ``c_k = costs[k - 1]`` (K = len(costs)), threshold ``C3``. 0-d int32.

    ``k`` only ranges up to ``cast_available(scores, active, root=True)``: 1 + the most
    candidates (score >= 0) of any active request (1 if none is active), so the count never
    exceeds the largest tree the candidates can make (``max_b num_nodes[b]``). With ``costs``
    [M, K], as ``cast_width``."""
    costs = _costs(costs, seq_lens, context_len, unit, active)
    K = costs.numel()
    total, n_act = cast_utility_sums(scores, K, active, root=True)
    return cast_select(total, costs, float(C3) * n_act, cast_available(scores, active, root=True))

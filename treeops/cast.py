"""CAST: the cost table and Algorithm 1 (docs/design.md ops 4 and 5).

``CostTable`` holds measured forward times ``f(B, c, n)`` of the target and the draft;
``cast_width``, ``cast_depth`` and ``cast_rerank`` are Algorithm 1 applied to draft width, draft
depth and the verification count. Inside a decoding step these decisions are fused into the tree
build kernels (``treeops.build_tree_expand`` / ``build_tree_emit`` with a ``treeops.Cast``
policy); the functions here are the same rules as standalone ops, for engines that build trees
their own way. Each is a custom op ``torch.ops.treeops.cast_*``: on CUDA one Triton launch
(``treeops.kernels.cast``: the batched top-k sums, the cap and Algorithm 1 in one program, no
host sync, so it can be captured in a CUDA graph; float32, agreeing with the reference except at
near-ties), on CPU the reference (``treeops.reference.cast``, float64).

λ-CAST (``treeops.cast_plan``) in this form, with calibrated acceptance probabilities as the
scores, ``λ`` the measured throughput and ``Δ_T`` the verification time per node (all in units
of ``S_T(B, 1)``): the width is ``cast_width`` with costs ``c_k + k Δ_T`` and ``C1 = λ``; the
verify count ``cast_rerank`` with ``C3 = λ``; one layer more ``cast_depth`` with the cost
``c_w + w Δ_T`` and ``C2 = λ`` (``tests/test_cast_plan.py`` checks each against
``lambda_rules``).
"""

from __future__ import annotations

import torch

from ._checks import Memo, check_finite, check_same_device, check_tensor, cuda_device, signature
from ._library import define
from ._runtime import pow2
from .cost_table import CostTable
from .kernels import cast as _k
from .kernels._replay import MISS, Replays
from .reference import cast as _ref

__all__ = ["CostTable", "cast_select", "cast_width", "cast_depth", "cast_rerank"]


# CPU backends: the reference (float64). CUDA backends: one Triton launch each (float32).
def _count_fake(x, *args):
    return x.new_empty((), dtype=torch.int32)


def _flag_fake(x, *args):
    return x.new_empty((), dtype=torch.bool)


def _select_cuda(u, c, C):
    out = torch.empty((), dtype=torch.int32, device=u.device)
    with cuda_device(u):
        _k.cast_select_launch(u, c, C, out)
    return out


def _utility_cuda(launch, ref, root: bool):
    def run(scores, costs, C, active, seq_lens=None, context_len=0, unit=None):
        if pow2(min(costs.shape[-1], scores.shape[1] + int(root))) > _k.MAX_TILE:
            # beyond the kernel's registers (a host sync)
            return ref(scores, costs, C, active, seq_lens, context_len, unit)
        out = torch.empty((), dtype=torch.int32, device=scores.device)
        with cuda_device(scores):
            launch(scores, costs, C, active, out, seq_lens, context_len, unit)
        return out

    return run


def _depth_cuda(u_hist, c, C2, R, seq_lens=None, context_len=0, unit=None, width=None):
    out = torch.empty((), dtype=torch.bool, device=u_hist.device)
    with cuda_device(u_hist):
        _k.cast_depth_launch(u_hist, c, C2, R, out, seq_lens, context_len, unit, width)
    return out


_select_op = define(
    "cast_select(Tensor u, Tensor c, float C) -> Tensor",
    cpu=_ref.cast_select,
    cuda=_select_cuda,
    fake=_count_fake,
)
_TABLE_ARGS = "Tensor? seq_lens, int context_len, Tensor? unit"
_width_op = define(
    f"cast_width(Tensor scores, Tensor costs, float C1, Tensor? active, {_TABLE_ARGS}) -> Tensor",
    cpu=_ref.cast_width,
    cuda=_utility_cuda(_k.cast_width_launch, _ref.cast_width, root=False),
    fake=_count_fake,
)
_depth_op = define(
    f"cast_depth(Tensor u_hist, Tensor c, float C2, int R, {_TABLE_ARGS}, Tensor? width) -> Tensor",
    cpu=_ref.cast_depth,
    cuda=_depth_cuda,
    fake=_flag_fake,
)
_rerank_op = define(
    f"cast_rerank(Tensor scores, Tensor costs, float C3, Tensor? active, {_TABLE_ARGS}) -> Tensor",
    cpu=_ref.cast_rerank,
    cuda=_utility_cuda(_k.cast_rerank_launch, _ref.cast_rerank, root=True),
    fake=_count_fake,
)


_PASSED = Memo()
"""Signatures of calls whose checks passed (``validate=False``), with the op's name."""
_REPLAYS = {name: Replays(f"cast_{name}", record_after=1) for name in ("select", "width",
            "depth", "rerank")}  # fmt: skip
"""Calls per signature replayed without the ops' Python layers (``treeops.kernels._replay``).
The threshold is launched, so it is in the key; a value seen once is not recorded (a caller
may change it on every call)."""


def _with_threshold(key, C) -> tuple | None:
    """A replay's key: the checks' signature and the threshold it launches (a plain number
    only; the checks' memo stays keyed without it, so a threshold changed per call still skips
    the checks)."""
    if key is None or C.__class__ not in (int, float):
        return None
    return (key, C.__class__, C)


def _run(name: str, key, tensors: tuple, op, *args) -> torch.Tensor:
    """``op(*args)``, or its replay for ``key`` (None: the op)."""
    replays = _REPLAYS[name]
    res = replays.run(key, tensors)
    return res if res is not MISS else replays.call(key, tensors, op, *args)


def _check_table(
    costs: torch.Tensor,
    cname: str,
    seq_lens: torch.Tensor | None,
    context_len: int,
    unit: torch.Tensor | None,
    sizes: dict[str, int],
) -> None:
    """A per-context cost table ``costs`` [MC, K] with its ``seq_lens`` [B], ``context_len``
    and ``unit`` [MC] or None; or a cost vector, and then none of them."""
    if costs.dim() != 2:
        for name, v in (("seq_lens", seq_lens), ("unit", unit)):
            if v is not None:
                raise ValueError(
                    f"Invalid value of {name}: only with a per-context table of {cname} "
                    f"([MC, K]), got {cname} of shape {list(costs.shape)}"
                )
        return
    if seq_lens is None:
        raise ValueError(
            f"Invalid shape of {cname}: expected [K], or [MC, K] (a per-context table) with "
            f"seq_lens, got {list(costs.shape)} and no seq_lens"
        )
    check_tensor("seq_lens", seq_lens, shape=("B",), dtype=(torch.int32, torch.int64),
                 sizes=sizes)  # fmt: skip
    if unit is not None:
        check_tensor("unit", unit, shape=("MC",), dtype=(torch.float32, torch.float64),
                     sizes=sizes)  # fmt: skip
    if not isinstance(context_len, int) or isinstance(context_len, bool) or context_len < 1:
        raise ValueError(
            f"Invalid value of context_len: expected a positive int (tokens per row of the "
            f"table), got {context_len!r}"
        )


def _check_scores_costs(
    scores: torch.Tensor,
    costs: torch.Tensor,
    active: torch.Tensor | None,
    C: float,
    cname: str,
    validate: bool,
    seq_lens: torch.Tensor | None = None,
    context_len: int = 0,
    unit: torch.Tensor | None = None,
) -> tuple | None:
    """The call's checks (skipped for a signature that passed them); returns its key (None
    under ``validate``)."""
    key = None
    if not validate:
        key = signature((scores, costs, active, seq_lens, unit), (cname, C, context_len))
    if _PASSED.get(key) is not None:
        return key
    sizes: dict[str, int] = {}
    check_tensor(
        "scores",
        scores,
        shape=("B", "M"),
        dtype=(torch.float32, torch.float64, torch.bfloat16, torch.float16),
        sizes=sizes,
    )
    shape = ("MC", "K") if costs.dim() == 2 else ("K",)
    check_tensor("costs", costs, shape=shape, dtype=(torch.float32, torch.float64), sizes=sizes)
    if active is not None:
        check_tensor("active", active, shape=("B",), dtype=torch.bool, sizes=sizes)
    _check_table(costs, "costs", seq_lens, context_len, unit, sizes)
    check_same_device(scores=scores, costs=costs, active=active, seq_lens=seq_lens, unit=unit)
    if sizes["K"] < 1 or sizes.get("MC", 1) < 1:
        raise ValueError(f"Invalid shape of costs: expected [K] or [MC, K] with K, MC >= 1, "
                         f"got {list(costs.shape)}")  # fmt: skip
    if not isinstance(C, (int, float)) or C != C:
        raise ValueError(f"Invalid value of {cname}: expected a number, got {C!r}")
    if validate:
        check_finite("scores", scores, nonnegative=True)
        check_finite("costs", costs, nonnegative=True)
    _PASSED.put(key, True)
    return key


def cast_select(u: torch.Tensor, c: torch.Tensor, C: float) -> torch.Tensor:
    """Algorithm 1: the largest ``k`` in ``[1, K]`` maximising ``u_k - C * c_k``.

    Args:
        u: [K] utilities, ``u[k - 1] = u_k`` (non-decreasing in the CAST rules).
        c: [K] costs, ``c[k - 1] = c_k``.
        C: threshold.

    Returns:
        0-d int32 tensor on ``u``'s device.

    Example:
        >>> import torch, treeops
        >>> int(treeops.cast_select(torch.tensor([1., 1.5, 1.75, 1.875]),
        ...                         torch.tensor([1., 2., 3., 4.]), 0.25))
        3
    """
    tensors = (u, c)
    key = signature(tensors, ("select",))
    if _PASSED.get(key) is None:
        sizes: dict[str, int] = {}
        check_tensor("u", u, shape=("K",), dtype=(torch.float32, torch.float64), sizes=sizes)
        check_tensor("c", c, shape=("K",), dtype=(torch.float32, torch.float64), sizes=sizes)
        check_same_device(u=u, c=c)
        if sizes["K"] < 1:
            raise ValueError("Invalid shape of u: expected [K] with K >= 1, got [0]")
        _PASSED.put(key, True)
    return _run("select", _with_threshold(key, C), tensors, _select_op, u, c, float(C))


def cast_width(
    scores: torch.Tensor,
    costs: torch.Tensor,
    C1: float,
    *,
    active: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    context_len: int = 0,
    unit: torch.Tensor | None = None,
    validate: bool = False,
) -> torch.Tensor:
    """CAST's width for the next frontier (Algorithm 1 with threshold ``C1``).

    Args:
        scores: [B, M] float, this draft layer's candidate path scores per request (any order;
            a negative entry means "no candidate" and counts as 0 — rejected under ``validate``).
        costs: [K] float, ``c_k = S_D(B)[select(ctx)][k] / S_T(B)[select(ctx)][1]``
            (``CostTable.width_costs``); K is the largest width allowed. Or [MC, K], the draft
            times per context bucket (``CostTable.device_tables``), looked up in the same
            launch: row ``min(ctx // context_len, MC - 1)``, ``ctx`` the longest ``seq_lens``
            of an active request, divided by ``unit`` at that row (the target's one-token
            times [MC]; default ``costs[:, 0]``), so a graph replayed as contexts grow needs
            no new costs from the host.
        C1: threshold.
        active: [B] bool, requests that count in the batch mean (default all).
        seq_lens, context_len, unit: with a per-context ``costs`` only (see there).
        validate: also reject NaN/inf/negative scores and costs (a host sync). Without it
            such values are the caller's responsibility: the result is unspecified (no
            memory access depends on them).

    Returns:
        0-d int32 tensor, the width ``n`` in ``[1, K]``: the largest k maximising
        ``u_k - C1 * c_k`` with ``u_k`` = mean over active requests of their k best scores,
        among ``k <= A``, ``A`` = the most candidates (entries >= 0) of any active request
        (at least 1; 1 if none is active). The width never exceeds the candidates that exist:
        past ``A`` the utility is flat, and on a plateau of costs the uncapped rule would pick
        the plateau's end (a frontier no request can fill). The cap is the max over active
        requests because the width is one decision for the batch; each request fills
        ``min(n, its candidates)`` rows.

    Example:
        >>> import torch, treeops
        >>> s = torch.tensor([[0.5, 0.25, 0.125, 0.0625]])
        >>> int(treeops.cast_width(s, torch.tensor([1., 1., 1., 1.]), C1=1.0))  # equal costs: all
        4
        >>> int(treeops.cast_width(s[:, :2], torch.tensor([1., 1., 1., 1.]), C1=1.0))  # 2 exist
        2
    """
    key = _check_scores_costs(
        scores, costs, active, C1, "C1", validate, seq_lens, context_len, unit
    )
    return _run("width", key, (scores, costs, active, seq_lens, unit), _width_op, scores, costs,
                float(C1), active, seq_lens, int(context_len), unit)  # fmt: skip


def cast_depth(
    u_hist: torch.Tensor,
    c: torch.Tensor,
    C2: float,
    R: int,
    *,
    seq_lens: torch.Tensor | None = None,
    context_len: int = 0,
    unit: torch.Tensor | None = None,
    width: torch.Tensor | None = None,
    validate: bool = False,
) -> torch.Tensor:
    """CAST's depth rule: draft layer i+1 iff ``alpha * u^(i) / c^(i) >= C2``.

    Args:
        u_hist: [i + 1] float, ``u^(0)_{n_0} .. u^(i)_{n_i}``: the utility of the chosen width at
            each layer drafted so far in this decoding step.
        c: 0-d float, ``c^(i)_{n_i}``, the normalised draft cost of the current width. Or
            [MC, K], the draft times per context bucket, looked up in the launch: entry
            ``width - 1`` of row ``min(ctx // context_len, MC - 1)`` divided by ``unit`` there
            (default ``c[:, 0]``), ``ctx`` the longest of ``seq_lens`` [B].
        C2: threshold.
        R: FIFO length (>= 1).
        seq_lens, context_len, unit: with a per-context ``c`` only.
        width: 0-d int32/int64 in [1, K] (``cast_width``'s result), with a per-context ``c``.
        validate: also reject NaN/inf/negative utilities and costs (a host sync). Without it
            such values are the caller's responsibility: the result is unspecified.

    ``alpha`` is the mean of the last ``R`` entries of ``[1, phi_0, .., phi_{i-1}]`` with
    ``phi_j = u^(j+1) / u^(j)`` (0 where ``u^(j) = 0``). Returns a 0-d bool tensor.

    Example:
        >>> import torch, treeops
        >>> bool(treeops.cast_depth(torch.tensor([1.0, 0.5]), torch.tensor(0.25), C2=1.0, R=4))
        True
    """
    key = None
    tensors = (u_hist, c, seq_lens, unit, width)
    if not validate:
        key = signature(tensors, ("depth", R, context_len))
    if _PASSED.get(key) is None:
        check_tensor("u_hist", u_hist, shape=(None,), dtype=(torch.float32, torch.float64))
        table = c.dim() == 2
        check_tensor("c", c, shape=("MC", "K") if table else (),
                     dtype=(torch.float32, torch.float64))  # fmt: skip
        _check_table(c, "c", seq_lens, context_len, unit, {"MC": c.shape[0]} if table else {})
        if table:
            if width is None:
                raise ValueError(
                    "Invalid value of width: a per-context table c ([MC, K]) needs the width "
                    "(a 0-d int tensor), got None"
                )
            check_tensor("width", width, shape=(), dtype=(torch.int32, torch.int64))
        elif width is not None:
            raise ValueError("Invalid value of width: only with a per-context table c ([MC, K])")
        check_same_device(u_hist=u_hist, c=c, seq_lens=seq_lens, unit=unit, width=width)
        if u_hist.numel() < 1:
            raise ValueError("Invalid shape of u_hist: expected [i + 1] with i >= 0, got [0]")
        if not isinstance(R, int) or isinstance(R, bool) or R < 1:
            raise ValueError(f"Invalid value of R: expected a positive int, got {R!r}")
        _PASSED.put(key, True)
    if validate:
        check_finite("u_hist", u_hist, nonnegative=True)
        check_finite("c", c, nonnegative=True)
    return _run("depth", _with_threshold(key, C2), tensors, _depth_op, u_hist, c, float(C2), R,
                seq_lens, int(context_len), unit, width)  # fmt: skip


def cast_rerank(
    scores: torch.Tensor,
    costs: torch.Tensor,
    C3: float,
    *,
    active: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None,
    context_len: int = 0,
    unit: torch.Tensor | None = None,
    validate: bool = False,
) -> torch.Tensor:
    """CAST's verification count, root included (Algorithm 1 with threshold ``C3``).

    Args:
        scores: [B, M] float, every candidate path score of the decoding step per request
            (negative = no candidate; rejected under ``validate``).
        costs: [K] float, ``c_k = S_T(B)[select(ctx)][k] / S_T(B)[select(ctx)][1]``
            (``CostTable.rerank_costs``); K is the tree capacity. Or [MC, K], the target times
            per context bucket, looked up in the launch as ``cast_width``'s (``unit`` default
            ``costs[:, 0]``, which is the target's one-token time here).
        C3: threshold.
        active: [B] bool (default all).
        seq_lens, context_len, unit: with a per-context ``costs`` only.
        validate: also reject NaN/inf/negative scores and costs (a host sync). Without it
            such values are the caller's responsibility: the result is unspecified (no
            memory access depends on them).

    Returns:
        0-d int32 tensor ``n`` in ``[1, K]``; ``u_k`` = mean over active requests of
        ``1 + (sum of their k - 1 best scores)``; the largest maximiser of ``u_k - C3 * c_k``
        among ``k <= 1 + A``, ``A`` = the most candidates (entries >= 0) of any active request
        (1 if none is active): the count never exceeds the largest tree the candidates can make
        (a tree holds ``min(n, 1 + its candidates)`` nodes), even on a plateau of costs.

    Example:
        >>> import torch, treeops
        >>> s = torch.tensor([[0.5, 0.25, 0.125]])
        >>> int(treeops.cast_rerank(s, torch.tensor([1., 1.25, 1.5, 1.75]), C3=1.0))
        3
        >>> int(treeops.cast_rerank(s, torch.ones(8), C3=1.0))  # flat costs: root + 3 exist
        4
    """
    key = _check_scores_costs(
        scores, costs, active, C3, "C3", validate, seq_lens, context_len, unit
    )
    return _run("rerank", key, (scores, costs, active, seq_lens, unit), _rerank_op, scores,
                costs, float(C3), active, seq_lens, int(context_len), unit)  # fmt: skip

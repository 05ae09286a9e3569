"""Tree build (docs/design.md op 3) under an EAGLE or a CAST policy.

A decoding step drafts layer by layer into a ``DraftState`` (fixed-capacity device buffers), then
reranks the candidates into a ``Tree``::

    policy = treeops.Cast(C1=0.5, C2=0.2, C3=0.3, R=4, cost_table=table)  # or EagleStatic(...)
    state = treeops.DraftState.new(policy, root_tokens, seq_lens)       # once; .reset() per step
    while True:
        logits = draft_forward(state.frontier_tokens, ...)              # [B, W, V]
        treeops.build_tree_expand(logits, state, policy)                # one launch
        if not state.wants_next_layer():                                # one event wait
            break
    tree = treeops.build_tree_emit(state, policy)                       # one launch (CAST: two)

or, with a callable for the draft forward, ``tree = treeops.build_tree(policy, draft_fn,
root_tokens, seq_lens)``. Expand and emit are the custom ops ``torch.ops.treeops.build_tree_expand``
and ``build_tree_emit`` (the state's buffers are their mutated arguments): CUDA tensors run the
Triton kernels (``treeops.kernels.build_tree``), CPU tensors the reference
(``treeops.reference.build_tree``).

Candidates are numbered ``i * W * K + r * K + j`` (draft layer i, frontier row r, top-k rank j):
the tie-break of rank order. ``W`` is the frontier capacity (``EagleStatic.topk``,
``Cast.max_width``), ``K`` the top-k per row, ``D`` the most draft layers, ``N`` the tree capacity.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from . import _draft_state
from ._checks import (
    Memo,
    check_finite,
    check_positive_int,
    check_same_device,
    check_tensor,
    cuda_device,
)
from ._draft_state import STATE_TENSORS, DraftState, state_signature
from ._library import OUT_TREE, define
from ._runtime import cdiv
from .cost_table import CostTable
from .kernels import build_tree as _kernels
from .kernels import build_tree_tiling as _tiling
from .kernels._replay import MISS, Replays
from .kernels.draft_reset import reset as _reset_launch
from .reference import build_tree as _ref
from .tree import Tree, check_tree

__all__ = [
    "EagleStatic",
    "Cast",
    "DraftState",
    "build_tree_expand",
    "build_tree_emit",
    "build_tree",
]

# DraftState.reset on CUDA: one launch (the state module sits below the kernels and cannot
# import them itself)
_draft_state.CUDA_RESET = _reset_launch


@dataclass(frozen=True, eq=False)
class EagleStatic:
    """EAGLE-2's dynamic tree with static sizes: ``depth`` draft layers, each frontier row expanded
    to its ``topk`` best tokens, the ``width`` best candidates of a layer forming the next
    frontier (default ``topk``, EAGLE-2's choice), and the ``budget`` best nodes (root included)
    sent to verification (the tree capacity N)."""

    depth: int
    topk: int
    budget: int
    width: int | None = None

    is_cast = False

    def __post_init__(self) -> None:
        check_positive_int("depth", self.depth)
        check_positive_int("topk", self.topk)
        check_positive_int("budget", self.budget)
        if self.width is not None:
            check_positive_int("width", self.width)

    @property
    def max_depth(self) -> int:
        return self.depth

    @property
    def max_width(self) -> int:
        return self.topk if self.width is None else self.width

    @property
    def capacity(self) -> int:
        return self.budget


@dataclass(frozen=True, eq=False)
class Cast:
    """CAST's cost-aware tree (docs/design.md op 5).

    Args:
        C1: width threshold: a wider frontier must buy at least ``C1`` of utility (batch-mean path
            score) per unit of normalised draft cost. Higher = narrower.
        C2: depth threshold: draft another layer iff the predicted utility of the next layer per
            unit draft cost is >= ``C2``. Higher = shallower.
        C3: verification threshold for the rerank: nodes beyond the point where one more node
            adds less than ``C3`` utility per unit of normalised target cost are dropped.
        R: length of the FIFO of utility ratios that predicts the next layer's utility.
        cost_table: measured ``f(B, c, n)``; its ``n_max`` must cover ``max_width`` and
            ``capacity`` (required).
        topk: K, candidates per frontier row.
        max_width: W, frontier capacity (the largest width Algorithm 1 may pick).
        max_depth: D, the most draft layers per step.
        capacity: N, tree capacity (the largest verification count, root included).

    ``C1``, ``C2``, ``C3`` all None (the default) is λ-CAST (docs/design.md op 5, "λ-CAST"):
    the thresholds are the running throughput estimate λ̂ and the tree's sizes are planned
    between steps by a ``treeops.CastPlanner`` (the example decoder does this); drafting then
    runs the plan's ``EagleStatic`` shape (``CastPlanner.policy_for``), and
    ``build_tree_expand`` / ``build_tree_emit`` with a λ-CAST policy itself are a
    ``ValueError``. Either all three thresholds are numbers or all are None.
    """

    C1: float | None = None
    C2: float | None = None
    C3: float | None = None
    R: int = 4
    cost_table: CostTable | None = None
    topk: int = 10
    max_width: int = 10
    max_depth: int = 8
    capacity: int = 64

    is_cast = True

    def __post_init__(self) -> None:
        given = [getattr(self, n) is not None for n in ("C1", "C2", "C3")]
        if any(given) and not all(given):
            raise ValueError(
                "Invalid value of C1, C2, C3: expected all three numbers (fixed thresholds) or "
                f"all None (λ-CAST), got C1={self.C1!r}, C2={self.C2!r}, C3={self.C3!r}"
            )
        for name in ("C1", "C2", "C3"):
            v = getattr(self, name)
            if v is None:
                continue
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v != v:
                raise ValueError(f"Invalid value of {name}: expected a number, got {v!r}")
        for name in ("R", "topk", "max_width", "max_depth", "capacity"):
            check_positive_int(name, getattr(self, name))
        if not isinstance(self.cost_table, CostTable):
            raise ValueError(
                f"Invalid type of cost_table: expected treeops.CostTable, got "
                f"{type(self.cost_table).__name__}"
            )
        need = max(self.max_width, self.capacity)
        if self.cost_table.n_max < need:
            raise ValueError(
                f"Invalid value of cost_table: expected n_max >= max(max_width, "
                f"capacity) = {need}, got {self.cost_table.n_max}"
            )

    @property
    def adaptive(self) -> bool:
        """λ-CAST: no fixed thresholds; the sizes come from a ``CastPlanner``."""
        return self.C1 is None


Policy = EagleStatic | Cast


def _check_policy(policy: object) -> None:
    if not isinstance(policy, (EagleStatic, Cast)):
        raise ValueError(
            f"Invalid type of policy: expected treeops.EagleStatic or treeops.Cast, "
            f"got {type(policy).__name__}"
        )
    if isinstance(policy, Cast) and policy.adaptive:
        raise ValueError(
            "Invalid value of policy: a λ-CAST policy (C1, C2, C3 None) has no thresholds to "
            "draft with; draft its plan's shape (treeops.CastPlanner.policy_for) or pass C1-C3"
        )


_PASSED = Memo()
"""Signatures (``state_signature``) of expand and emit calls whose checks passed with
``validate=False``; the layer counter is checked on every call."""
_EXPAND_REPLAYS = Replays("build_tree_expand")
_EMIT_REPLAYS = Replays("build_tree_emit")
"""The ops' calls replayed without their Python layers (``treeops.kernels._replay``), each kept
under ``_replay_key``: the public functions still advance ``state.layer`` and ``publish``."""


def _check_state(state: object, policy: Policy) -> DraftState:
    if not isinstance(state, DraftState):
        raise ValueError(
            f"Invalid type of state: expected treeops.DraftState, got {type(state).__name__}"
        )
    D, W, K = policy.max_depth, policy.max_width, policy.topk
    B = state.active.shape[0]
    check_tensor("state.cand_scores", state.cand_scores, shape=(B, D, W * K), dtype=torch.float32)
    check_tensor("state.frontier", state.frontier, shape=(B, W), dtype=torch.int32)
    check_tensor("state.workspace['pos']", state.workspace["pos"], shape=(B, D * W * K))
    check_tensor("state.workspace['sel']", state.workspace["sel"], shape=(B, policy.capacity))
    # the kernels index every buffer densely: a strided view (a user-built state) would be read
    # and written wrongly
    for f in STATE_TENSORS:
        check_tensor(f"state.{f}", getattr(state, f), contiguous=True)
    for key, t in state.workspace.items():
        check_tensor(f"state.workspace[{key!r}]", t, contiguous=True)
    return state


def _kernel_inputs(state: DraftState, policy: Policy) -> dict:
    """What both tree-build launchers read: the state's layer, request and candidate tensors and
    workspace, and CAST's thresholds and device cost tables (None under EAGLE)."""
    cast = None
    if policy.is_cast:
        t = policy.cost_table
        tables = t.device_tables(state.active.shape[0], state.cand_scores.device)
        cast = _kernels.CastInputs(
            policy.C1, policy.C2, policy.C3, policy.R, *tables, t.L, t.M, t.n_max
        )
    return dict(
        layer=state.layer,
        active=state.active,
        seq_lens=state.seq_lens,
        cand_tokens=state.cand_tokens,
        cand_scores=state.cand_scores,
        cand_parents=state.cand_parents,
        decisions=state.decisions,
        workspace=state.workspace,
        cast=cast,
    )


def _launch_expand(logits: torch.Tensor, state: DraftState, policy: Policy, **tuning) -> None:
    """The expand launcher on a state (no checks, does not advance ``state.layer``), for tests
    and benchmarks; ``tuning``: ``block_v``, ``num_warps``, ``split`` of the launcher."""
    _kernels.expand(
        logits,
        topk=policy.topk,
        frontier=state.frontier,
        frontier_tokens=state.frontier_tokens,
        frontier_scores=state.frontier_scores,
        u_hist=state.u_hist,
        **_kernel_inputs(state, policy),
        **tuning,
    )


def _launch_emit(state: DraftState, policy: Policy, *, out: Tree | None = None) -> Tree:
    """The emit launchers on a state (no checks), for tests and benchmarks."""
    return _kernels.emit(
        capacity=policy.capacity,
        root_tokens=state.root_tokens,
        out=out,
        **_kernel_inputs(state, policy),
    )


# ------------------------------------------------------------------------------ custom ops
# The ops take the DraftState's buffers (the mutated ones as such) and CAST's inputs as plain
# tensors and numbers: ``target_times`` / ``draft_times`` are the cost table's device rows
# [M, n_max] (None under EAGLE), ``bucket_len`` its L. ``state.layer`` and ``state.publish``
# stay in Python around the op.


def _cast_args(state: DraftState, policy: Policy) -> tuple:
    """(target_times, draft_times, C1, C2, C3, R, L): CAST's op arguments (stand-ins for EAGLE)."""
    if not policy.is_cast:
        return None, None, 0.0, 0.0, 0.0, 1, 1
    t = policy.cost_table
    target, draft = t.device_tables(state.active.shape[0], state.cand_scores.device)
    return target, draft, float(policy.C1), float(policy.C2), float(policy.C3), policy.R, t.L


def _cast_inputs(target_times, draft_times, c1, c2, c3, fifo, bucket_len):
    """The launchers' ``CastInputs`` from the op's arguments (None under EAGLE)."""
    if target_times is None:
        return None
    M, n_max = target_times.shape
    return _kernels.CastInputs(c1, c2, c3, fifo, target_times, draft_times, bucket_len, M, n_max)


@dataclass(frozen=True)
class _CostRows:
    """What the reference reads of a ``CostTable``: the device rows and the context bucket."""

    target: torch.Tensor
    draft: torch.Tensor
    L: int

    def device_tables(self, B: int, device: object) -> tuple[torch.Tensor, torch.Tensor]:
        return self.target, self.draft

    def bucket(self, c: int) -> int:
        return min(max(int(c), 0) // self.L, self.target.shape[0] - 1)


def _ref_policy(topk, W, D, N, target_times, draft_times, c1, c2, c3, fifo, bucket_len):
    """A stand-in for the policy the reference reads (its sizes, thresholds and cost rows)."""
    cast = target_times is not None
    return SimpleNamespace(
        topk=topk, max_width=W, max_depth=D, capacity=N, is_cast=cast, C1=c1, C2=c2, C3=c3,
        R=fifo, cost_table=_CostRows(target_times, draft_times, bucket_len) if cast else None,
    )  # fmt: skip


def _replay_key(key, layer: int, target_times, c1, c2, c3, fifo, bucket_len) -> tuple | None:
    """The key of an expand or emit call's replay: the call's ``state_signature`` (None: no
    replay) and every scalar the launches take that the signature does not fix. The signature
    holds the policy by identity (so its sizes, which a frozen policy keeps) and every tensor's
    metadata; the layer counter is a host int that changes between calls, and the thresholds,
    FIFO length and context bucket are keyed by the values launched, as is the cost rows'
    shape (launched as the bucket count and ``n_max``): a policy or cost table changed in place
    then records anew instead of replaying stale values. The cost rows themselves are among the
    replayed ``tensors`` (their pointers read per call)."""
    if key is None:
        return None
    rows = None if target_times is None else target_times.shape
    return (key, layer.__class__, layer, c1, c2, c3, fifo, bucket_len, rows)


def _split_workspace(logits: torch.Tensor, state: DraftState, topk: int) -> tuple:
    """(part_m, part_s, part_t): the split-V expand's buffers on CUDA, kept in
    ``state.workspace`` and sized by the launcher's own rules, or Nones when the launch has one
    program per row (always off the GPU)."""
    B, W, V = logits.shape
    block_v, split = _tiling.expand_tiling(B * W, V, logits.device)
    if split <= 1:
        return None, None, None
    blocks = cdiv(V, _tiling.expand_max_block(B * W, V, block_v, logits.device))
    return _tiling.split_workspace(state.workspace, B * W, split, blocks, logits.device)


def _expand_cuda(
    logits, layer, topk, active, seq_lens, frontier, frontier_tokens, frontier_scores,
    cand_tokens, cand_scores, cand_parents, decisions, u_hist, counters, cum, part_m, part_s,
    part_t, target_times, draft_times, c1, c2, fifo, bucket_len,
):  # fmt: skip
    ws = {"counters": counters, "cum": cum}
    if part_m is not None:
        ws.update(part_m=part_m, part_s=part_s, part_t=part_t)
    with cuda_device(logits):
        _kernels.expand(
            logits, layer=layer, topk=topk, active=active, seq_lens=seq_lens, frontier=frontier,
            frontier_tokens=frontier_tokens, frontier_scores=frontier_scores,
            cand_tokens=cand_tokens, cand_scores=cand_scores, cand_parents=cand_parents,
            decisions=decisions, u_hist=u_hist, workspace=ws,
            cast=_cast_inputs(target_times, draft_times, c1, c2, 0.0, fifo, bucket_len),
        )  # fmt: skip


def _expand_cpu(
    logits, layer, topk, active, seq_lens, frontier, frontier_tokens, frontier_scores,
    cand_tokens, cand_scores, cand_parents, decisions, u_hist, counters, cum, part_m, part_s,
    part_t, target_times, draft_times, c1, c2, fifo, bucket_len,
):  # fmt: skip
    W, D = frontier.shape[1], cand_scores.shape[1]
    state = DraftState(
        root_tokens=seq_lens,  # not read by the expand
        seq_lens=seq_lens, active=active, cand_tokens=cand_tokens, cand_scores=cand_scores,
        cand_parents=cand_parents, frontier=frontier, frontier_tokens=frontier_tokens,
        frontier_scores=frontier_scores, decisions=decisions, u_hist=u_hist, layer=layer,
    )  # fmt: skip
    policy = _ref_policy(topk, W, D, 0, target_times, draft_times, c1, c2, 0.0, fifo, bucket_len)
    _ref.build_tree_expand(logits, state, policy)


_expand_op = define(
    "build_tree_expand(Tensor logits, int layer, int topk, Tensor active, Tensor seq_lens, "
    "Tensor(a!) frontier, Tensor(b!) frontier_tokens, Tensor(c!) frontier_scores, "
    "Tensor(d!) cand_tokens, Tensor(e!) cand_scores, Tensor(f!) cand_parents, "
    "Tensor(g!) decisions, Tensor(h!) u_hist, Tensor(i!) counters, Tensor(j!) cum, "
    "Tensor(k!)? part_m, Tensor(l!)? part_s, Tensor(m!)? part_t, "
    "Tensor? target_times, Tensor? draft_times, float c1, float c2, int fifo, int bucket_len"
    ") -> ()",
    cpu=_expand_cpu,
    cuda=_expand_cuda,
)


def _emit_cuda(
    layer, active, seq_lens, root_tokens, cand_tokens, cand_scores, cand_parents, decisions,
    sel, pos, cum, target_times, c3, bucket_len, *out,
):  # fmt: skip
    with cuda_device(cand_scores):
        _kernels.emit(
            layer=layer, capacity=out[1].shape[1], active=active, seq_lens=seq_lens,
            root_tokens=root_tokens, cand_tokens=cand_tokens, cand_scores=cand_scores,
            cand_parents=cand_parents, decisions=decisions,
            workspace={"sel": sel, "pos": pos, "cum": cum},
            cast=_cast_inputs(target_times, target_times, 0.0, 0.0, c3, 1, bucket_len),
            out=Tree(*out),
        )  # fmt: skip


def _emit_cpu(
    layer, active, seq_lens, root_tokens, cand_tokens, cand_scores, cand_parents, decisions,
    sel, pos, cum, target_times, c3, bucket_len, *out,
):  # fmt: skip
    D = cand_scores.shape[1]
    # the emit reads no frontier field nor u_hist (whose length is the state's D)
    state = DraftState(
        root_tokens=root_tokens, seq_lens=seq_lens, active=active, cand_tokens=cand_tokens,
        cand_scores=cand_scores, cand_parents=cand_parents,
        frontier=cand_parents, frontier_tokens=cand_tokens, frontier_scores=cand_scores,
        decisions=decisions, u_hist=decisions[:D], layer=layer,
    )  # fmt: skip
    policy = _ref_policy(
        0, 0, D, out[1].shape[1], target_times, target_times, 0.0, 0.0, c3, 1, bucket_len
    )
    _ref.build_tree_emit(state, policy, out=Tree(*out))


_emit_op = define(
    "build_tree_emit(int layer, Tensor active, Tensor seq_lens, Tensor root_tokens, "
    "Tensor cand_tokens, Tensor cand_scores, Tensor cand_parents, Tensor(a!) decisions, "
    "Tensor(b!) sel, Tensor(c!) pos, Tensor(d!) cum, Tensor? target_times, float c3, "
    f"int bucket_len, {OUT_TREE}) -> ()",
    cpu=_emit_cpu,
    cuda=_emit_cuda,
)


def build_tree_expand(
    logits: torch.Tensor, state: DraftState, policy: Policy, *, validate: bool = False
) -> None:
    """Expand one draft layer: softmax + top-k of the frontier's logits, path scores, the next
    frontier and the policy's decisions (docs/design.md op 3); advances ``state.layer``.

    Args:
        logits: [B, W, V] bfloat16/float16/float32, the draft model's logits at each frontier row
            (row r of request b predicts the children of frontier node r; rows with
            ``state.frontier_valid`` False are ignored), or at layer 0 [B, 1, V]: the root's row
            alone, the one row ``state.reset`` leaves valid (launched over B rows, not B * W).
            The last dimension must be contiguous.
        state: the step's ``DraftState`` (made by ``DraftState.new`` for this ``policy``).
        policy: ``EagleStatic`` or ``Cast``.
        validate: also reject NaN logits (a host sync).

    Shapes, dtypes, devices and strides are always checked (the state's buffers contiguous);
    values are the caller's responsibility when ``validate=False``: NaN logits are undefined
    behaviour; ``validate=True`` checks them (with a host sync).

    Writes candidates of layer ``state.layer``, the next frontier (``frontier``,
    ``frontier_tokens``, ``frontier_scores``) and ``widths[i]``, ``flags[i]``. CAST's width is at
    most the most valid next-frontier rows of any active request (at least 1), even on a plateau
    of draft costs: with a request active, ``width(i)`` = the most valid rows of the next frontier
    (``frontier_valid``), the exact size of the next draft forward. On CUDA one Triton
    launch (online softmax and top-k over V in one pass, then the batch-level width), no host sync.

    Example:
        >>> import torch, treeops
        >>> pol = treeops.EagleStatic(depth=2, topk=2, budget=4)
        >>> st = treeops.DraftState.new(pol, torch.tensor([7]), torch.tensor([5]))
        >>> treeops.build_tree_expand(torch.tensor([[[0., 2., 1.], [0., 0., 0.]]]), st, pol,
        ...                           validate=True)
        >>> st.frontier_tokens.tolist(), st.layer
        ([[1, 2]], 1)
    """
    key = None if validate else state_signature(state, (logits,), ("expand", policy))
    if _PASSED.get(key) is None:
        _check_policy(policy)
        _check_state(state, policy)
        rows = 1 if logits.dim() == 3 and logits.shape[1] == 1 else policy.max_width
        check_tensor(
            "logits",
            logits,
            shape=(state.active.shape[0], rows, None),
            dtype=(torch.float32, torch.bfloat16, torch.float16),
        )
        check_same_device(logits=logits, state=state.cand_scores)
        V = logits.shape[2]
        if V < policy.topk:
            raise ValueError(
                f"Invalid shape of logits: expected vocabulary V >= topk = {policy.topk}, "
                f"got V = {V}"
            )
        if logits.stride(2) != 1:
            raise ValueError(
                f"Invalid stride of logits: expected the vocabulary dimension "
                f"contiguous (stride 1), got {logits.stride(2)}"
            )
        _PASSED.put(key, True)
    if state.layer >= policy.max_depth:
        raise ValueError(
            f"Invalid state: all {policy.max_depth} draft layers already expanded "
            "(call state.reset for the next decoding step)"
        )
    if logits.shape[1] != policy.max_width and state.layer != 0:
        raise ValueError(
            f"Invalid shape of logits: expected {policy.max_width} rows a request at layer "
            f"{state.layer} (one row, the root's, only at layer 0), got {logits.shape[1]}"
        )
    if validate and bool(torch.isnan(logits).any()):
        raise ValueError("Invalid value in logits: expected numbers, got NaN")
    target, draft, c1, c2, _c3, fifo, bucket_len = _cast_args(state, policy)
    layer = state.layer
    # every tensor the launches read or write, in the op's argument order: a replay re-reads
    # their pointers (the split buffers and cost rows included: made outside the op, per state
    # and per table cache, so that one key's calls may pass other ones)
    tensors = (
        logits, state.active, state.seq_lens, state.frontier, state.frontier_tokens,
        state.frontier_scores, state.cand_tokens, state.cand_scores, state.cand_parents,
        state.decisions, state.u_hist, state.workspace["counters"], state.workspace["cum"],
        *_split_workspace(logits, state, policy.topk), target, draft,
    )  # fmt: skip
    rkey = _replay_key(key, layer, target, c1, c2, 0.0, fifo, bucket_len)
    with cuda_device(logits):  # the launch and publish's event on the logits' device
        if _EXPAND_REPLAYS.run(rkey, tensors) is MISS:
            _EXPAND_REPLAYS.call(
                rkey, tensors, _expand_op, logits, layer, policy.topk, *tensors[1:],
                c1, c2, fifo, bucket_len,
            )  # fmt: skip
        state.layer = layer + 1
        state.publish(layer)


def build_tree_emit(
    state: DraftState, policy: Policy, *, out: Tree | None = None, validate: bool = False
) -> Tree:
    """Rerank every candidate of the step and emit the ``Tree`` (docs/design.md op 3).

    The tree holds the root and the ``n - 1`` best candidates in rank order (score descending,
    ties to the lower candidate index), where ``n`` is ``EagleStatic.budget`` or CAST's
    Algorithm 1 with ``C3`` (``state.verify``), capped per request by its candidates. Under CAST
    ``n`` itself is at most 1 + the most candidates of any active request (1 if none is
    active), so ``verify_count() == max(num_nodes)`` when a request is active, even on a
    plateau of target costs.
    Ancestor-closed by construction. Capacity ``N = policy.capacity``.

    Args:
        state: the ``DraftState`` after at least one ``build_tree_expand``.
        policy: the policy the state was drafted with.
        out: optional ``Tree`` of capacity N and batch B to write into (no allocation).
        validate: also check the emitted tree's invariants (a host sync).

    Shapes, dtypes, devices and strides are always checked (``out``'s fields and the state's
    buffers contiguous); ``validate=True`` also checks the emitted tree's values (a host sync).

    On CUDA two Triton launches (select, then count + emit), no host sync.
    """
    outs = out.tensors() if isinstance(out, Tree) else (out,)
    key = None if validate else state_signature(state, outs, ("emit", policy, out.__class__))
    passed = _PASSED.get(key) is not None
    if not passed:
        _check_policy(policy)
        _check_state(state, policy)
    if state.layer < 1:
        raise ValueError("Invalid state: expected at least one expanded draft layer, got 0")
    B = state.active.shape[0]
    if out is not None and not passed:
        check_tree(out, name="out")
        if out.parents.shape != (B, policy.capacity):
            raise ValueError(
                f"Invalid shape of out.parents: expected "
                f"{[state.active.shape[0], policy.capacity]}, got "
                f"{list(out.parents.shape)}"
            )
        check_same_device(out=out.parents, state=state.cand_scores)
    if not passed:
        _PASSED.put(key, True)
    target, _draft, _c1, _c2, c3, _fifo, bucket_len = _cast_args(state, policy)
    layer = state.layer
    ws = state.workspace
    # every tensor the launches read or write but the tree the op makes (``out`` None), in the
    # op's argument order: a replay re-reads their pointers and makes a fresh tree
    tensors = (
        state.active, state.seq_lens, state.root_tokens, state.cand_tokens, state.cand_scores,
        state.cand_parents, state.decisions, ws["sel"], ws["pos"], ws["cum"], target,
    )  # fmt: skip
    if out is not None:
        tensors += outs
    rkey = _replay_key(key, layer, target, 0.0, 0.0, c3, 1, bucket_len)
    with cuda_device(state.cand_scores):  # the launches and publish's event on its device
        tree = _EMIT_REPLAYS.run(rkey, tensors)
        if tree is MISS:
            made = out is None
            tree = Tree.uninitialized(B, policy.capacity, state.cand_scores.device) if made else out
            _EMIT_REPLAYS.call(
                rkey, tensors, _emit_op, layer, *tensors[:11], c3, bucket_len, *tree.tensors(),
                result=tree if made else None,
            )  # fmt: skip
        elif out is not None:  # the replay wrote into out's tensors (and returned None)
            tree = out
        state.publish(state.max_depth)
    if validate:
        tree.validate()
        check_finite("tree.scores", tree.scores, nonnegative=True)
    return tree


def build_tree(
    policy: Policy,
    draft_fn: Callable[[DraftState], torch.Tensor],
    root_tokens: torch.Tensor,
    seq_lens: torch.Tensor,
    active: torch.Tensor | None = None,
    *,
    state: DraftState | None = None,
    out: Tree | None = None,
) -> Tree:
    """Draft one decoding step's tree: ``draft_fn(state) -> logits [B, W, V]`` is called once per
    draft layer (``state.layer`` says which; ``state.frontier_tokens`` are its inputs), until the
    policy stops (EAGLE: ``depth`` layers, no host wait; CAST: its depth rule, one event wait per
    layer), then
    the candidates are reranked into a ``Tree``. Pass ``state`` (and ``out``) to reuse buffers.

    Example:
        >>> import torch, treeops
        >>> g = torch.Generator().manual_seed(0)
        >>> fn = lambda st: torch.randn(1, 3, 50, generator=g)
        >>> t = treeops.build_tree(treeops.EagleStatic(depth=3, topk=3, budget=8), fn,
        ...                        torch.tensor([1]), torch.tensor([10]))
        >>> int(t.num_nodes[0]), t.validate()
        (8, None)
    """
    if state is None:
        state = DraftState.new(policy, root_tokens, seq_lens, active)
    else:
        state.reset(root_tokens, seq_lens, active)
    if policy.is_cast:
        while state.wants_next_layer():  # CAST's depth is decided on the device: one wait
            build_tree_expand(draft_fn(state), state, policy)
    else:
        for _ in range(policy.depth):  # static depth: no wait at all
            build_tree_expand(draft_fn(state), state, policy)
    return build_tree_emit(state, policy, out=out)

"""The statistics of one decoding step that λ-CAST's planner reads (``cast_step_stats``): the
batch-mean layer and verify curves of calibrated acceptance probabilities, and the calibration
counts per path-score bin. Computed on the device (two Triton launches on CUDA, torch ops
elsewhere), no host sync, capturable; the host reads them with the step's results."""

from __future__ import annotations

import numpy as np
import torch

from ._checks import Memo, check_same_device, check_tensor, signature
from .kernels import cast_plan as _kstats
from .tree import Tree, check_tree

__all__ = ["SCORE_BINS", "bin_prior", "cast_step_stats", "score_bin", "stats_size", "stats_layout"]


SCORE_BINS = 24
"""Calibration bins of a path score s: bin ``min(floor(-2 log2 s), 23)`` (half-octaves from 1
down to 2^-11.5; smaller scores and 0 share the last)."""


def score_bin(s: torch.Tensor) -> torch.Tensor:
    """The calibration bin of each score (``SCORE_BINS``), int64."""
    x = torch.floor(-2.0 * torch.log2(s.float().clamp(min=1e-30)))
    return x.clamp(0, SCORE_BINS - 1).long()


def bin_prior() -> np.ndarray:
    """Each bin's geometric-mean score: the acceptance probability assumed before data."""
    return 2.0 ** (-(np.arange(SCORE_BINS) + 0.5) / 2.0)


def stats_size(max_depth: int, max_width: int, capacity: int, graft: bool = False) -> int:
    """Length of ``cast_step_stats``'s output for a policy's maxima D, W, N:
    ``D * W + N + 2 * SCORE_BINS + 1``, and 2 more with ``graft`` (its ``grafted`` input)."""
    return max_depth * max_width + capacity + 2 * SCORE_BINS + 1 + (2 if graft else 0)


def stats_layout(D: int, W: int, N: int, graft: bool = False) -> dict[str, slice]:
    """Where each statistic lies in ``cast_step_stats``'s output (see its Layout)."""
    o = 0
    out = {}
    for name, n in (("layers", D * W), ("verify", N), ("seen", SCORE_BINS),
                    ("hits", SCORE_BINS), ("active", 1), ("graft", 2 if graft else 0)):  # fmt: skip
        if n:
            out[name] = slice(o, o + n)
        o += n
    return out


def cast_step_stats(
    cand_scores: torch.Tensor,
    tree: Tree,
    accepted: torch.Tensor,
    accept_len: torch.Tensor,
    active: torch.Tensor,
    rates: torch.Tensor,
    out: torch.Tensor,
    *,
    max_depth: int,
    max_width: int,
    capacity: int,
    grafted: torch.Tensor | None = None,
) -> None:
    """One step's statistics for the planner, written into ``out`` (float32, contiguous, length
    ``stats_size(max_depth, max_width, capacity, graft=grafted is not None)``); no host sync,
    capturable. On CUDA two Triton launches (``kernels/cast_plan.py``), elsewhere (and under
    ``torch.compile``) torch ops. Shapes, dtypes and devices are checked (``ValueError`` naming
    the argument); values are the caller's.

    Args:
        cand_scores: [B, d, C] float32, the step's candidate path scores (``DraftState``; < 0 = no
            candidate), d <= max_depth drafted layers.
        tree: the verified tree (its ``scores``, ``depth``, ``num_nodes``), capacity n.
        accepted: [B, n] int32, the accepted path's nodes (``accept_*``), the first
            ``accept_len[b]`` valid (the root first).
        accept_len: [B] int32.
        active: [B] bool.
        rates: [SCORE_BINS] float32, the calibrated acceptance probability of a candidate per
            score bin (``CastPlanner.rates``).
        grafted: optional [B] int32, the nodes Graft's successor table put at the end of each
            request's tree (its last ``grafted[b]`` nodes).

    Layout (``stats_layout``; D = max_depth, W = max_width, N = capacity): ``layers`` [D, W]:
    row i = batch mean over active requests of the cumulative sum of layer i's k best calibrated
    probabilities, k = 1..W (rows >= d zero); ``verify`` [N]: batch mean of 1 + the k - 1 best
    calibrated probabilities of the step; ``seen`` / ``hits`` [SCORE_BINS]: the verified
    non-root draft nodes of active requests per score bin (grafted nodes, with no draft score,
    left out), and those of them accepted; ``active``:
    the number of active requests; ``graft`` (with ``grafted``): the grafted nodes of active
    requests, and those of them on the accepted path.
    """
    D, W, N = max_depth, max_width, capacity
    _check_stats_inputs(cand_scores, tree, accepted, accept_len, active, rates, out, D, W, N,
                        grafted)  # fmt: skip
    B, d, C = cand_scores.shape
    if out.is_cuda and not torch.compiler.is_compiling():  # two launches (kernels/cast_plan.py)
        _kstats.step_stats_launch(
            cand_scores.float().contiguous(), tree, accepted, accept_len, active, rates, out,
            max_depth=D, max_width=W, capacity=N, bins=SCORE_BINS, grafted=grafted,
        )  # fmt: skip
        return
    lay = stats_layout(D, W, N, graft=grafted is not None)
    act = active.to(torch.float32)
    n_act = act.sum().clamp(min=1.0)
    s = cand_scores.float()
    cal = torch.where(s >= 0, rates[score_bin(s)], 0.0)  # [B, d, C]
    out.zero_()
    k = min(W, C)
    top = torch.topk(cal, k, dim=2).values.cumsum(2)  # [B, d, k]
    layers = (top * act.view(B, 1, 1)).sum(0) / n_act  # [d, k]
    if k < W:  # the curve is flat past the candidates that exist
        layers = torch.cat([layers, layers[:, -1:].expand(d, W - k)], 1)
    out[lay["layers"]].view(D, W)[:d].copy_(layers)
    flat = cal.reshape(B, d * C)
    kv = min(N - 1, d * C)
    curve = torch.cat(
        [torch.ones(B, 1, device=s.device), 1.0 + torch.topk(flat, kv, dim=1).values.cumsum(1)], 1
    )  # [B, 1 + kv]
    vc = (curve * act.view(B, 1)).sum(0) / n_act
    if 1 + kv < N:
        vc = torch.cat([vc, vc[-1:].expand(N - 1 - kv)])
    out[lay["verify"]].copy_(vc)
    n = tree.capacity
    node = torch.arange(n, device=s.device).view(1, n)
    ok = (node < tree.num_nodes.view(B, 1)) & active.view(B, 1) & (tree.depth >= 1)
    if grafted is not None:  # grafted nodes have no draft score: not the scores' calibration
        ok = ok & (node < (tree.num_nodes - grafted).view(B, 1))
    # hit[b, j]: node j is on request b's accepted path (entries past accept_len point nowhere)
    on = (node[:, : accepted.shape[1]] < accept_len.view(B, 1)).to(torch.float32)
    hit = torch.zeros(B, n, device=s.device).scatter_add_(1, accepted.long().clamp(min=0), on)
    bins = score_bin(tree.scores).reshape(-1)
    okf = ok.to(torch.float32)
    out[lay["seen"]].scatter_add_(0, bins, okf.reshape(-1))
    out[lay["hits"]].scatter_add_(0, bins, (okf * (hit > 0)).reshape(-1))
    out[lay["active"]].copy_(act.sum().view(1))
    if grafted is not None:  # the tree's last grafted[b] nodes
        first = (tree.num_nodes - grafted)[:, None]
        k = node[:, : accepted.shape[1]]
        g_hit = (accepted >= first) & (k < accept_len.view(B, 1)) & active.view(B, 1)
        added = torch.where(active, grafted, 0).sum()
        torch.stack([added.float(), g_hit.sum().float()], out=out[lay["graft"]])


_PASSED = Memo()


def _check_stats_inputs(cand_scores, tree, accepted, accept_len, active, rates, out, D, W, N,
                        grafted) -> None:  # fmt: skip
    """``cast_step_stats``'s metadata checks (skipped for a signature that passed before): a
    wrong ``out`` length would let the kernels write past it."""
    tensors = (cand_scores, accepted, accept_len, active, rates, out, grafted,
               *(tree.tensors() if isinstance(tree, Tree) else ()))  # fmt: skip
    key = signature(tensors, (D, W, N))
    if _PASSED.get(key) is not None:
        return
    sizes: dict[str, int] = {}
    check_tensor("cand_scores", cand_scores, shape=("B", None, None),
                 dtype=(torch.float32, torch.bfloat16, torch.float16), sizes=sizes)  # fmt: skip
    check_tree(tree, name="tree")
    check_tensor("accepted", accepted, shape=("B", None), dtype=torch.int32, sizes=sizes)
    check_tensor("accept_len", accept_len, shape=("B",), dtype=torch.int32, sizes=sizes)
    check_tensor("active", active, shape=("B",), dtype=torch.bool, sizes=sizes)
    check_tensor("rates", rates, shape=(SCORE_BINS,), dtype=torch.float32)
    if tree.batch_size != sizes["B"]:
        raise ValueError(
            f"Invalid shape of tree: expected batch size {sizes['B']}, got {tree.batch_size}"
        )
    if grafted is not None:
        check_tensor("grafted", grafted, shape=("B",), dtype=torch.int32, sizes=sizes)
    size = stats_size(D, W, N, graft=grafted is not None)
    check_tensor("out", out, shape=(size,), dtype=torch.float32, contiguous=True)
    check_same_device(cand_scores=cand_scores, tree=tree.parents, accepted=accepted,
                      accept_len=accept_len, active=active, rates=rates, out=out,
                      grafted=grafted)  # fmt: skip
    _PASSED.put(key, True)

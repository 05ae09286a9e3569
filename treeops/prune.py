"""Graft's pruning (docs/design.md op 6, step 1): ``PruneCheckpoints`` mark, on the device, the
requests whose best path score is low after a draft step, and ``prune`` keeps the root and the
top ``keep[b]`` draft nodes of each; ``calibrate_thresholds`` fits the checkpoints' thresholds to a
model pair. Each op is a custom op ``torch.ops.treeops.prune`` / ``prune_checkpoint``: one Triton
launch on CUDA (``treeops.kernels.prune``), the reference on CPU (``treeops.reference.graft``).
No host sync unless ``validate=True``; a plain eager call on CUDA replays the launches recorded
for its signature (``treeops.kernels._replay``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ._checks import check_positive_int, check_range, check_same_device, check_tensor, cuda_device
from ._graft_types import NO_PRUNE
from ._library import OUT_TREE, TREE, define
from .graft import _PASSED, _check_out, _check_out_memory, _copy_into, _key, _result_tree, _split
from .kernels import prune as _kp
from .kernels._replay import MISS, Replays
from .reference import graft as _ref
from .tree import Tree, check_tree

__all__ = ["PruneCheckpoints", "calibrate_thresholds", "prune"]


def _prune_cuda(*args):
    tree, keep, keep_int, out = args[:8], args[8], args[9], args[10:]
    with cuda_device(tree[1]):
        _kp.prune(tree, keep, keep_int, out)


def _prune_cpu(*args):
    tree, keep, keep_int, out = Tree(*args[:8]), args[8], args[9], args[10:]
    _copy_into(_ref.prune(tree, keep if keep is not None else keep_int), out)


_prune_op = define(
    f"prune({TREE}, Tensor? keep, int keep_int, {OUT_TREE}) -> ()",
    cpu=_prune_cpu,
    cuda=_prune_cuda,
)


def _checkpoint_cuda(keep, best_score, keep_value, threshold, stop):
    with cuda_device(keep):
        _kp.checkpoint(keep, best_score, keep_value, threshold, stop)


def _checkpoint_cpu(keep, best_score, keep_value, threshold, stop):
    stop.copy_(_ref.prune_checkpoint(keep, best_score, 0, (keep_value,), (threshold,)))


_checkpoint_op = define(
    "prune_checkpoint(Tensor(a!) keep, Tensor best_score, int keep_value, float threshold, "
    "Tensor(b!) stop) -> ()",
    cpu=_checkpoint_cpu,
    cuda=_checkpoint_cuda,
)


_PRUNE_REPLAYS = Replays("prune")
_CHECKPOINT_REPLAYS = Replays("prune_checkpoint")
"""Calls per ``_key`` (``treeops.graft``'s) replayed without the ops' Python layers
(``treeops.kernels._replay``); the checkpoint's keep value and threshold, launched as scalars,
are in its key."""


def prune(
    tree: Tree, keep: torch.Tensor | int, *, out: Tree | None = None, validate: bool = False
) -> Tree:
    """Keep the root and the top ``keep[b]`` draft nodes of each request.

    Nodes are in rank order (draft nodes by path score descending, ``parents[i] < i``), so the
    top ``keep`` by score are the first ``keep`` after the root, and they are ancestor-closed.
    ``keep`` is an int or a [B] int32 tensor; ``NO_PRUNE`` (and anything >= N) keeps all.
    Returns a new ``Tree`` (padding and links past the new ``num_nodes`` cleared), or ``out``
    written: a ``Tree`` of the tree's shape and device, not the tree's memory (an engine's
    step passes one to skip the eight allocations of a fresh tree). No host sync.
    Values are unchecked when ``validate=False`` (a malformed tree is undefined behaviour);
    ``validate=True`` checks the tree and ``keep`` (with a host sync).
    """
    key, tensors = (None, ()) if validate else _key("prune", (tree, out), (keep,), ())
    if _PASSED.get(key) is None:
        check_tree(tree, validate=validate)
        B = tree.batch_size
        if isinstance(keep, torch.Tensor):
            check_tensor("keep", keep, shape=(B,), dtype=torch.int32, unit_last=True)
            check_same_device(tree=tree.parents, keep=keep)
            if validate:
                check_range("keep", keep, 0)
        elif not isinstance(keep, int) or isinstance(keep, bool) or keep < 0:
            raise ValueError(
                f"Invalid value of keep: expected an int >= 0 or a [B] int32 tensor, got {keep!r}"
            )
        _check_out(out, tree)
        _PASSED.put(key, True)
    elif out is not None:
        _check_out_memory(out, tree)
    res = _PRUNE_REPLAYS.run(key, tensors)
    if res is not MISS:
        return res if out is None else out
    result, out = _result_tree(out, tree)
    _PRUNE_REPLAYS.call(
        key, tensors, _prune_op, *tree.tensors(), *_split(keep, 0), *out.tensors(), result=result
    )
    return out


@dataclass
class PruneCheckpoints:
    """Graft's pruning checkpoints: after draft step ``steps[c]`` (step 0 = the first draft
    forward, producing depth-1 candidates), a request whose best path score is under
    ``thresholds[c]`` keeps only its top ``keeps[c]`` draft nodes (the first checkpoint that
    fires decides).

    Usage (both modes of docs/design.md)::

        keep = ckpt.start(B, device)                  # [B] int32, NO_PRUNE
        for step in range(depth):
            ...draft step...                          # best [B]: best path score of the layer
            stop = ckpt.check(step, best, keep)       # updates keep on device
            # single request: copy stop to the host (non-blocking) and stop drafting if set;
            # batched: ignore stop, draft to full depth
        tree = treeops.prune(tree, keep)

    The default thresholds are a starting point; ``calibrate_thresholds`` fits them to a model
    pair from warm-up steps.
    """

    steps: tuple[int, ...] = (0, 1, 5)
    keeps: tuple[int, ...] = (8, 24, 40)
    thresholds: tuple[float, ...] = (0.3, 0.2, 0.05)

    def __post_init__(self) -> None:
        if not len(self.steps) == len(self.keeps) == len(self.thresholds):
            raise ValueError(
                f"Invalid checkpoints: {len(self.steps)} steps, {len(self.keeps)} "
                f"keeps and {len(self.thresholds)} thresholds, expected equal counts"
            )
        if list(self.steps) != sorted(set(self.steps)) or any(s < 0 for s in self.steps):
            raise ValueError(f"Invalid checkpoints: steps {self.steps} must be increasing and >= 0")
        if any(k < 0 for k in self.keeps):
            raise ValueError(f"Invalid checkpoints: keeps {self.keeps} must be >= 0")

    @classmethod
    def for_depth(
        cls,
        max_depth: int,
        keeps: tuple[int, ...] = (8, 24, 40),
        thresholds: tuple[float, ...] = (0.3, 0.2, 0.05),
    ) -> PruneCheckpoints:
        """Checkpoints placed relative to a tree's ``max_depth`` D: after draft steps 0,
        max(1, D // 4) and max(2, D // 2) (duplicates dropped with their keep and threshold),
        so the last one still leaves half the layers to save (the default steps suit D = 6, where
        a checkpoint after step 5 would prune after the last layer was drafted)."""
        check_positive_int("max_depth", max_depth)
        steps, ks, ts = [], [], []
        for s, k, t in zip((0, max(1, max_depth // 4), max(2, max_depth // 2)), keeps, thresholds):
            if s < max_depth and (not steps or s > steps[-1]):
                steps.append(s)
                ks.append(k)
                ts.append(t)
        return cls(tuple(steps), tuple(ks), tuple(ts))

    def start(self, batch_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """A fresh ``keep`` [B] int32, every request unmarked (``NO_PRUNE``)."""
        return torch.full((batch_size,), NO_PRUNE, dtype=torch.int32, device=device)

    def check(self, step: int, best_score: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """After draft step ``step``: mark unmarked requests whose ``best_score`` [B] float32 is
        under this checkpoint's threshold (in place on ``keep`` [B] int32; both unit-stride);
        return ``stop`` [B] bool (a new tensor), whether each request is marked (now or before).
        A step that is no checkpoint only returns ``stop``. One launch on CUDA, no host sync."""
        if step in self.steps:
            c = self.steps.index(step)
            keep_value, threshold = self.keeps[c], float(self.thresholds[c])
        else:  # no checkpoint: a threshold of -inf marks nothing, the launch writes stop
            keep_value, threshold = 0, -math.inf
        # both are launched as scalars: a replay is kept per (shapes, keep value, threshold)
        key, tensors = _key("checkpoint", (), (keep, best_score), (keep_value, threshold))
        if _PASSED.get(key) is None:
            check_tensor("keep", keep, shape=("B",), dtype=torch.int32, unit_last=True)
            check_tensor("best_score", best_score, shape=keep.shape, dtype=torch.float32,
                         unit_last=True)  # fmt: skip
            check_same_device(keep=keep, best_score=best_score)
            _PASSED.put(key, True)
        stop = _CHECKPOINT_REPLAYS.run(key, tensors)
        if stop is not MISS:
            return stop
        stop = torch.empty(keep.shape, dtype=torch.bool, device=keep.device)
        _CHECKPOINT_REPLAYS.call(
            key, tensors, _checkpoint_op, keep, best_score, keep_value, threshold, stop,
            result=stop,
        )  # fmt: skip
        return stop


def calibrate_thresholds(
    best_scores: torch.Tensor,
    accepted_index: torch.Tensor,
    keeps: Sequence[int] = (8, 24, 40),
    max_loss: float = 0.1,
) -> tuple[float, ...]:
    """Fit the checkpoint thresholds from warm-up steps drafted without pruning.

    Args:
        best_scores: [S, C] float, best path score at each of the C checkpoints in S steps.
        accepted_index: [S] int, the largest node index on the accepted path of each step (0 if
            only the bonus token came); pruning to ``keeps[c]`` loses accepted tokens in that
            step iff ``accepted_index > keeps[c]``.
        max_loss: the largest fraction of pruned steps allowed to lose accepted tokens.
    Returns, per checkpoint, the largest threshold t such that of the warm-up steps with score
    < t, at most ``max_loss`` would have lost tokens (0.0 = never prune). Runs on the host.
    """
    s = torch.as_tensor(best_scores, dtype=torch.float64).cpu()
    a = torch.as_tensor(accepted_index).cpu().long()
    if s.dim() != 2 or s.shape[1] != len(keeps):
        raise ValueError(
            f"Invalid shape of best_scores: expected [S, {len(keeps)}], got {list(s.shape)}"
        )
    if a.shape != (s.shape[0],):
        raise ValueError(
            f"Invalid shape of accepted_index: expected [{s.shape[0]}], got {list(a.shape)}"
        )
    if not 0.0 <= max_loss <= 1.0:
        raise ValueError(f"Invalid value of max_loss: expected a number in [0, 1], got {max_loss}")
    out = []
    for c, kc in enumerate(keeps):
        order = torch.argsort(s[:, c], stable=True)
        sc = s[order, c].tolist()
        lost = (a[order] > kc).tolist()
        best, n_lost = 0.0, 0
        for i in range(len(sc)):
            # candidate threshold: just above sc[i], i.e. steps 0..i (all with score <= sc[i])
            n_lost += lost[i]
            if i + 1 < len(sc) and sc[i + 1] == sc[i]:
                continue
            if n_lost <= max_loss * (i + 1):
                best = math.nextafter(sc[i], math.inf)
        out.append(float(best))
    return tuple(out)

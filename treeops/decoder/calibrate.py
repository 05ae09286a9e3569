"""Graft's pruning thresholds fitted to a model pair (``calibrate_checkpoints``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import torch

from ..prune import PruneCheckpoints, calibrate_thresholds
from .engine import Decoder
from .model import Draft, Target
from .policies import CastGraft

__all__ = ["calibrate_checkpoints"]


def calibrate_checkpoints(
    target: Target,
    draft: Draft,
    policy: CastGraft,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    max_loss: float = 0.1,
    page_size: int = 16,
) -> PruneCheckpoints:
    """``policy``'s checkpoints with thresholds fitted on this pair: decodes ``prompts`` greedily
    with ``policy`` (thresholded CAST + Graft) on the eager path and nothing pruned, recording per
    step and active request the best path score at each checkpoint (where drafting reached it)
    and the largest node index on the accepted path; then each checkpoint's threshold is
    ``calibrate_thresholds`` over the steps that reached it: the largest under which at most
    ``max_loss`` of the pruned steps would have lost accepted tokens (0.0: never prune). The
    checkpoints' steps and keeps are kept. Host syncs every step: a warm-up, not a hot path.
    A policy that is not a ``CastGraft`` with thresholds is a ``ValueError``."""
    if not isinstance(policy, CastGraft):
        raise ValueError(f"Invalid type of policy: expected CastGraft, got {type(policy).__name__}")
    if policy.cast.C3 is None:
        raise ValueError(
            "Invalid value of policy: expected CastGraft over a thresholded Cast (λ-CAST prunes "
            "by plan, not at checkpoints)"
        )
    ck = policy.checkpoints
    open_ck = replace(ck, thresholds=tuple(-math.inf for _ in ck.steps))  # nothing pruned
    dec = Decoder(target, draft, replace(policy, checkpoints=open_ck), page_size=page_size)
    dec.checkpoint_log = []
    dec.generate([list(p) for p in prompts], max_new_tokens)
    if not dec.checkpoint_log:
        raise ValueError("Invalid value of prompts: expected at least one decoding step")
    best = torch.cat([b for b, _ in dec.checkpoint_log])
    last = torch.cat([a for _, a in dec.checkpoint_log])
    out = []
    for c, keep in enumerate(ck.keeps):
        reached = ~torch.isnan(best[:, c])
        if not bool(reached.any()):
            out.append(0.0)
            continue
        (t,) = calibrate_thresholds(best[reached, c : c + 1], last[reached], (keep,), max_loss)
        out.append(t)
    return replace(ck, thresholds=tuple(out))

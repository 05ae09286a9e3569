"""bench_e2e's correctness check: each request's first divergence from the autoregressive
output, classified with the fp32 target's logits at that position — a near-tie when the two
tokens' logits differ by less than ``NEAR_TIE_REL`` of the row's standard deviation (bf16
rounding can flip those), else a mismatch (a lossless decoder has none)."""

from __future__ import annotations

import copy

import torch

from treeops.decoder import Target
from treeops.decoder.model import reference_forward

NEAR_TIE_REL = 0.05  # near-tie: |l[a] - l[p]| < NEAR_TIE_REL * std(logits row)
MAX_DIVERGENCES_CHECKED = 48  # per row: fp32 reference forwards are cheap but not free


def ref_logits(ref32: Target, ctx: torch.Tensor) -> torch.Tensor:
    """fp32 logits [V] after ``ctx``: the model's causal training forward (PyTorch SDPA, no
    treeops) where the model has one, else ``reference_forward`` on the CPU."""
    if hasattr(ref32, "forward_train"):
        return ref32.forward_train(ctx[None])[0][0, -1].float()
    cpu = copy.deepcopy(ref32).cpu()
    return reference_forward(cpu, ctx.cpu())[-1].float()


@torch.no_grad()
def divergences(ref32: Target, prompts, ar_tokens, pol_tokens, limit: int) -> dict:
    """First divergence of each request from the autoregressive output, classified with the
    fp32 target's logits at that position (module docstring)."""
    near, mismatch, unchecked, details = 0, 0, 0, []
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        for b, (a, p) in enumerate(zip(ar_tokens, pol_tokens)):
            k = next((i for i, (x, y) in enumerate(zip(a, p)) if x != y), None)
            if k is None:
                if len(a) != len(p):
                    mismatch += 1  # one stopped early: not a tie question
                    details.append({"request": b, "kind": "length", "ar": len(a), "pol": len(p)})
                continue
            if near + mismatch >= limit:
                unchecked += 1
                continue
            dev = ref32.model.embed_tokens.weight.device
            ctx = torch.tensor(list(prompts[b]) + list(a[:k]), device=dev)
            row = ref_logits(ref32, ctx)
            top2 = torch.topk(row, 2).values
            gap = abs(float(row[a[k]] - row[p[k]]))
            scale = float(row.std())
            tie = gap < NEAR_TIE_REL * scale
            near += int(tie)
            mismatch += int(not tie)
            details.append({
                "request": b, "position": k, "ar_token": a[k], "policy_token": p[k],
                "gap": round(gap, 5), "top2_gap": round(float(top2[0] - top2[1]), 5),
                "scale": round(scale, 4), "near_tie": bool(tie),
            })  # fmt: skip
    finally:
        torch.set_float32_matmul_precision(prev)
    return {
        "requests": len(ar_tokens),
        "diverged": near + mismatch + unchecked,
        "near_tie": near,
        "mismatch": mismatch,
        "unchecked": unchecked,
        "details": details[:8],
    }

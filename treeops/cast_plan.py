"""λ-CAST (docs/design.md op 5, "λ-CAST"): the tree's sizes from the throughput objective.

A decoding step drafts ``depth`` layers with a frontier of ``width`` rows (``topk`` children
each) and verifies the ``verify`` best nodes; its tokens per second are
``η = A / τ``, ``A`` = expected emitted tokens per request (1 + the acceptance probabilities of
the verified nodes), ``τ`` = the step's time. By Dinkelbach's argument the plan maximising ``η``
maximises ``A − λτ`` at ``λ = η*``, which splits into marginal rules (all costs in units of
``S_T(B, 1)``, the target's one-token forward at this batch size):

* verify the ``k``-th best candidate iff its probability ≥ λ × the verify time it adds
  (Algorithm 1 on the batch-mean curve of 1 + the k − 1 best probabilities, threshold λ, costs
  ``S_T(B, bucket(k)) / S_T(B, 1)``: the verification forward runs at its bucket);
* draft frontier row ``k`` iff what it adds, net of the verify time its nodes bring
  (``p_k − λ Δ_T``), is ≥ λ × its draft time (Algorithm 1 on the layer's curve minus
  ``λ k Δ_T``, threshold λ, costs ``(S_D(B, bucket(k)) + o_layer) / S_T(B, 1)``);
* draft layer ``i`` iff its tokens (the mass of its ``width`` best candidates; beyond the drafted
  depth predicted with CAST's FIFO of layer ratios), net of their verify time, are ≥ λ × its
  draft time.

``λ̂`` is kept online per batch size: emitted tokens per active request per step ÷ the measured
step time in ``S_T(B, 1)`` units (an exponential average); the draft's path scores are
calibrated online into acceptance probabilities per depth (accepted nodes ÷ summed scores of the
verified nodes at that depth). ``CastPlanner`` holds that state on the host; the device computes
each step's curves and calibration counts with ``cast_step_stats`` (torch ops, no host sync,
capturable) and the host reads them with the step's results: no extra wait.

The plan changes between steps only (an exponential average of the rules' choices, rounded to
the buckets the engine has graphs for), so a step runs as a fixed-shape graph: the plan's
``EagleStatic(depth, topk, verify, width)`` tree (``CastPlanner.policy``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ._checks import check_positive_int
from .build_tree import Cast, EagleStatic
from .tree import Tree

__all__ = ["Plan", "CastPlanner", "cast_step_stats", "stats_size", "lambda_rules"]


@dataclass(frozen=True, order=True)
class Plan:
    """A step's sizes: ``width`` frontier rows per draft layer after the first, ``depth`` draft
    layers, ``verify`` nodes sent to verification (root included)."""

    width: int
    depth: int
    verify: int


def stats_size(max_depth: int, max_width: int, capacity: int) -> int:
    """Length of ``cast_step_stats``'s output for a policy's maxima D, W, N:
    ``D * W + N + 2 * (D + 1) + 1``."""
    return max_depth * max_width + capacity + 2 * (max_depth + 1) + 1


def _layout(D: int, W: int, N: int) -> dict[str, slice]:
    o = 0
    out = {}
    for name, n in (("layers", D * W), ("verify", N), ("scores", D + 1), ("accepted", D + 1),
                    ("active", 1)):  # fmt: skip
        out[name] = slice(o, o + n)
        o += n
    return out


def cast_step_stats(
    cand_scores: torch.Tensor,
    tree: Tree,
    accept_len: torch.Tensor,
    active: torch.Tensor,
    gains: torch.Tensor,
    out: torch.Tensor,
    *,
    max_width: int,
    capacity: int,
) -> None:
    """One step's statistics for the planner, written into ``out`` (float32, length
    ``stats_size(D, max_width, capacity)``, D = ``gains.numel() - 1``); torch ops only, no host
    sync, capturable.

    Args:
        cand_scores: [B, d, C] float32, the step's candidate path scores (``DraftState``; < 0 = no
            candidate), d <= D drafted layers.
        tree: the verified tree (its ``scores``, ``depth``, ``num_nodes``).
        accept_len: [B] int32, accepted nodes with the root (``accept_*``).
        active: [B] bool.
        gains: [D + 1] float32, the calibration factor per depth (``CastPlanner.gains``): a
            candidate at depth t (layer t - 1) of raw score s has probability ``min(g[t] s, 1)``.

    Layout (``_layout``): ``layers`` [D, W]: row i = batch mean over active requests of the
    cumulative sum of layer i's k best calibrated probabilities, k = 1..W (rows >= d zero);
    ``verify`` [N]: batch mean of 1 + the k - 1 best calibrated probabilities of the step;
    ``scores`` [D + 1]: summed raw scores of the verified nodes per depth (active requests);
    ``accepted`` [D + 1]: accepted nodes per depth; ``active``: the number of active requests.
    """
    B, d, C = cand_scores.shape
    D = gains.numel() - 1
    W, N = max_width, capacity
    lay = _layout(D, W, N)
    act = active.to(torch.float32)
    n_act = act.sum().clamp(min=1.0)
    s = cand_scores.float()
    cal = torch.where(s >= 0, (s * gains[1 : d + 1].view(1, d, 1)).clamp(max=1.0), 0.0)
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
    dep = tree.depth.clamp(max=D).long()
    out[lay["scores"]].scatter_add_(0, dep.reshape(-1), torch.where(ok, tree.scores, 0.0).reshape(-1))
    depth = torch.arange(D + 1, device=s.device).view(1, -1)
    # depth t >= 1 holds an accepted node iff accept_len - 1 >= t (the root is depth 0)
    reach = ((accept_len.view(B, 1).long() - 1) >= depth) & (depth >= 1) & active.view(B, 1)
    out[lay["accepted"]].copy_(reach.to(torch.float32).sum(0))
    out[lay["active"]].copy_(act.sum().view(1))


def _select(u: np.ndarray, c: np.ndarray, lam: float) -> int:
    """Algorithm 1: the largest k (1-based) maximising ``u_k - lam * c_k``."""
    obj = u - lam * c
    best = obj.max()
    return int(np.flatnonzero(obj >= best - 1e-12 * max(1.0, abs(best)))[-1]) + 1


def lambda_rules(
    layers: np.ndarray,
    verify: np.ndarray,
    drafted: int,
    lam: float,
    target_cost: np.ndarray,
    draft_cost: np.ndarray,
    R: int = 4,
    max_depth: int | None = None,
) -> Plan:
    """The λ rules on one step's curves (float64 host arrays; costs in ``S_T(B, 1)`` units,
    already at the buckets that run and with the per-layer overhead in ``draft_cost``).

    Args:
        layers: [D, W], layer i's batch-mean cumulative calibrated probabilities (rows past
            ``drafted`` ignored).
        verify: [N], the batch-mean verify curve (1 + the k - 1 best probabilities).
        drafted: layers drafted this step (>= 1).
        lam: λ.
        target_cost: [N], the verification forward's cost at k nodes.
        draft_cost: [W], a draft layer's cost at k frontier rows.
        R: CAST's FIFO length (the layer-ratio average that predicts the next layer).
        max_depth: the most layers (default D).

    Returns the rules' ``Plan`` (unrounded choices; the planner rounds them to buckets).
    """
    D, W = layers.shape
    N = verify.shape[0]
    max_depth = D if max_depth is None else max_depth
    n = _select(verify, target_cost, lam)
    m = max(n, 2)
    dT = (target_cost[m - 1] - target_cost[0]) / (m - 1)  # verify time per node at this size
    ks = np.arange(1, W + 1)
    widths = [_select(layers[i] - lam * ks * dT, draft_cost, lam) for i in range(drafted)]
    w = max(widths)
    u = [float(layers[i, w - 1]) for i in range(drafted)]
    ratios = [1.0] + [u[j + 1] / u[j] if u[j] > 0 else 0.0 for j in range(drafted - 1)]
    alpha = float(np.mean(ratios[-R:]))
    depth = 1
    while depth < max_depth:
        mass = u[depth] if depth < drafted else alpha * u[-1]
        if mass - lam * w * dT < lam * draft_cost[w - 1]:
            break
        depth += 1
        if depth > drafted:  # one layer past the drafted depth per step, at most
            break
    return Plan(width=w, depth=depth, verify=min(n, N))


def _round_up(x: float, buckets: Sequence[int]) -> int:
    for b in buckets:
        if b >= x - 1e-9:
            return b
    return buckets[-1]


@dataclass
class _BatchState:
    lam: float
    plan: Plan
    ema: list[float]
    acc: np.ndarray
    score: np.ndarray
    steps: int = 0
    history: list = field(default_factory=list)


class CastPlanner:
    """λ-CAST's host side: per batch size, λ̂, the calibration gains and the current ``Plan``.

    Args:
        policy: a λ-CAST ``treeops.Cast`` (its ``cost_table``, ``topk`` K, ``max_width`` W,
            ``max_depth`` D, ``capacity`` N, FIFO length ``R``).
        width_buckets: frontier sizes the engine runs (default the powers of two below W, and
            W).
        verify_buckets: verification sizes the engine runs (default 1, 2, 4, 8, 16, 32, 48, 64,
            96, ... below N, and N).
        layer_overhead_us: the measured time of a draft layer's tree ops besides the draft
            forward (``build_tree_expand`` and the frontier's inputs), per batch size B: a
            callable ``B -> µs`` or a constant.
        smoothing: weight of the previous choice in the exponential average of the rules'
            choices (0 = follow each step's rules).
        lam_smoothing: the same for λ̂.
        prior: pseudo-count of the calibration's prior (gain 1, the path score taken as the
            acceptance probability).
        initial: the first plan (default: width min(2, W), depth min(4, D), verify 8).

    Per step: ``plan(B)`` (the shape to run), ``gains(B)`` (to upload for ``cast_step_stats``),
    then ``observe(B, stats, plan, tokens, step_s, ctx)`` with the step's statistics.
    """

    def __init__(
        self,
        policy: Cast,
        *,
        width_buckets: Sequence[int] | None = None,
        verify_buckets: Sequence[int] | None = None,
        layer_overhead_us: Callable[[int], float] | float = 0.0,
        smoothing: float = 0.75,
        lam_smoothing: float = 0.9,
        prior: float = 8.0,
        initial: Plan | None = None,
    ):
        if not isinstance(policy, Cast):
            raise ValueError(
                f"Invalid type of policy: expected treeops.Cast, got {type(policy).__name__}"
            )
        self.policy = policy
        self.K, self.W, self.D, self.N = (
            policy.topk, policy.max_width, policy.max_depth, policy.capacity
        )  # fmt: skip
        self.widths = sorted(
            set(width_buckets or [b for b in (1, 2, 4, 8, 16, 32) if b < self.W] + [self.W])
        )
        self.verify_sizes = sorted(
            set(
                verify_buckets
                or [b for b in (1, 2, 4, 8, 16, 32, 48, 64, 96, 128) if b < self.N] + [self.N]
            )
        )
        for name, bs, top in (("width_buckets", self.widths, self.W),
                              ("verify_buckets", self.verify_sizes, self.N)):  # fmt: skip
            if bs[0] < 1 or bs[-1] != top:
                raise ValueError(
                    f"Invalid value of {name}: expected positive sizes ending at {top}, got {bs}"
                )
        self.layer_overhead_us = layer_overhead_us
        for name, v in (("smoothing", smoothing), ("lam_smoothing", lam_smoothing)):
            if not 0.0 <= v < 1.0:
                raise ValueError(f"Invalid value of {name}: expected 0 <= x < 1, got {v!r}")
        self.smoothing, self.lam_smoothing = smoothing, lam_smoothing
        if prior <= 0:
            raise ValueError(f"Invalid value of prior: expected > 0, got {prior!r}")
        self.prior = prior
        self.initial = initial or self._rounded(min(2, self.W), min(4, self.D), 8)
        self._batch: dict[int, _BatchState] = {}
        self.layout = _layout(self.D, self.W, self.N)
        self.size = stats_size(self.D, self.W, self.N)

    # ------------------------------------------------------------------ state
    def _state(self, B: int) -> _BatchState:
        st = self._batch.get(B)
        if st is None:
            p = self.initial
            st = _BatchState(
                lam=1.0, plan=p, ema=[float(p.width), float(p.depth), float(p.verify)],
                acc=np.zeros(self.D + 1), score=np.zeros(self.D + 1),
            )  # fmt: skip
            self._batch[B] = st
        return st

    def plan(self, B: int) -> Plan:
        """The plan for the next step at batch size ``B``."""
        check_positive_int("B", B)
        return self._state(B).plan

    def lam(self, B: int) -> float:
        """λ̂ at batch size ``B`` (1 before any step: autoregressive decoding's throughput)."""
        return self._state(B).lam

    def gains(self, B: int) -> list[float]:
        """[D + 1] calibration factors per depth (index 0 unused): accepted nodes ÷ summed raw
        scores of the verified nodes at that depth, with ``prior`` pseudo-nodes of gain 1."""
        st = self._state(B)
        g = (st.acc + self.prior) / (st.score + self.prior)
        g[0] = 1.0
        return np.clip(g, 0.05, 4.0).tolist()

    def policy_for(self, plan: Plan) -> EagleStatic:
        """The fixed-shape tree a step of ``plan`` drafts: ``EagleStatic(depth, topk=K,
        budget=verify, width=width)``."""
        return EagleStatic(depth=plan.depth, topk=self.K, budget=plan.verify, width=plan.width)

    def costs(self, B: int, ctx: int) -> tuple[np.ndarray, np.ndarray, float]:
        """(target [N], draft [W] in ``S_T(B, 1)`` units at the buckets that run, the draft
        layer's overhead included; ``S_T(B, 1)`` in µs) at batch ``B`` and context ``ctx``."""
        t = self.policy.cost_table
        ST = t.S_T(B, ctx).numpy()
        SD = t.S_D(B, ctx).numpy()
        unit = float(ST[0])
        ov = self.layer_overhead_us
        ov = float(ov(B) if callable(ov) else ov)
        tgt = np.array([ST[_round_up(k, self.verify_sizes) - 1] for k in range(1, self.N + 1)])
        dft = np.array([SD[_round_up(k, self.widths) - 1] + ov for k in range(1, self.W + 1)])
        return tgt / unit, dft / unit, unit

    # ---------------------------------------------------------------- observe
    def observe(
        self, B: int, stats: Sequence[float], plan: Plan, tokens: float, step_s: float, ctx: int
    ) -> Plan:
        """Take one step's results: ``stats`` (``cast_step_stats``'s output, read on the host),
        the ``plan`` it ran, ``tokens`` emitted per active request, its measured time
        ``step_s`` (seconds), the batch's context ``ctx`` (tokens). Updates λ̂, the calibration
        and the next plan; returns it."""
        st = self._state(B)
        x = np.asarray(stats, dtype=np.float64)
        lay = self.layout
        if x[lay["active"]][0] < 1:  # no active request: nothing learnt
            return st.plan
        target_cost, draft_cost, unit_us = self.costs(B, ctx)
        if step_s > 0 and tokens > 0:
            eta = tokens / (step_s * 1e6 / unit_us)
            a = self.lam_smoothing if st.steps else 0.0
            st.lam = a * st.lam + (1 - a) * eta
        decay = 0.98
        st.acc = decay * st.acc + x[lay["accepted"]]
        st.score = decay * st.score + x[lay["scores"]]
        layers = x[lay["layers"]].reshape(self.D, self.W)
        raw = lambda_rules(
            layers, x[lay["verify"]], plan.depth, st.lam, target_cost, draft_cost,
            R=self.policy.R, max_depth=self.D,
        )  # fmt: skip
        s = self.smoothing if st.steps else 0.0
        st.ema = [s * e + (1 - s) * v for e, v in zip(st.ema, (raw.width, raw.depth, raw.verify))]
        st.plan = self._rounded(*st.ema)
        st.steps += 1
        return st.plan

    def _rounded(self, w: float, d: float, n: float) -> Plan:
        width = _round_up(min(max(w, 1.0), self.W), self.widths)
        depth = int(min(max(round(d), 1), self.D))
        # the tree holds at most 1 + K + (depth - 1) * width * K nodes
        most = 1 + self.K + (depth - 1) * width * self.K
        verify = _round_up(min(max(n, 1.0), self.N, most), self.verify_sizes)
        return Plan(width=width, depth=depth, verify=verify)

    def describe(self, B: int) -> dict:
        """λ̂, the plan and the gains at batch size ``B`` (for results and logs)."""
        st = self._state(B)
        return {
            "lambda": round(st.lam, 4),
            "plan": [st.plan.width, st.plan.depth, st.plan.verify],
            "gains": [round(g, 3) for g in self.gains(B)],
            "steps": st.steps,
        }

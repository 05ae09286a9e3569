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
calibrated online into acceptance probabilities per score bin (the verified nodes of each bin
and how many of them were accepted). ``CastPlanner`` holds that state on the host; the device
computes each step's curves and calibration counts with ``cast_step_stats`` (torch ops, no host
sync, capturable) and the host reads them with the step's results: no extra wait.

The plan changes between steps only: every ``interval`` steps the rules run on the curves averaged
over those steps and each size moves at most one bucket (of the sizes the engine has graphs for)
towards their choice; so a step runs as a fixed-shape graph, the plan's
``EagleStatic(depth, topk, verify, width)`` tree (``CastPlanner.policy_for``), and plans change
rarely.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from statistics import median

import numpy as np

from ._checks import check_positive_int
from .build_tree import Cast, EagleStatic
from .cast_stats import SCORE_BINS, bin_prior, cast_step_stats, score_bin, stats_layout, stats_size

__all__ = [
    "Plan",
    "CastPlanner",
    "cast_step_stats",
    "stats_size",
    "lambda_rules",
    "SCORE_BINS",
    "score_bin",
]


@dataclass(frozen=True, order=True)
class Plan:
    """A step's sizes: ``width`` frontier rows per draft layer after the first, ``depth`` draft
    layers, ``verify`` nodes sent to verification (root included), ``graft`` of them retrieved
    from Graft's successor table (λ-CAST with grafting), ``topk`` children per frontier row (0:
    the policy's K; 1 with width 1 and verify depth + 1: a chain, ``Plan.chain(depth)``)."""

    width: int
    depth: int
    verify: int
    graft: int = 0  # of the verified nodes, how many Graft's successor table fills (the rest
    # are the draft tree's best ``verify - graft``)
    topk: int = 0

    @staticmethod
    def chain(depth: int) -> Plan:
        """A chain of ``depth`` drafted tokens: top-1 at every layer, all ``depth + 1`` nodes
        verified."""
        return Plan(width=1, depth=depth, verify=depth + 1, topk=1)

    @property
    def is_chain(self) -> bool:
        return self.topk == 1


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
    catchup_cost: np.ndarray | None = None,
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
        catchup_cost: [D + 1], the next step's catch-up forward at depth d (it carries up to
            d + 1 accepted tokens into the draft): a layer more also costs
            ``catchup_cost[d + 1] - catchup_cost[d]`` (default none).

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
    catch = np.zeros(max_depth + 2) if catchup_cost is None else catchup_cost
    depth = 1
    while depth < max_depth:
        mass = u[depth] if depth < drafted else alpha * u[-1]
        layer = draft_cost[w - 1] + catch[depth + 1] - catch[depth]
        if mass - lam * w * dT < lam * layer:
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
    seen: np.ndarray  # decayed verified nodes per score bin
    hits: np.ndarray  # decayed accepted nodes per score bin
    layers: np.ndarray  # the window's summed layer curves [D, W]
    verify: np.ndarray  # the window's summed verify curves [N]
    steps: int = 0
    timed: int = 0  # steps that updated λ̂ (the first sets it)
    window: int = 0  # steps in the current window (all of them ran ``plan``)
    rates_version: int = 0
    votes: tuple = (0, 0, 0)  # the last decision's direction per size (width, depth, verify)
    # per plan run: [steps timed (capped), mean of measured - modelled step time in µs]
    residuals: dict = field(default_factory=dict)
    # per plan run: [steps timed (capped), mean and mean square of the step's measured η (tokens
    # per S_T(B, 1) of time, as λ̂), the step count when last run]
    measured: dict = field(default_factory=dict)
    allowed: frozenset | None = None  # the plans it may move to (None: any)
    recent: dict = field(default_factory=dict)  # per plan (None: any plan): last timed steps (s)
    decisions: int = 0
    home: Plan | None = None  # while a probe runs: the plan it returns to unless it wins
    probe: Plan | None = None  # while a probe runs: the plan it measures against ``home``
    # while a probe runs: per plan (``home``, ``probe``), [steps timed, mean η, mean square η]
    # over the probe's steps only, the two plans alternating step by step
    pair: dict = field(default_factory=dict)
    probe_windows: int = 0
    last_tree: Plan | None = None  # the last top-K plan run (where a chain's probe goes back)
    chain_depth: int = 0  # the chain depth the last tree window's curves favour (0: none yet)
    backoff: int = 1  # probes wait this many times longer after each that lost (up to 8)
    last_probe: int = 0  # the decision at which the last probe started
    settled: int = 0  # decisions in a row that kept the tree's plan
    grafted: float = 0.0  # decayed grafted nodes verified (active requests)
    graft_hits: float = 0.0  # decayed grafted nodes accepted
    probe_log: list = field(default_factory=list)  # the last probes' outcomes (``describe``)


COST_PRIOR_US = (1e6, 200.0, 20.0, 50.0)
"""Prior standard deviations (µs) of the learnt step-time corrections a (the step's fixed part),
b (per draft layer), c (per verified node), e (per frontier row beyond the first, per layer)."""
STEP_NOISE_US = 200.0
"""Assumed standard deviation of one step's measured time (µs): sets how many steps of data
outweigh the prior."""
RESIDUAL_CAP = 64
"""Steps a plan's mean residual weighs at most (older steps do not outvote the recent)."""
MEASURED_CAP = 256
"""Steps a plan's measured η weighs at most. More than the residual's: a step's tokens are far
noisier than its time (at B = 1 one request's accept length, about ±35 %), and telling plans a few
percent apart takes a few hundred steps there."""
MEASURED_MIN_STEPS = 8
"""Timed steps of a plan before its measured η may overrule the rules (one window)."""
MEASURED_MAX_AGE = 1024
"""Steps after which a plan's measured η, not refreshed, no longer counts (contexts and the
calibration have moved on)."""
GRAFT_PRIOR = (4.0, 0.05)
"""Pseudo-count and acceptance probability of a grafted node before any was verified."""
GRAFT_DECAY = 0.98
"""Per-step decay of the grafted nodes' verified and accepted counts."""
STALL_FACTOR = 4.0
"""A step measured at more than this many times its plan's typical step (the median of its last
STALL_WINDOW timed steps; for a plan with fewer than half that many, of the batch size's last
STALL_WINDOW timed steps of any plan) is a stall (a compile, a host hiccup, work queued in its
period), not the plan's cost: λ̂, the residuals and the measured η leave it out. Relative to
measured steps where there are some (the cost table may come from another machine; any two
plans' steps differ by less than this factor: a 60-node tree's step is under 2x a chain's at
B = 64); a batch size's first STALL_WINDOW / 2 timed steps, with none to be judged by, are
judged by the table's time of their plan (and enter the medians either way)."""
STALL_WINDOW = 8
MEASURED_Z = 2.0
"""Standard errors by which one plan's measured η must beat another's to overrule the rules."""
PROBE_EVERY = 8
"""Decisions between probes: a plan outside the rules' reach (a chain next to a tree, a tree or
a neighbouring depth next to a chain) runs until measured, then the better one stays."""
PROBE_AGE = 512
"""Steps after which a probed plan's measured η is stale and it may be probed again."""
PROBE_BACKOFF_MAX = 8
"""Each probe that loses doubles the wait before the next (``PROBE_EVERY`` decisions and
``PROBE_AGE`` steps), up to this factor; one that wins resets it: where chains lose (small
batches) they cost few steps, where they win the search stays quick."""
PROBE_SETTLE = 3
"""Decisions in a row that keep a tree's plan before a chain is probed next to it: the chain is
compared with the tree the rules settled on, not with one still growing (at a small batch the
rules grow a tree over many decisions, and a chain measured beside a half-grown one can win
and stop the growth: the rules do not run on a chain)."""
PROBE_SETTLE_WAIT = 4
"""A tree that never settles (the rules oscillating between neighbours) still gets its chain
probe, after this many times the usual wait."""
PROBE_LOG = 64
"""Probe outcomes kept per batch size for ``describe`` (why a run sat where it did)."""
PROBE_MAX_WINDOWS = 3
"""Windows a probe runs at most waiting for ``MEASURED_MIN_STEPS`` timed steps of each plan (a
step that captured a graph is no measure)."""
PROBE_EXTEND_WINDOWS = 32
"""Windows a probe runs at most while neither it nor the plan it left beats the other by
``MEASURED_Z`` standard errors (at a small batch, where a step's tokens are noisy, one window
never decides between neighbouring plans; a plan clearly worse is left at once). Still undecided
at the end, the probe is kept if it measures the higher.

A probe is a paired comparison: its plan and the plan it left alternate step by step (a window
is ``2 * interval`` steps, half of each) and only those steps are compared. Measurements taken
at other times are not comparable: the batch's contexts, its mix of new and old requests and
the calibration move during a run, and at B = 32 on the H200 a chain measured in a 16-step
probe read 16 % below the tree it was probed next to, against 1 % above it when both ran side
by side in the timed run."""


def _features(plan: Plan) -> np.ndarray:
    d = plan.depth - 1
    return np.array([1.0, d, plan.verify - 1.0, (plan.width - 1.0) * d])


class CastPlanner:
    """λ-CAST's host side: per batch size, λ̂, the calibration and the current ``Plan``.

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
        interval: steps per decision: the rules run on the curves averaged over the last
            ``interval`` steps (all of the current plan), and each decision moves every size at
            most one bucket towards the rules' choice, so plans (one CUDA graph each) change
            rarely and a noisy step cannot swing them.
        lam_smoothing: weight of the previous λ̂ in its exponential average (per step).
        prior: pseudo-count of the calibration's prior per score bin (the bin's score taken as
            the acceptance probability).
        initial: the first plan (default: width min(2, W), depth min(4, D), verify 8), rounded
            up to the buckets.
        learn_costs: correct the table's step model with the measured step times (below).
        chain_probes: also measure chains (``Plan.chain(d)``, top-1: the cheapest draft there
            is): every ``PROBE_EVERY`` decisions a chain (next to a tree: at the best measured
            chain depth, else the tree's depth; next to a chain: one layer shallower or deeper,
            the tree halfway to the last tree, and that tree) whose measured η is missing or
            stale is probed: it and the
            current plan alternate step by step until one beats the other by ``MEASURED_Z``
            standard errors over those steps (``PROBE_EXTEND_WINDOWS``), and the winner stays.
            The rules size trees; on a chain they do not run (its statistics hold no siblings),
            probes move it. Needs ``learn_costs``.
        graft_sizes: with Graft: the numbers of verified nodes the successor table may fill
            (0 among them added). A plan's ``graft`` g replaces the draft's g lowest-ranked
            verified nodes with retrieved ones: each decision picks the g of these sizes (at
            most half the verify count) that maximises ``q g`` minus the replaced ranks'
            calibrated mass, q being the measured acceptance of grafted nodes (decayed counts
            and a prior, ``GRAFT_PRIOR``), and moves one size towards it. The statistics then
            end with two more entries (grafted nodes verified, and accepted, over the active
            requests): ``cast_step_stats`` with its ``grafted`` input.

    Costs that run. The step the rules price is the verification forward at its bucket, the
    draft's root layer and ``depth - 1`` layers of ``width`` rows (each with
    ``layer_overhead_us``) and the next step's catch-up forward at ``bucket(depth + 1)`` rows.
    What the table does not see (kernels between the forwards, the host's share of a step,
    shapes its grid interpolates) shows in the measured step times: the planner keeps, per plan
    it ran, the mean of measured minus modelled time, and fits it per batch size as
    ``a + b (depth - 1) + c (verify - 1) + e (width - 1)(depth - 1)`` µs (a Gaussian prior
    around 0, ``COST_PRIOR_US``, flat on a; a plan's steps weigh up to ``RESIDUAL_CAP``). The
    rules add ``b + e (k - 1)`` to a layer of ``k`` rows and ``c`` per verified node; ``a``
    (the step's fixed part) changes no decision.

    Per step: ``plan(B)`` (the shape to run), ``rates(B)`` (to upload for ``cast_step_stats``
    when ``rates_version(B)`` changed), then ``observe(B, stats, plan, tokens, step_s, ctx)``
    with the step's statistics.
    """

    def __init__(
        self,
        policy: Cast,
        *,
        width_buckets: Sequence[int] | None = None,
        verify_buckets: Sequence[int] | None = None,
        layer_overhead_us: Callable[[int], float] | float = 0.0,
        interval: int = 8,
        lam_smoothing: float = 0.9,
        prior: float = 8.0,
        initial: Plan | None = None,
        learn_costs: bool = True,
        chain_probes: bool = True,
        graft_sizes: Sequence[int] | None = None,
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
        check_positive_int("interval", interval)
        if not 0.0 <= lam_smoothing < 1.0:
            raise ValueError(
                f"Invalid value of lam_smoothing: expected 0 <= x < 1, got {lam_smoothing!r}"
            )
        self.interval, self.lam_smoothing = interval, lam_smoothing
        if prior <= 0:
            raise ValueError(f"Invalid value of prior: expected > 0, got {prior!r}")
        self.prior = prior
        self.learn_costs = learn_costs
        self.chain_probes = chain_probes and learn_costs
        self.graft_sizes = sorted({0, *(int(g) for g in graft_sizes)}) if graft_sizes else []
        if self.graft_sizes and self.graft_sizes[-1] >= self.N:
            raise ValueError(
                f"Invalid value of graft_sizes: expected sizes below the capacity {self.N}, "
                f"got {list(graft_sizes or [])}"
            )
        p = initial or Plan(width=min(2, self.W), depth=min(4, self.D), verify=8)
        self.initial = self._rounded(p.width, p.depth, p.verify)
        if self.graft_sizes:  # start grafting a little: its acceptance is measured from there
            first = self.graft_sizes[1] if len(self.graft_sizes) > 1 else 0
            g = initial.graft if initial is not None else first
            self.initial = replace(self.initial, graft=min(g, self.initial.verify // 2))
        self._batch: dict[int, _BatchState] = {}
        # per batch size and context bucket: (target, draft, unit) and the catch-up costs
        self._costs: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, float]] = {}
        self._catchup: dict[tuple[int, int], np.ndarray] = {}
        # cast_step_stats's entries (with Graft: its grafted nodes verified and accepted too)
        graft = bool(self.graft_sizes)
        self.layout = stats_layout(self.D, self.W, self.N, graft=graft)
        self.size = stats_size(self.D, self.W, self.N, graft=graft)

    # ------------------------------------------------------------------ state
    def _state(self, B: int) -> _BatchState:
        st = self._batch.get(B)
        if st is None:
            p = self.initial
            st = _BatchState(
                lam=1.0, plan=p, seen=np.zeros(SCORE_BINS), hits=np.zeros(SCORE_BINS),
                layers=np.zeros((self.D, self.W)), verify=np.zeros(self.N),
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

    def rates_version(self, B: int) -> int:
        """Changes whenever ``rates(B)`` may have (at each decision): re-upload then."""
        return self._state(B).rates_version

    def rates(self, B: int) -> list[float]:
        """[SCORE_BINS] calibrated acceptance probabilities per score bin: (accepted + prior ×
        the bin's score) ÷ (verified + prior) over decayed counts of verified nodes, then made
        non-increasing from the high-score bins down (a higher score is never less likely)."""
        st = self._state(B)
        r = (st.hits + self.prior * bin_prior()) / (st.seen + self.prior)
        r = np.maximum.accumulate(r[::-1])[::-1]
        return np.clip(r, 0.0, 1.0).tolist()

    def policy_for(self, plan: Plan) -> EagleStatic:
        """The fixed-shape tree a step of ``plan`` drafts: ``EagleStatic(depth, topk=plan's
        topk or K, budget=verify, width=width)``."""
        return EagleStatic(depth=plan.depth, topk=plan.topk or self.K, budget=plan.verify,
                           width=plan.width)  # fmt: skip

    def costs(self, B: int, ctx: int) -> tuple[np.ndarray, np.ndarray, float]:
        """(target [N], draft [W] in ``S_T(B, 1)`` units at the buckets that run, the draft
        layer's overhead included; ``S_T(B, 1)`` in µs) at batch ``B`` and context ``ctx``
        (cached per batch size and context bucket: the host asks every step)."""
        t = self.policy.cost_table
        key = (B, t.bucket(ctx))
        hit = self._costs.get(key)
        if hit is None:
            hit = self._costs[key] = self._costs_of(B, ctx)
        return hit

    def _costs_of(self, B: int, ctx: int) -> tuple[np.ndarray, np.ndarray, float]:
        t = self.policy.cost_table
        ST = t.S_T(B, ctx).numpy()
        SD = t.S_D(B, ctx).numpy()
        unit = float(ST[0])
        ov = self.layer_overhead_us
        ov = float(ov(B) if callable(ov) else ov)
        tgt = np.array([ST[_round_up(k, self.verify_sizes) - 1] for k in range(1, self.N + 1)])
        dft = np.array([SD[_round_up(k, self.widths) - 1] + ov for k in range(1, self.W + 1)])
        return tgt / unit, dft / unit, unit

    def catchup_costs(self, B: int, ctx: int) -> np.ndarray:
        """[D + 1] in ``S_T(B, 1)`` units: the catch-up forward after a step of depth d, at
        the bucket of d + 1 rows (capped at the capacity), as the decoder runs it."""
        key = (B, self.policy.cost_table.bucket(ctx))
        hit = self._catchup.get(key)
        if hit is None:
            t = self.policy.cost_table
            SD = t.S_D(B, ctx).numpy()
            unit = float(t.S_T(B, ctx)[0])
            top = min(self.N, t.n_max)
            hit = np.array([SD[min(_round_up(d + 1, self.verify_sizes), top) - 1]
                            for d in range(self.D + 1)]) / unit  # fmt: skip
            hit[0] = 0.0
            self._catchup[key] = hit
        return hit

    def modelled_us(self, B: int, ctx: int, plan: Plan) -> float:
        """The table's time of a step of ``plan`` (µs): verification at its bucket, the root
        layer and ``depth - 1`` layers of ``width`` rows with their overhead, the catch-up."""
        tgt, dft, unit = self.costs(B, ctx)
        catch = self.catchup_costs(B, ctx)
        d = plan.depth
        return unit * float(
            tgt[plan.verify - 1] + dft[0] + (d - 1) * dft[plan.width - 1] + catch[d]
        )

    def correction(self, B: int) -> np.ndarray:
        """The learnt step-time correction at batch size ``B``: (a, b, c, e) µs (see the class
        docstring); zeros before any timed step or with ``learn_costs`` off."""
        st = self._state(B)
        if not self.learn_costs or not st.residuals:
            return np.zeros(4)
        X = np.array([_features(p) for p in st.residuals])
        wr = np.array(list(st.residuals.values()))
        w, r = wr[:, 0], wr[:, 1]
        prec = np.diag([(STEP_NOISE_US / s) ** 2 for s in COST_PRIOR_US])
        A = X.T @ (w[:, None] * X) + prec
        return np.linalg.solve(A, X.T @ (w * r))

    # ---------------------------------------------------------------- observe
    def observe(
        self, B: int, stats: Sequence[float], plan: Plan, tokens: float, step_s: float, ctx: int
    ) -> Plan:
        """Take one step's results: ``stats`` (``cast_step_stats``'s output, read on the host),
        the ``plan`` it ran, ``tokens`` emitted per active request, its measured time
        ``step_s`` (seconds; 0 for a step that is no measure of its plan, e.g. one that
        captured a graph), the batch's context ``ctx`` (tokens). Updates λ̂, the learnt step
        costs and the calibration; every ``interval`` steps runs the rules on the window's mean
        curves and moves the plan; returns the plan for the next step."""
        st = self._state(B)
        x = np.asarray(stats, dtype=np.float64)
        lay = self.layout
        if x[lay["active"]][0] < 1:  # no active request: nothing learnt
            return st.plan
        st.steps += 1
        if step_s > 0:
            recent = st.recent.setdefault(plan, [])
            pooled = st.recent.setdefault(None, [])
            # a plan's first steps are judged against the batch's recent steps of any plan:
            # a new plan's first step is where a stall is likeliest (its capture, its compiles)
            judge = recent if len(recent) >= STALL_WINDOW // 2 else pooled
            # (statistics.median: numpy's costs ~30-270 µs of host time per step on 8 floats)
            typical = median(judge) if len(judge) >= STALL_WINDOW // 2 else None
            if typical is None or step_s <= STALL_FACTOR * typical:
                for steps in (recent, pooled):
                    steps.append(step_s)
                    del steps[:-STALL_WINDOW]
            if typical is None:  # a batch size's first steps: judged by the table's time
                typical = self.modelled_us(B, ctx, plan) * 1e-6
            if step_s > STALL_FACTOR * typical:
                step_s = 0.0
        eta = 0.0
        if step_s > 0 and tokens > 0:
            _, _, unit_us = self.costs(B, ctx)
            eta = tokens / (step_s * 1e6 / unit_us)
            a = self.lam_smoothing if st.timed else 0.0
            st.lam = a * st.lam + (1 - a) * eta
            st.timed += 1
        if step_s > 0 and self.learn_costs and not plan.is_chain:
            # (a chain's step is not the tree model's: no top-K expand, no selection)
            r = step_s * 1e6 - self.modelled_us(B, ctx, plan)
            ent = st.residuals.setdefault(plan, [0.0, 0.0])
            ent[0] = min(ent[0] + 1.0, RESIDUAL_CAP)
            ent[1] += (r - ent[1]) / ent[0]
        if step_s > 0 and tokens > 0 and self.learn_costs:
            m = st.measured.setdefault(plan, [0.0, 0.0, 0.0, 0])
            if st.steps - m[3] > MEASURED_MAX_AGE:  # stale: a new measurement, not a blend
                m[:] = [0.0, 0.0, 0.0, 0]
            m[0] = min(m[0] + 1.0, MEASURED_CAP)
            m[1] += (eta - m[1]) / m[0]
            m[2] += (eta * eta - m[2]) / m[0]
            m[3] = st.steps
        decay = 0.995
        st.seen = decay * st.seen + x[lay["seen"]]
        st.hits = decay * st.hits + x[lay["hits"]]
        if self.graft_sizes:
            added, hits = x[lay["graft"]]
            st.grafted = GRAFT_DECAY * st.grafted + added
            st.graft_hits = GRAFT_DECAY * st.graft_hits + hits
        if st.home is not None:  # a probe: measured only, the two plans alternating
            return self._probe_step(st, plan, eta if step_s > 0 and tokens > 0 else None)
        if plan != st.plan:  # a step of an older plan: its curves are another shape's
            return st.plan
        st.layers += x[lay["layers"]].reshape(self.D, self.W)
        st.verify += x[lay["verify"]]
        st.window += 1
        if st.window < self.interval:
            return st.plan
        st.decisions += 1
        if plan.is_chain:  # on a chain the rules do not run: only a probe moves it
            st.plan = self._probe(st, plan)
            self._end_window(st)
            return st.plan
        st.last_tree = plan
        target_cost, draft_cost, unit = self.costs(B, ctx)
        _, b, c, e = self.correction(B) / unit
        k = np.arange(self.N)
        target_cost = np.maximum(target_cost + c * k, 0.25 * target_cost)
        k = np.arange(self.W)
        draft_cost = np.maximum(draft_cost + b + e * k, 0.25 * draft_cost)
        st.chain_depth = self._chain_depth(st, plan, target_cost, draft_cost, B, ctx)
        raw = lambda_rules(
            st.layers / st.window, st.verify / st.window, plan.depth, st.lam, target_cost,
            draft_cost, R=self.policy.R, max_depth=self.D,
            catchup_cost=self.catchup_costs(B, ctx),
        )  # fmt: skip
        st.plan, st.votes = self._toward(plan, raw, st.votes)
        if self.graft_sizes:
            curve = st.verify / st.window
            st.plan = replace(st.plan, graft=self._graft_for(st, curve, st.plan.verify, plan.graft))
        st.plan = self._measured_guard(st, plan, st.plan)
        if st.allowed is not None and st.plan not in st.allowed:
            st.plan = self._nearest_allowed(st, plan, st.plan)
        st.settled = st.settled + 1 if st.plan == plan else 0
        st.plan = self._probe(st, st.plan)
        self._end_window(st)
        return st.plan

    def _end_window(self, st: _BatchState) -> None:
        st.layers[:] = 0.0
        st.verify[:] = 0.0
        st.window = 0
        st.rates_version += 1

    # ------------------------------------------------------- measured η: guard and probes
    def _live(self, st: _BatchState) -> dict:
        """The plans with a measured η: ``MEASURED_MIN_STEPS`` timed steps, the last within
        ``MEASURED_MAX_AGE`` steps."""
        return {
            p: m for p, m in st.measured.items()
            if m[0] >= MEASURED_MIN_STEPS and st.steps - m[3] <= MEASURED_MAX_AGE
        }  # fmt: skip

    @staticmethod
    def _beats(a: Sequence[float], b: Sequence[float]) -> bool:
        """Whether measurement ``a``'s mean η exceeds ``b``'s by ``MEASURED_Z`` standard errors
        (each ``[steps, mean, mean square, ...]``)."""
        (n1, m1, s1), (n2, m2, s2) = a[:3], b[:3]
        se = np.sqrt(max(s1 - m1 * m1, 0.0) / n1 + max(s2 - m2 * m2, 0.0) / n2)
        return m1 - m2 > MEASURED_Z * se

    def _probe_step(self, st: _BatchState, plan: Plan, eta: float | None) -> Plan:
        """One step of a probe (``plan`` ran it; ``eta`` its measured η, None if it is no
        measure): counted in the pair if it ran the probe or the plan it left; every
        ``2 * interval`` steps the verdict (``_verdict``); returns the next step's plan, the
        other of the two while the probe runs."""
        if eta is not None and plan in (st.home, st.probe):
            m = st.pair.setdefault(plan, [0.0, 0.0, 0.0])
            m[0] += 1.0
            m[1] += (eta - m[1]) / m[0]
            m[2] += (eta * eta - m[2]) / m[0]
        st.window += 1
        if st.window >= 2 * self.interval:
            st.decisions += 1
            self._end_window(st)
            st.probe_windows += 1
            done = self._verdict(st)
            if done is not None:
                won = done == st.probe
                self._log_probe(st, won)
                st.home = st.probe = None
                st.pair, st.probe_windows = {}, 0
                st.backoff = 1 if won else min(2 * st.backoff, PROBE_BACKOFF_MAX)
                st.plan = self._probe(st, done)
                return st.plan
        st.plan = st.home if st.plan == st.probe else st.probe
        return st.plan

    @staticmethod
    def _log_probe(st: _BatchState, won: bool) -> None:
        entry: list = [
            st.steps,
            *([p.width, p.depth, p.verify, p.graft] for p in (st.home, st.probe)),
        ]
        for p in (st.home, st.probe):
            m = st.pair.get(p)
            entry += [0, None] if m is None else [int(m[0]), round(float(m[1]), 4)]
        st.probe_log.append(entry + [st.probe_windows, "probe" if won else "home"])
        del st.probe_log[:-PROBE_LOG]

    def _verdict(self, st: _BatchState) -> Plan | None:
        """The plan a probe ends on, or None while it runs on: the probe if it beats the plan it
        left by ``MEASURED_Z`` standard errors over the probe's steps, that plan if it beats the
        probe; undecided, it runs on (up to ``PROBE_EXTEND_WINDOWS`` windows) and then the
        higher mean wins. A probe without ``MEASURED_MIN_STEPS`` timed steps of each plan after
        ``PROBE_MAX_WINDOWS`` windows returns home."""
        a, b = st.pair.get(st.probe), st.pair.get(st.home)
        if a is None or b is None or min(a[0], b[0]) < MEASURED_MIN_STEPS:
            return None if st.probe_windows < PROBE_MAX_WINDOWS else st.home
        if self._beats(a, b):
            return st.probe
        if self._beats(b, a):
            return st.home
        if st.probe_windows < PROBE_EXTEND_WINDOWS:
            return None
        return st.probe if a[1] > b[1] else st.home

    def _probe(self, st: _BatchState, cur: Plan) -> Plan:
        """``PROBE_EVERY`` decisions (times the backoff) after the last probe, and next to a tree
        once it kept its plan ``PROBE_SETTLE`` decisions (or ``PROBE_SETTLE_WAIT`` times that
        long after the last probe): the first plan of
        ``_probe_candidates`` that is allowed and not measured within ``PROBE_AGE`` steps (times
        the backoff), to run alternating with ``cur`` (``st.home``, where the planner returns
        unless the probe wins: ``_probe_step``); else ``cur``."""
        if not self.chain_probes or st.decisions - st.last_probe < PROBE_EVERY * st.backoff:
            return cur
        waited = st.decisions - st.last_probe >= PROBE_SETTLE_WAIT * PROBE_EVERY * st.backoff
        if not cur.is_chain and st.settled < PROBE_SETTLE and not waited:
            return cur
        for p in self._probe_candidates(st, cur):
            if st.allowed is not None and p not in st.allowed:
                continue
            m = st.measured.get(p)
            if m is None or m[0] < MEASURED_MIN_STEPS or st.steps - m[3] > PROBE_AGE * st.backoff:
                st.home, st.probe, st.pair = cur, p, {}
                st.probe_windows, st.last_probe = 0, st.decisions
                return p
        return cur

    def _chain_depth(self, st, plan, target_cost, draft_cost, B: int, ctx: int) -> int:
        """The chain depth the window's curves and the costs favour: a chain of depth d emits
        1 + the sum of the best candidate's calibrated acceptance over layers 1..d (column 0 of
        the layer curves, within the tree's depth) and costs the verification of d + 1 nodes,
        d one-row layers and the catch-up."""
        best = st.layers[: plan.depth, 0] / max(st.window, 1)
        catch = self.catchup_costs(B, ctx)
        d = np.arange(1, min(plan.depth, self.N - 1) + 1)
        eta = (1.0 + np.cumsum(best)[d - 1]) / (target_cost[d] + d * draft_cost[0] + catch[d])
        return int(d[np.argmax(eta)])

    def _probe_candidates(self, st: _BatchState, cur: Plan) -> list[Plan]:
        """Next to a tree: the chain at the best measured chain depth (else at the depth the
        curves favour, ``_chain_depth``), then one layer shallower and deeper. Next to a chain:
        one layer shallower and deeper, then the tree halfway to the last tree run
        (``_between``), then that tree."""

        def chain(d: int) -> list[Plan]:
            return [Plan.chain(d)] if 1 <= d <= self.D and d + 1 <= self.N else []

        if cur.is_chain:
            d = cur.depth
            trees = []
            if st.last_tree is not None:
                mid = self._between(cur, st.last_tree)
                trees = [mid, st.last_tree] if mid != st.last_tree else [st.last_tree]
            return chain(d - 1) + chain(d + 1) + trees
        live = self._live(st)
        chains = [p for p in live if p.is_chain]
        d = max(chains, key=lambda p: live[p][1]).depth if chains else st.chain_depth or cur.depth
        return chain(d) + chain(d - 1) + chain(d + 1)

    def _between(self, chain: Plan, tree: Plan) -> Plan:
        """The top-K tree halfway (in bucket steps, rounded towards the tree) from ``chain`` to
        ``tree`` in width, depth and verify count, ``tree``'s graft kept within half its verify
        count. A chain leaves only through a probe, and the last tree it beat is often one the
        rules grew too wide (at B = 1 on the H200, a 96-node tree of width 10 lost to the
        depth-10 chain, while 48–64-node trees of width 4 beat that chain by 20 % or more): the
        probe tries the tree between them first."""
        lists = (self.widths, list(range(1, self.D + 1)), self.verify_sizes)
        out = []
        for a, b, sizes in zip((chain.width, chain.depth, chain.verify),
                               (tree.width, tree.depth, tree.verify), lists):  # fmt: skip
            i, j = sizes.index(_round_up(a, sizes)), sizes.index(b)
            out.append(sizes[(i + j + 1) // 2])
        width, depth, verify = out
        most = 1 + self.K + (depth - 1) * width * self.K
        verify = min(verify, _round_up(most, self.verify_sizes))
        return Plan(width=width, depth=depth, verify=verify, graft=min(tree.graft, verify // 2))

    def unprobed(self, B: int) -> list[Plan]:
        """The plans a probe would measure next to the current plan at batch size ``B`` (the
        chains of ``_probe_candidates``; next to a chain also the tree halfway to the last tree,
        and that tree) that have no
        measured η yet: empty once the neighbourhood the probes compare is measured (a warm-up
        that ends before leaves the timed runs, restricted to its plans, without them)."""
        if not self.chain_probes:
            return []
        st = self._state(B)
        out = []
        for p in self._probe_candidates(st, st.plan):
            m = st.measured.get(p)
            if (st.allowed is None or p in st.allowed) and (m is None or m[0] < MEASURED_MIN_STEPS):
                out.append(p)
        return out

    def _toward(self, plan: Plan, raw: Plan, votes: tuple) -> tuple[Plan, tuple]:
        """``plan`` moved one bucket (one layer) towards ``raw`` in each size where this decision
        and the previous one (``votes``) point the same way: a single noisy window moves
        nothing. Returns (the plan, this decision's directions)."""
        cur = (plan.width, plan.depth, plan.verify)
        lists = (self.widths, list(range(1, self.D + 1)), self.verify_sizes)
        out, dirs = [], []
        for c, want, sizes, last in zip(cur, (raw.width, raw.depth, raw.verify), lists, votes):
            target = _round_up(want, sizes)
            d = (target > c) - (target < c)
            dirs.append(d)
            i = sizes.index(c)
            out.append(sizes[min(max(i + d, 0), len(sizes) - 1)] if d and d == last else c)
        width, depth, verify = out
        most = 1 + self.K + (depth - 1) * width * self.K  # the most nodes the tree can hold
        verify = min(verify, _round_up(most, self.verify_sizes))
        return Plan(width=width, depth=depth, verify=verify), tuple(dirs)

    def plans_run(self, B: int) -> list[Plan]:
        """The plans that ran at batch size ``B`` (each has its whole-step graph in a decoder
        with CUDA graphs)."""
        return sorted(self._state(B).residuals | self._state(B).measured)

    def restrict(self, B: int, plans: Sequence[Plan] | None) -> None:
        """Let the plan at batch size ``B`` move only among ``plans`` (None lifts it), as an
        engine does with graphs captured at start-up: the decisions then pick the allowed plan
        nearest to what they would choose (bucket steps summed over the sizes; the current plan
        on a tie), so a decision never captures a new graph; a current plan outside them moves
        to the nearest at once. An empty ``plans`` is a ``ValueError``."""
        st = self._state(B)
        if plans is None:
            st.allowed = None
            return
        allowed = frozenset(plans)
        if not allowed:
            raise ValueError("Invalid value of plans: expected at least one plan, got none")
        st.allowed = allowed
        if st.home is not None and not {st.home, st.probe} <= allowed:  # its pair cannot run
            st.home = st.probe = None
            st.pair, st.probe_windows = {}, 0
        if st.plan not in allowed:
            st.plan = self._nearest_allowed(st, st.plan, st.plan)

    def _nearest_allowed(self, st: _BatchState, cur: Plan, want: Plan) -> Plan:
        lists = (
            self.widths,
            list(range(1, self.D + 1)),
            self.verify_sizes,
            self.graft_sizes or [0],
        )

        def dist(p: Plan) -> int:
            if p.is_chain or want.is_chain:  # a chain is near chains only, by depth
                return abs(p.depth - want.depth) + (0 if p.is_chain == want.is_chain else 1000)
            return sum(abs(sz.index(a) - sz.index(b)) for sz, a, b in zip(
                lists, (p.width, p.depth, p.verify, p.graft),
                (want.width, want.depth, want.verify, want.graft)))  # fmt: skip

        return min(sorted(st.allowed), key=lambda p: (dist(p), p != cur))

    def graft_rate(self, B: int) -> float:
        """The measured acceptance probability of a grafted node at batch size ``B`` (decayed
        counts and ``GRAFT_PRIOR``)."""
        st = self._state(B)
        n0, q0 = GRAFT_PRIOR
        return (st.graft_hits + n0 * q0) / (st.grafted + n0)

    def _graft_for(self, st: _BatchState, curve: np.ndarray, verify: int, cur: int) -> int:
        """The graft size one step from ``cur`` towards the best for ``verify`` nodes: g
        grafted nodes gain ``q g`` tokens and lose the draft's ranks ``verify - g .. verify - 1``
        (their mass on the window's verify curve, cumulative in rank)."""
        n0, q0 = GRAFT_PRIOR
        q = (st.graft_hits + n0 * q0) / (st.grafted + n0)
        sizes = [g for g in self.graft_sizes if g <= verify // 2]
        top = curve[verify - 1]

        def value(g: int) -> float:
            return q * g - (top - curve[verify - g - 1]) if g else 0.0

        want = max(sizes, key=value)
        cur = max((g for g in sizes if g <= cur), default=0)
        i = sizes.index(cur)
        return sizes[i + (want > cur) - (want < cur)]

    def _measured_guard(self, st: _BatchState, cur: Plan, proposed: Plan) -> Plan:
        """The rules propose, the measured throughput disposes: a plan run for
        ``MEASURED_MIN_STEPS`` timed steps within the last ``MEASURED_MAX_AGE`` has a measured η.
        If the best measured plan beats the current one by ``MEASURED_Z`` standard errors, the
        plan moves to it; else a proposed plan measured worse than the current one by as much
        is not taken. The model's errors (costs the table and its learnt correction do not see,
        a calibration off at depth) then cost a few windows, not the run."""
        if not self.learn_costs:
            return proposed
        live = self._live(st)
        if cur not in live:
            return proposed
        best = max(live, key=lambda p: live[p][1])
        if best != cur and self._beats(live[best], live[cur]):
            # to the best itself: it ran (its graph exists), and a step towards it can be a
            # plan the engine does not run (under ``restrict`` the nearest allowed plan to
            # that step can be the current one: the better plan would never be reached)
            return best
        if proposed in live and self._beats(live[cur], live[proposed]):
            return cur
        return proposed

    def _rounded(self, w: float, d: float, n: float) -> Plan:
        width = _round_up(min(max(w, 1.0), self.W), self.widths)
        depth = int(min(max(round(d), 1), self.D))
        most = 1 + self.K + (depth - 1) * width * self.K
        verify = _round_up(min(max(n, 1.0), self.N, most), self.verify_sizes)
        return Plan(width=width, depth=depth, verify=verify)

    def describe(self, B: int) -> dict:
        """λ̂, the plan and the calibrated rates at batch size ``B`` (for results and logs)."""
        st = self._state(B)
        return {
            "lambda": round(st.lam, 4),
            "plan": [st.plan.width, st.plan.depth, st.plan.verify, st.plan.graft, st.plan.topk],
            "cost_correction_us": [round(float(x), 2) for x in self.correction(B)],
            # per plan run: [width, depth, verify, graft, timed steps (capped), mean measured -
            # modelled µs (None for a chain: not in the model), measured η, topk]
            "plans_measured": [
                [
                    p.width,
                    p.depth,
                    p.verify,
                    p.graft,
                    int((st.residuals.get(p) or st.measured[p])[0]),
                    round(st.residuals[p][1], 1) if p in st.residuals else None,
                    round(st.measured[p][1], 4) if p in st.measured else None,
                    p.topk,
                ]
                for p in self.plans_run(B)
            ],  # fmt: skip
            "rates": [round(g, 4) for g in self.rates(B)],
            "graft_rate": round(self.graft_rate(B), 4) if self.graft_sizes else None,
            "steps": st.steps,
            # the last PROBE_LOG probes: [step ended, home and probe [w, d, n, g], home's and
            # the probe's steps and mean η over the probe, windows, the plan kept]
            "probes": [list(e) for e in st.probe_log],
        }

"""The decoder's policies: which tree each step drafts and sends to verification.

A policy is an object; ``POLICIES`` lists their names:

* ``Autoregressive()`` (``"autoregressive"``): no draft model, one token per step.
* ``Chain(depth)`` (``"chain"``): a chain of ``depth`` drafted tokens (EAGLE with top-1,
  ``EagleStatic(depth, topk=1, budget=depth + 1)``).
* ``treeops.EagleStatic(depth, topk, budget)`` (``"EagleStatic"``): EAGLE-2's dynamic tree with
  static sizes.
* ``treeops.Cast(...)`` (``"Cast"``): CAST's cost-aware tree. With thresholds C1-C3 its widths,
  depth and verification count are decided on the device during the step; without them
  (λ-CAST, ``make_policy``'s default) a ``treeops.CastPlanner`` sizes each step between steps
  from the measured throughput λ̂, the calibrated draft scores and the cost table.
* ``CastGraft(cast, checkpoints, template, adjacency_k, anchor)`` (``"CastGraft"``): CAST's
  tree, pruned at Graft's checkpoints and refilled from the successor table (docs/design.md
  op 6), at its root or below its best leaf.

``make_policy(name, depth=, topk=, budget=, ...)`` builds one from its name and sizes (the
command line and the benchmarks); ``Decoder`` also accepts a name, mapped with the defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from .._checks import check_positive_int
from ..build_tree import Cast, EagleStatic
from ..cost_table import CostTable
from ..graft import RankTemplate
from ..prune import PruneCheckpoints

__all__ = [
    "POLICIES",
    "Autoregressive",
    "Chain",
    "CastGraft",
    "Policy",
    "make_policy",
    "as_policy",
    "policy_name",
    "tree_policy",
    "synthetic_cost_table",
]

POLICIES = ("autoregressive", "chain", "EagleStatic", "Cast", "CastGraft")


@dataclass(frozen=True)
class Autoregressive:
    """No draft: each step verifies the root alone and emits one token (the baseline)."""

    name: ClassVar[str] = "autoregressive"


@dataclass(frozen=True)
class Chain:
    """A chain of ``depth`` drafted tokens: ``EagleStatic(depth, topk=1, budget=depth + 1)``."""

    depth: int = 4

    name: ClassVar[str] = "chain"

    def __post_init__(self) -> None:
        check_positive_int("depth", self.depth)

    @property
    def tree(self) -> EagleStatic:
        return EagleStatic(depth=self.depth, topk=1, budget=self.depth + 1)


@dataclass(frozen=True, eq=False)
class CastGraft:
    """CAST's tree (``cast``), pruned at Graft's ``checkpoints`` (a request under a checkpoint's
    threshold keeps only its best draft nodes; a lone request stops drafting) and refilled, up to
    the emitted tree's size, with the successors that ``template`` (a ``RankTemplate``) walks in
    an ``AdjacencyTable`` of ``adjacency_k`` successors per token, learnt from the prompts and
    every verified tree.

    ``anchor``: where the refill goes. ``"leaf"`` (the default): a chain of first successors
    below the best leaf (``graft_tail``), as long as the template has nodes beyond its root
    (under λ-CAST: the plan's graft count, capped by that length: a root-only template grafts
    nothing), extending the path most likely accepted whole.
    ``"root"``: the template's successors from the root token, trie-merged into the tree
    (``graft``). On the trained pair at B = 1 (H200) the leaf's chain made λ-CAST 1.15× faster
    and the root's successors 0.97× (the draft already proposes most of them)."""

    cast: Cast
    checkpoints: PruneCheckpoints = field(default_factory=PruneCheckpoints)
    template: RankTemplate = field(default_factory=RankTemplate.default)
    adjacency_k: int = 8
    anchor: str = "leaf"

    name: ClassVar[str] = "CastGraft"

    def __post_init__(self) -> None:
        for arg, want in (
            ("cast", Cast),
            ("checkpoints", PruneCheckpoints),
            ("template", RankTemplate),
        ):
            v = getattr(self, arg)
            if not isinstance(v, want):
                raise ValueError(
                    f"Invalid type of {arg}: expected treeops.{want.__name__}, "
                    f"got {type(v).__name__}"
                )
        check_positive_int("adjacency_k", self.adjacency_k)
        if self.anchor not in ("root", "leaf"):
            raise ValueError(
                f"Invalid value of anchor: expected 'root' or 'leaf', got {self.anchor!r}"
            )


Policy = Autoregressive | Chain | EagleStatic | Cast | CastGraft


def synthetic_cost_table(n_max: int = 64) -> CostTable:
    """A synthetic cost table shaped like a large GPU's (flat while the forward is weight-bound,
    then linear in tokens; the draft costs a quarter of the target), for CAST without a
    calibration run."""

    def target(B: int, c: int, n: int) -> float:
        return 100.0 + 0.02 * B * c / 1024 + max(0, B * n - 32) * 1.0

    def draft(B: int, c: int, n: int) -> float:
        return target(B, c, n) / 4

    return CostTable.from_functions(
        target, draft, batch_sizes=[1, 2, 4, 8, 16, 32, 64], L=256, M=4, n_max=n_max,
        meta={"gpu": "synthetic", "model": "decoder"},
    )  # fmt: skip


def make_policy(
    name: str,
    *,
    depth: int = 4,
    topk: int = 4,
    budget: int = 16,
    cost_table: CostTable | None = None,
    C1: float | None = None,
    C2: float | None = None,
    C3: float | None = None,
    R: int = 4,
    cast_depth: int | None = None,
    cast_budget: int | None = None,
    checkpoints: PruneCheckpoints | None = None,
    template: RankTemplate | None = None,
    adjacency_k: int = 8,
    lambda_graft: bool = False,
    anchor: str = "leaf",
) -> Policy:
    """The policy ``name`` (one of ``POLICIES``) from EAGLE-style sizes; arguments that do not
    apply to it are ignored.

    ``chain`` uses ``depth``; ``EagleStatic`` ``depth``, ``topk``, ``budget``; ``Cast`` and
    ``CastGraft`` use ``cast_depth`` (default ``depth``) as ``max_depth``, ``topk`` as
    ``topk = max_width``, ``cast_budget`` (default ``budget``) as ``capacity``, with the
    thresholds ``C1``, ``C2``, ``C3``, the FIFO length ``R`` and ``cost_table`` (default
    ``synthetic_cost_table(max(64, capacity, topk))``). ``Cast`` without thresholds is λ-CAST
    (the decoder plans its sizes between steps); once one threshold is given the others default
    to CAST's (C1, C2, C3 = 0.3, 0.2, 0.1), as they always do for ``CastGraft``, which adds
    ``checkpoints`` (default ``PruneCheckpoints.for_depth(max_depth)``), ``template``
    (default ``RankTemplate.default()``), ``adjacency_k`` and ``anchor``; with
    ``lambda_graft`` (and no threshold given) ``CastGraft`` grafts onto λ-CAST instead, its
    plans choosing how many verified nodes the table fills. A name outside ``POLICIES`` is a
    ``ValueError``."""
    if name not in POLICIES:
        raise ValueError(f"Invalid policy: expected one of {POLICIES}, got {name!r}")
    if name == "autoregressive":
        return Autoregressive()
    if name == "chain":
        return Chain(depth)
    if name == "EagleStatic":
        return EagleStatic(depth=depth, topk=topk, budget=budget)
    max_depth = cast_depth or depth
    capacity = cast_budget or budget
    table = cost_table or synthetic_cost_table(max(64, capacity, topk))
    given = (C1, C2, C3)
    if (name == "CastGraft" and not lambda_graft) or any(c is not None for c in given):
        # thresholds: the ones given, the others CAST's defaults (Graft prunes a thresholded
        # CAST tree, not λ-CAST)
        C1, C2, C3 = (d if c is None else c for c, d in zip(given, (0.3, 0.2, 0.1)))
    cast = Cast(
        C1=C1, C2=C2, C3=C3, R=R, cost_table=table, topk=topk, max_width=topk,
        max_depth=max_depth, capacity=capacity,
    )  # fmt: skip
    if name == "Cast":
        return cast
    return CastGraft(
        cast,
        checkpoints=checkpoints or PruneCheckpoints.for_depth(max_depth),
        template=template or RankTemplate.default(),
        adjacency_k=adjacency_k,
        anchor=anchor,
    )


_TYPES = (Autoregressive, Chain, EagleStatic, Cast, CastGraft)


def as_policy(policy: Policy | str) -> Policy:
    """``policy`` itself, or ``make_policy(policy)`` for a name; anything else is a
    ``ValueError``."""
    if isinstance(policy, str):
        return make_policy(policy)
    if not isinstance(policy, _TYPES):
        raise ValueError(
            f"Invalid policy: expected one of {POLICIES} or a policy object (Autoregressive, "
            f"Chain, EagleStatic, Cast, CastGraft), got {type(policy).__name__}"
        )
    return policy


def policy_name(policy: Policy) -> str:
    """The name of ``policy`` in ``POLICIES``."""
    if isinstance(policy, (EagleStatic, Cast)):
        return type(policy).__name__
    return policy.name


def tree_policy(policy: Policy) -> EagleStatic | Cast | None:
    """The ``build_tree`` policy that drafts ``policy``'s trees (None: no draft)."""
    if isinstance(policy, Autoregressive):
        return None
    if isinstance(policy, Chain):
        return policy.tree
    if isinstance(policy, CastGraft):
        return policy.cast
    return policy

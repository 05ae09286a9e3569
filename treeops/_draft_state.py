"""``DraftState``: the fixed-capacity device buffers one decoding step drafts into.

Shared by the tree-build op, its kernels' callers and its reference. It reads a policy only
through its sizes (``max_depth``, ``max_width``, ``topk``, ``capacity``), ``is_cast`` and, for
CAST, ``cost_table.device_tables``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _library, _runtime
from ._checks import Memo, check_same_device, check_tensor, cuda_device, signature

__all__ = ["DraftState", "STATE_TENSORS", "state_signature"]

CUDA_RESET: Callable | None = None
"""``reset(state, root_tokens, seq_lens, active)`` for a state on CUDA: one launch in place of
the torch writes (``treeops.kernels.draft_reset``; set by ``treeops.build_tree``, which may import
the kernels that this module may not)."""

_RESET_PASSED = Memo()
"""Signatures of ``reset`` calls whose checks passed, each with whether the state's buffers are
dense (what the one-launch form indexes)."""

STATE_TENSORS = (
    "root_tokens",
    "seq_lens",
    "active",
    "cand_tokens",
    "cand_scores",
    "cand_parents",
    "frontier",
    "frontier_tokens",
    "frontier_scores",
    "decisions",
    "u_hist",
)


def state_signature(state: object, tensors: tuple, values: tuple) -> tuple | None:
    """``signature`` of a ``DraftState``'s buffers (``STATE_TENSORS``, then the workspace's, with
    its keys) and of a call's other ``tensors`` and ``values``: what an op's checks of the state
    read. None when ``state`` is not exactly a ``DraftState`` (then the op checks in full)."""
    if not isinstance(state, DraftState):
        return None
    try:
        ws = state.workspace  # type: ignore[attr-defined]
        own = [getattr(state, f) for f in STATE_TENSORS]
        return signature((*own, *ws.values(), *tensors), (*values, *ws))
    except AttributeError:  # a workspace that is no dict: check in full
        return None


def _check_policy_sizes(policy: object) -> None:
    sizes = ("max_depth", "max_width", "topk", "capacity", "is_cast")
    if not all(hasattr(policy, a) for a in sizes):
        raise ValueError(
            f"Invalid type of policy: expected treeops.EagleStatic or treeops.Cast, "
            f"got {type(policy).__name__}"
        )


@dataclass
class DraftState:
    """The candidates of one decoding step and the decisions taken so far (device tensors).

    Shapes (B requests, D = policy.max_depth, W = policy.max_width, K = policy.topk, C = W*K):

    | field | shape, dtype | meaning |
    | --- | --- | --- |
    | ``root_tokens`` | [B] int64 | the root (last accepted token) of each request |
    | ``seq_lens`` | [B] int64 | tokens in the cache (CAST prices the context from these) |
    | ``active`` | [B] bool | inactive rows draft nothing and emit ``num_nodes = 0`` |
    | ``cand_tokens`` | [B, D, C] int64 | candidate token (valid for layers < ``layer``) |
    | ``cand_scores`` | [B, D, C] float32 | path score; -1 = no candidate |
    | ``cand_parents`` | [B, D, C] int32 | parent's candidate index; -1 = the root |
    | ``frontier`` | [B, W] int32 | candidate index of each frontier row (-1: root or unused) |
    | ``frontier_tokens`` | [B, W] int64 | token of each frontier row (the next draft input) |
    | ``frontier_scores`` | [B, W] float32 | path score; -1 = unused row |
    | ``decisions`` | [2D + 1] int32 | ``widths`` [D], ``flags`` [D] (1 = draft layer i+1),
      ``verify`` [1] (nodes sent to verification) |
    | ``u_hist`` | [D] float32 | CAST: utility of the width chosen at each layer |

    ``layer`` (a host int) counts the layers expanded this step. A static policy's decisions are
    its sizes (widths W, a flag for every layer but the last, verify N), so ``width(i)``,
    ``wants_next_layer()`` and ``verify_count()`` answer from ``static_decisions`` without a
    wait, and nothing is copied. Under CAST on CUDA the decisions are copied (non-blocking) to
    ``host_decisions``, a pinned buffer, after each expand/emit, with an event per decision
    point, and those methods wait on that event only (see ``publish`` for CUDA-graph replays).
    """

    root_tokens: torch.Tensor
    seq_lens: torch.Tensor
    active: torch.Tensor
    cand_tokens: torch.Tensor
    cand_scores: torch.Tensor
    cand_parents: torch.Tensor
    frontier: torch.Tensor
    frontier_tokens: torch.Tensor
    frontier_scores: torch.Tensor
    decisions: torch.Tensor
    u_hist: torch.Tensor
    workspace: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    host_decisions: torch.Tensor | None = field(default=None, repr=False)
    events: list[Any] = field(default_factory=list, repr=False)
    static_decisions: tuple[int, ...] | None = field(default=None, repr=False)
    layer: int = 0

    @staticmethod
    def new(
        policy: Any,
        root_tokens: torch.Tensor,
        seq_lens: torch.Tensor,
        active: torch.Tensor | None = None,
    ) -> DraftState:
        """Allocate the buffers for ``policy`` and start a step (see ``reset``)."""
        _check_policy_sizes(policy)
        check_tensor("root_tokens", root_tokens, shape=("B",), dtype=torch.int64)
        B = root_tokens.shape[0]
        dev = root_tokens.device
        D, W, K = policy.max_depth, policy.max_width, policy.topk
        C = W * K
        N = policy.capacity
        decisions = torch.zeros(2 * D + 1, dtype=torch.int32, device=dev)
        st = DraftState(
            root_tokens=torch.zeros(B, dtype=torch.int64, device=dev),
            seq_lens=torch.zeros(B, dtype=torch.int64, device=dev),
            active=torch.zeros(B, dtype=torch.bool, device=dev),
            cand_tokens=torch.zeros(B, D, C, dtype=torch.int64, device=dev),
            cand_scores=torch.full((B, D, C), -1.0, dtype=torch.float32, device=dev),
            cand_parents=torch.full((B, D, C), -1, dtype=torch.int32, device=dev),
            frontier=torch.full((B, W), -1, dtype=torch.int32, device=dev),
            frontier_tokens=torch.zeros(B, W, dtype=torch.int64, device=dev),
            frontier_scores=torch.full((B, W), -1.0, dtype=torch.float32, device=dev),
            decisions=decisions,
            u_hist=torch.zeros(D, dtype=torch.float32, device=dev),
        )
        # kernel workspace: arrival counters (zero between launches), per-request prefix sums,
        # rerank selection
        st.workspace = {
            "counters": torch.zeros(B + 1, dtype=torch.int32, device=dev),
            "cum": torch.zeros(B, max(W, N), dtype=torch.float32, device=dev),
            "sel": torch.zeros(B, N, dtype=torch.int32, device=dev),
            "pos": torch.zeros(B, D * C, dtype=torch.int32, device=dev),
        }
        if not policy.is_cast:
            # what the launches write for a static policy, known here (reference/build_tree.py)
            flags = [int(i + 1 < D) for i in range(D)]
            st.static_decisions = tuple([W] * D + flags + [N])
        elif dev.type == "cuda":
            st.host_decisions = torch.zeros(2 * D + 1, dtype=torch.int32, pin_memory=True)
            st.events = [torch.cuda.Event() for _ in range(D + 1)]
        if policy.is_cast:
            # Copy the cost table to the device now, outside any CUDA-graph capture.
            policy.cost_table.device_tables(B, dev)
        st.reset(root_tokens, seq_lens, active)
        return st

    def reset(
        self, root_tokens: torch.Tensor, seq_lens: torch.Tensor, active: torch.Tensor | None = None
    ) -> DraftState:
        """Start a decoding step in place (no allocation, no host sync); the frontier = the root.
        On CUDA one launch (``CUDA_RESET``)."""
        key = signature((root_tokens, seq_lens, active, *self._reset_buffers()))
        dense = _RESET_PASSED.get(key)
        if dense is None:
            sizes = {"B": self.active.shape[0]}
            check_tensor("root_tokens", root_tokens, shape=("B",), dtype=torch.int64, sizes=sizes)
            check_tensor(
                "seq_lens", seq_lens, shape=("B",), dtype=(torch.int32, torch.int64), sizes=sizes
            )
            if active is not None:
                check_tensor("active", active, shape=("B",), dtype=torch.bool, sizes=sizes)
            check_same_device(
                state=self.active, root_tokens=root_tokens, seq_lens=seq_lens, active=active
            )
            # the kernel indexes the buffers densely (a user-built state may hold views)
            dense = all(t.is_contiguous() for t in self._reset_buffers())
            _RESET_PASSED.put(key, dense)
        self.layer = 0
        # the launch where an op would launch directly (no mode, tracing or profiler: those
        # see the torch writes), on the state's device
        if CUDA_RESET is not None and dense and self.active.is_cuda and _library.direct_state_ok():
            with cuda_device(self.active):
                CUDA_RESET(self, root_tokens, seq_lens, active)
            return self
        self.root_tokens.copy_(root_tokens)
        self.seq_lens.copy_(seq_lens)
        if active is None:
            self.active.fill_(True)
        else:
            self.active.copy_(active)
        self.frontier.fill_(-1)
        self.frontier_tokens.zero_()
        self.frontier_tokens[:, 0] = self.root_tokens
        self.frontier_scores.fill_(-1.0)
        self.frontier_scores[:, 0].masked_fill_(self.active, 1.0)
        self.decisions.zero_()
        self.u_hist.zero_()
        return self

    def _reset_buffers(self) -> tuple[torch.Tensor, ...]:
        """The buffers ``reset`` writes."""
        return (
            self.root_tokens, self.seq_lens, self.active, self.frontier, self.frontier_tokens,
            self.frontier_scores, self.decisions, self.u_hist,
        )  # fmt: skip

    # -------------------------------------------------------------- decisions
    def to(self, device: torch.device | str) -> DraftState:
        """A copy with every tensor (workspace included) cloned onto ``device``, e.g. a CPU
        snapshot for the reference; the copy has no pinned decision buffer (its ``width()`` etc.
        read ``decisions`` directly)."""
        c = copy.copy(self)
        for f in STATE_TENSORS:
            setattr(c, f, getattr(self, f).to(device, copy=True))
        c.workspace = {k: v.to(device, copy=True) for k, v in self.workspace.items()}
        c.host_decisions, c.events, c.static_decisions = None, [], None
        return c

    @property
    def max_depth(self) -> int:
        return int(self.u_hist.shape[0])

    @property
    def widths(self) -> torch.Tensor:
        return self.decisions[: self.max_depth]

    @property
    def flags(self) -> torch.Tensor:
        return self.decisions[self.max_depth : 2 * self.max_depth]

    @property
    def verify(self) -> torch.Tensor:
        return self.decisions[2 * self.max_depth :]

    @property
    def frontier_valid(self) -> torch.Tensor:
        """[B, W] bool: frontier rows that hold a node (the others' logits are ignored)."""
        return self.frontier_scores >= 0

    def publish(self, point: int) -> None:
        """Copy the decisions to the pinned host buffer (non-blocking) and record decision point
        ``point``'s event (layer i: ``i``; the rerank: ``max_depth``): CAST on CUDA (a static
        policy's decisions are known on the host; nothing to do). The public ops do this after
        each launch, except while a CUDA graph is being captured: a decoder replaying captured
        expand/emit launches calls ``publish`` itself after each replay."""
        if self.host_decisions is not None and not torch.cuda.is_current_stream_capturing():
            self.host_decisions.copy_(self.decisions, non_blocking=True)
            self.events[point].record(_runtime.current_stream(self.decisions.device.index))

    def _host(self, point: int) -> torch.Tensor | tuple[int, ...]:
        if self.static_decisions is not None:
            return self.static_decisions
        if self.host_decisions is None:
            return self.decisions.cpu()
        self.events[point].synchronize()
        return self.host_decisions

    def width(self, i: int) -> int:
        """Width chosen at draft layer ``i`` (rows of the next draft forward); one event wait.
        Under CAST at most the most valid frontier rows of any active request (at least 1)."""
        return int(self._host(i)[i])

    def wants_next_layer(self) -> bool:
        """Whether the policy drafts layer ``self.layer`` (False before any layer: never)."""
        if self.layer == 0:
            return True
        i = self.layer - 1
        return bool(self._host(i)[self.max_depth + i]) and self.layer < self.max_depth

    def verify_count(self) -> int:
        """Nodes per request sent to verification (root included), after ``build_tree_emit``.
        Under CAST ``max(num_nodes)`` of the emitted tree (1 if no request is active); EAGLE: its
        budget."""
        return int(self._host(self.max_depth)[2 * self.max_depth])

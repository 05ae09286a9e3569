"""What ``Decoder.generate`` takes per request (``SamplingParams``) and returns
(``DecodeResult``), and the host bookkeeping between the two."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SamplingParams", "AcceptMode", "DecodeResult", "check_requests", "absorb"]


@dataclass
class SamplingParams:
    """``temperature = 0`` is greedy; ``top_k <= 0`` and ``top_p = 1`` disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"Invalid temperature: expected finite >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int):
            raise ValueError(f"Invalid top_k: expected an int, got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"Invalid top_p: expected 0 < top_p <= 1, got {self.top_p}")


@dataclass(frozen=True)
class AcceptMode:
    """How a batch's steps accept: greedy when every request is; else sampled, with the top-k
    (top-p) tensors passed only when some request of the run truncates that way. Known on the
    host before the first step, and part of a step graph's key: without truncation,
    ``accept_sample`` runs no kept-set pass (two launches instead of three)."""

    greedy: bool
    top_k: bool = False
    top_p: bool = False

    @classmethod
    def of(cls, per_req: list[SamplingParams]) -> AcceptMode:
        if all(sp.temperature <= 0 for sp in per_req):
            return cls(greedy=True)
        return cls(
            greedy=False,
            top_k=any(sp.top_k > 0 for sp in per_req),
            top_p=any(sp.top_p < 1 for sp in per_req),
        )


@dataclass
class DecodeResult:
    tokens: list[list[int]]  # generated tokens per request (stop id included)
    steps: int = 0
    emitted: list[list[int]] = field(default_factory=list)  # per step, per request (0: inactive)
    verified: list[list[int]] = field(default_factory=list)  # tree nodes per step, per request
    grafted: list[int] = field(default_factory=list)  # nodes Graft added per step (batch total)
    time_draft: float = 0.0  # s: draft forwards (drafting and catch-up)
    time_tree: float = 0.0  # s: treeops tree build / prune / graft / accept / compact / table
    time_verify: float = 0.0  # s: target forwards
    time_prefill: float = 0.0
    # The times above are host (perf_counter) times: on a GPU they measure enqueueing, not the
    # work, unless the decoder runs with ``profile=True`` (a device sync at every boundary of the
    # static / graph paths).
    time_host_wait: float = 0.0  # s: blocked on decision events (static/graph path only)
    host_waits: int = 0  # event waits (decision points) taken
    time_decode: float = 0.0  # s: wall time of the decoding loop (the first prefill excluded)
    time_capture: float = 0.0  # s: CUDA-graph warm-up + capture (included in time_decode)
    # s: prefills of requests that took a finished request's row (``max_batch``; included in
    # time_decode; device time on CUDA)
    time_refill: float = 0.0
    time_refill_host: float = 0.0  # s: the host's share of the refills (enqueueing them)
    time_plan: float = 0.0  # s: λ-CAST's host bookkeeping per step (the planner's observe)
    # the full-batch window (``max_batch``): the steps before the first row idled with no
    # request waiting (every step when none did), the loop's wall time and the capture time up
    # to its end, and the tokens it emitted; after it the request list drains, which an engine
    # under steady load never does
    steps_full: int = 0
    time_full: float = 0.0
    capture_full: float = 0.0
    tokens_full: int = 0
    graphs_captured: int = 0
    verify_buckets: list[int] = field(default_factory=list)  # per step (static path)
    draft_buckets: list[list[int]] = field(default_factory=list)  # per step, per draft forward
    catchup_buckets: list[int] = field(default_factory=list)  # per step (0: skipped)
    undersized: int = 0  # steps whose tree exceeded its verify bucket (clamped; must stay 0)
    profiled: bool = False
    # step_graphs: the whole step (draft, tree ops, verify, accept, compact, catch-up) runs as
    # one graph; its time (enqueue; the device time under ``profile``) is counted here, not in
    # time_draft / time_tree / time_verify (those then hold only the host's bookkeeping)
    time_step: float = 0.0
    step_graphs: bool = False
    # λ-CAST: per step, the plan that ran and λ̂ after it: [width, depth, verify, lambda, graft,
    # topk, step_s, tokens] (topk 0: the policy's K; 1: a chain; step_s and tokens: what the
    # planner was handed, the step's measured seconds (0: no measure) and tokens per request)
    plans: list[list[float]] = field(default_factory=list)

    @property
    def accepted_per_step(self) -> list[float]:
        """Mean tokens emitted per active request at each step."""
        out = []
        for row in self.emitted:
            act = [e for e in row if e > 0]
            out.append(sum(act) / max(1, len(act)))
        return out

    @property
    def mean_accepted(self) -> float:
        """Tokens emitted per request-step (1.0 for autoregressive decoding)."""
        tot = sum(sum(r) for r in self.emitted)
        n = sum(sum(1 for e in r if e > 0) for r in self.emitted)
        return tot / max(1, n)

    def stats(self) -> dict[str, Any]:
        """Scalars for a report: tokens, steps, acceptance, the time split and the host waits."""
        ntok = sum(len(t) for t in self.tokens)
        return {
            "tokens": ntok,
            "steps": self.steps,
            "mean_accepted": self.mean_accepted,
            "time_decode_s": self.time_decode,
            "time_prefill_s": self.time_prefill,
            "time_draft_s": self.time_draft,
            "time_tree_s": self.time_tree,
            "time_verify_s": self.time_verify,
            "time_host_wait_s": self.time_host_wait,
            "host_waits": self.host_waits,
            "host_wait_us_per_wait": 1e6 * self.time_host_wait / max(1, self.host_waits),
            "time_capture_s": self.time_capture,
            "time_refill_s": self.time_refill,
            "time_refill_host_s": self.time_refill_host,
            "time_plan_s": self.time_plan,
            "time_step_s": self.time_step,
            "step_graphs": self.step_graphs,
            "graphs_captured": self.graphs_captured,
            "undersized": self.undersized,
            "profiled": self.profiled,
        }


def check_requests(
    prompts, max_new_tokens, sampling
) -> tuple[int, list[int], list[SamplingParams], AcceptMode]:
    """Checked per-request inputs of ``generate``: (B, budgets, SamplingParams each, the
    batch's ``AcceptMode``). A ``ValueError`` names the argument at fault."""
    B = len(prompts)
    if B == 0 or any(len(p) < 1 for p in prompts):
        raise ValueError("Invalid prompts: expected at least one prompt, each of 1+ tokens")
    budget = [max_new_tokens] * B if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(budget) != B:
        raise ValueError(f"Invalid max_new_tokens: expected {B} budgets, got {len(budget)}")
    samp = sampling or SamplingParams()
    per_req = samp if isinstance(samp, list) else [samp] * B
    if len(per_req) != B:
        raise ValueError(f"Invalid sampling: expected {B} SamplingParams, got {len(per_req)}")
    return B, budget, per_req, AcceptMode.of(per_req)


def absorb(res: DecodeResult, rows, cap: int, stop_set, remaining, active, req_of=None) -> int:
    """One step's results, read back from the device, into ``res``. Each row is ``[accept_len,
    bonus, verified nodes, grafted nodes] + accepted path tokens`` (the path's root first).
    Appends the emitted tokens (the path minus its root, then the bonus) to the row's request
    (``req_of[b]``; default the row itself), updates the host's per-row budgets ``remaining``
    and flags ``active``, counts trees of more than ``cap`` nodes as undersized; returns the
    grafted nodes of the batch."""
    emitted, verified, grafted = [], [], 0
    for b, row in enumerate(rows):
        a, bonus, nv = row[0], row[1], row[2]
        emitted.append(a)
        verified.append(nv)
        grafted += row[3]
        if nv > cap:
            res.undersized += 1
        if a == 0:
            continue
        res.tokens[b if req_of is None else req_of[b]].extend(row[5 : 4 + a] + [bonus])
        remaining[b] -= a
        if remaining[b] <= 0 or bonus in stop_set:
            active[b] = False
    res.emitted.append(emitted)
    res.verified.append(verified)
    return grafted

"""The batch decoding loop: draft a tree, verify it with the target, accept, compact.

One step for a batch of B requests (each with its own tree, length and stop condition)::

    tree   = draft tree (build_tree_expand per draft layer, build_tree_emit)   # policy
             [CastGraft: prune at the checkpoints, graft from the AdjacencyTable]
    logits = target(tree)            # kv_append at seq_lens + i, rope at seq_lens + depth,
                                     # tree_attention over prefix + ancestors
    acc    = accept_greedy / accept_sample (stop ids, per-request budget)
    seq_lens = compact_kv(target cache, accepted path)
    draft catch-up over the accepted path; root = acc.bonus

Choices:

* Prefill runs ``prompt[:-1]`` as a chain tree through the same forward (kv_append +
  tree_attention); the prompt's last token is the first step's root, so every emitted token,
  the first included, comes out of ``accept_*``.
* Draft input at a node = (embedding of its token, feature of its parent position): the
  target's final hidden state at the last accepted position for the root, the draft's own output
  hidden for deeper nodes (EAGLE-2).
* Draft KV cache: *recomputed*, not compacted. The nodes the draft saw while drafting are not the
  verified tree's (rerank, prune and graft reorder and add nodes), and EAGLE feeds the draft the
  target's features for accepted tokens anyway. So after each verification the draft runs once
  over the accepted path (root + accepted nodes, a chain of ``accept_len`` tokens) with the
  target's features, writing slots ``seq_lens .. seq_lens + accept_len - 1``; the draft's
  drafting-time K/V beyond that is scratch, overwritten next step. The draft cache length thus
  always equals the target's ``seq_lens``.
* The draft's working tree during a step: node 0 = root, the frontier of draft layer ``l >= 1``
  at nodes ``1 + (l-1)W .. lW`` (W = frontier capacity; unused rows hang off the root with token
  0 and are ignored). Each draft forward computes only the frontier rows (``q_start/q_len``).
* Finished requests stay in the batch as inactive rows (``num_nodes = 0``).

CUDA graphs (``cuda_graphs=True``, DESIGN.md "Dynamic trees and CUDA graphs"): the target's
verification forward, the draft's frontier forwards and the draft catch-up run as CUDA graphs, one
per (kind, batch size, token bucket), captured lazily on first use. The token count of each forward
is padded up to a bucket (``token_buckets``) chosen on the host from the decisions treeops wrote to
pinned memory, read after one event wait per decision point: after each CAST draft layer (width of
the next frontier and whether to go on), after the rerank (verification count) and after
acceptance (accepted lengths, bonus tokens, which requests are done: the catch-up bucket and the
loop's end). EAGLE/chain trees have static sizes and wait only after acceptance. Everything a
graph reads lives in static buffers of ``_StaticBatch`` (paged caches and block tables, seq_lens,
the verification tree, the draft's working tree, frontier inputs); padding nodes beyond
``num_nodes`` are masked out by every op. ``static_shapes=True`` without ``cuda_graphs`` runs the
same bucketed code path eagerly (how the CPU tests check it).

Whole-step graphs (``step_graphs=True``, fixed-shape policies only: autoregressive, chain,
EagleStatic): nothing in such a step depends on the host (frontier width W, depth, verify count N
and the catch-up size N are fixed by the policy), so one CUDA graph per (batch size, greedy or
sampling, number of stop ids) holds the whole step: every draft layer (forward +
``build_tree_expand``), ``build_tree_emit``, the target's verification, acceptance,
``compact_kv``, the catch-up forward (bucket N: padding beyond ``accept_len`` is masked), the state
updates for the next step (root, root feature, seq_lens, remaining budgets, active mask, all
static buffers of ``_StaticBatch`` updated in place) and the non-blocking copy of the step's
results into the pinned host buffer. The host fills the sampling uniforms (drawn from the CPU
generator as on the eager path) into a static buffer before each replay, replays, and waits on
one event. ``_step_body`` is that step as a Python function over static buffers; with
``static_shapes=True`` and no ``cuda_graphs`` it runs eagerly (the CPU tests).

Workarounds of op gaps (see the final report / README): ``kv_append`` has no row offset, so the
draft's frontier-only write shifts its ``seq_lens`` base by ``q_start`` and passes depths relative
to it (possibly negative).
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from ..accept import accept_greedy, accept_sample
from ..build_tree import Cast, DraftState, EagleStatic, build_tree_emit, build_tree_expand
from ..compact_kv import compact_kv
from ..graft import AdjacencyTable, PruneCheckpoints, RankTemplate, graft, prune
from ..cost_table import CostTable
from ..tree import Tree, anc_words, bit_value
from .model import Draft, PagedKV, Target, chain_tree

__all__ = [
    "POLICIES",
    "SamplingParams",
    "DecodeResult",
    "Decoder",
    "synthetic_cost_table",
    "token_buckets",
    "bucket_for",
]

POLICIES = ("autoregressive", "chain", "EagleStatic", "Cast", "CastGraft")


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


def _absorb(res, rows, head, cap, stop_set, remaining, active) -> int:
    """One step's results from the host copy into ``res``: each row is ``[accept_len, bonus,
    verified nodes, (grafted,)] + accepted path tokens`` (``head`` leading fields). Appends the
    emitted tokens (the path minus its root, then the bonus), updates the per-request budgets
    and active flags, counts trees larger than ``cap`` as undersized; returns the grafted sum."""
    emitted, verified, grafted = [], [], 0
    for b, row in enumerate(rows):
        a, bonus, nv = row[0], row[1], row[2]
        emitted.append(a)
        verified.append(nv)
        grafted += row[3] if head > 3 else 0
        if nv > cap:
            res.undersized += 1
        if a == 0:
            continue
        res.tokens[b].extend(row[head + 1 : head + a] + [bonus])
        remaining[b] -= a
        if remaining[b] <= 0 or bonus in stop_set:
            active[b] = False
    res.emitted.append(emitted)
    res.verified.append(verified)
    return grafted


def _requests(prompts, max_new_tokens, sampling) -> tuple[int, list[int], list, bool]:
    """Checked per-request inputs of ``generate``: (B, budgets, SamplingParams each, all greedy)."""
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
    return B, budget, per_req, all(sp.temperature <= 0 for sp in per_req)


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
    # work, unless the decoder runs with ``profile=True`` (a device sync at every boundary).
    time_host_wait: float = 0.0  # s: blocked on decision events (static/graph path only)
    host_waits: int = 0  # event waits (decision points) taken
    time_decode: float = 0.0  # s: wall time of the decoding loop (prefill excluded)
    time_capture: float = 0.0  # s: CUDA-graph warm-up + capture (included in time_decode)
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
            "time_step_s": self.time_step,
            "step_graphs": self.step_graphs,
            "graphs_captured": self.graphs_captured,
            "undersized": self.undersized,
            "profiled": self.profiled,
        }


TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def token_buckets(capacity: int) -> list[int]:
    """Token counts a forward of at most ``capacity`` tokens per request is padded up to: the
    members of ``TOKEN_BUCKETS`` below ``capacity``, then ``capacity`` itself."""
    if capacity < 1:
        raise ValueError(f"Invalid value of capacity: expected >= 1, got {capacity}")
    return [b for b in TOKEN_BUCKETS if b < capacity] + [capacity]


def bucket_for(n: int, capacity: int) -> int:
    """The smallest bucket of ``token_buckets(capacity)`` holding ``n`` tokens (``n`` is clamped
    to ``[1, capacity]``): never smaller than ``n`` while ``n <= capacity``."""
    n = min(max(int(n), 1), capacity)
    for b in token_buckets(capacity):
        if b >= n:
            return b
    return capacity  # unreachable: capacity is the last bucket


def synthetic_cost_table(n_max: int = 64) -> CostTable:
    """A synthetic cost table with an H200-like shape (flat while weight-bound, then linear in
    tokens; the draft costs a quarter), for CAST without a calibration run."""

    def target(B: int, c: int, n: int) -> float:
        return 100.0 + 0.02 * B * c / 1024 + max(0, B * n - 32) * 1.0

    def draft(B: int, c: int, n: int) -> float:
        return target(B, c, n) / 4

    return CostTable.from_functions(
        target, draft, batch_sizes=[1, 2, 4, 8, 16, 32, 64], L=256, M=4, n_max=n_max,
        meta={"gpu": "synthetic", "model": "decoder"},
    )  # fmt: skip


class Decoder:
    """Speculative decoder over a ``Target`` and a ``Draft``.

    Args:
        target, draft: the models (the draft may be None for ``autoregressive``).
        policy: one of ``POLICIES``.
        depth, topk, budget: EAGLE sizes (``chain`` uses ``depth`` with topk 1, budget depth+1;
            ``Cast`` uses them as max_depth, topk = max_width, capacity).
        cast: a ``treeops.Cast`` to use instead (``Cast``/``CastGraft``).
        cost_table: CAST's table (default ``synthetic_cost_table``); C1, C2, C3, R: thresholds.
        checkpoints, template, adjacency_k: Graft's pruning checkpoints, rank template and
            successor-table width (``CastGraft``).
        page_size: KV cache page size.
        cuda_graphs: run the target's verification and the draft's forwards as CUDA graphs, one
            per (batch size, token bucket), captured on first use (CUDA models only; a
            ``ValueError`` otherwise). Prefill stays eager.
        static_shapes: the graph path's code (static buffers, token buckets, decisions read
            from pinned memory) without capturing; default ``cuda_graphs``. On the CPU it is how
            the tests check that path.
        profile: synchronise the device at every timing boundary so that ``time_draft``,
            ``time_tree``, ``time_verify`` and ``time_host_wait`` split the GPU time (slower;
            off, the host waits are measured and the rest is enqueue time).
        check_buckets: check on the host that no forward's bucket is smaller than its tokens
            (syncs; a ``RuntimeError`` if one is). Tests use it.
        step_graphs: capture ONE CUDA graph per (batch size, greedy/sampling, number of stop
            ids) for a whole decoding step (all draft layers and tree builds, verification,
            acceptance, compaction, catch-up, the next step's state and the copy of the results
            to pinned memory; see the module docstring), instead of one graph per forward with
            the tree ops eager between them. Opt-in (default False: the per-forward path is
            unchanged). Needs ``cuda_graphs=True`` (or ``static_shapes=True``, which runs the
            same step body eagerly: how the CPU tests check it) and a fixed-shape policy
            (``autoregressive``, ``chain``, ``EagleStatic``): ``Cast``/``CastGraft`` decide
            sizes on the host during the step and raise a ``ValueError`` naming
            ``step_graphs`` (no silent fallback). The catch-up runs at the full tree capacity N
            instead of the bucket of the longest accepted path. Host waits: one per step.
    """

    def __init__(
        self,
        target: Target,
        draft: Draft | None = None,
        policy: str = "EagleStatic",
        *,
        depth: int = 4,
        topk: int = 4,
        budget: int = 16,
        cast: Cast | None = None,
        cost_table: CostTable | None = None,
        C1: float = 0.3,
        C2: float = 0.2,
        C3: float = 0.1,
        R: int = 4,
        checkpoints: PruneCheckpoints | None = None,
        template: RankTemplate | None = None,
        adjacency_k: int = 8,
        page_size: int = 16,
        cuda_graphs: bool = False,
        static_shapes: bool | None = None,
        profile: bool = False,
        check_buckets: bool = False,
        step_graphs: bool = False,
    ):
        if policy not in POLICIES:
            raise ValueError(f"Invalid policy: expected one of {POLICIES}, got {policy!r}")
        if policy != "autoregressive" and draft is None:
            raise ValueError(f"policy {policy!r} needs a draft model")
        self.target, self.name = target, policy
        self.draft = None if policy == "autoregressive" else draft  # AR needs no draft pass
        self.page_size = page_size
        self.policy: EagleStatic | Cast | None
        if policy == "autoregressive":
            self.policy = None
        elif policy == "chain":
            self.policy = EagleStatic(depth=depth, topk=1, budget=depth + 1)
        elif policy == "EagleStatic":
            self.policy = EagleStatic(depth=depth, topk=topk, budget=budget)
        else:
            if cast is None:
                table = cost_table or synthetic_cost_table(max(64, budget, topk))
                cast = Cast(
                    C1=C1, C2=C2, C3=C3, R=R, cost_table=table, topk=topk, max_width=topk,
                    max_depth=depth, capacity=budget,
                )  # fmt: skip
            self.policy = cast
        self.graft = policy == "CastGraft"
        self.checkpoints = checkpoints or PruneCheckpoints()
        self.template = template or RankTemplate.default()
        self.adjacency_k = adjacency_k
        self.table: AdjacencyTable | None = None
        self.cuda_graphs = bool(cuda_graphs)
        dev = target.model.embed_tokens.weight.device
        if self.cuda_graphs:
            bad = [
                f"{name} on {m_dev}"
                for name, m_dev in (
                    ("target", dev),
                    ("draft", None if self.draft is None else next(self.draft.parameters()).device),
                )
                if m_dev is not None and m_dev.type != "cuda"
            ]
            if bad or not torch.cuda.is_available():
                raise ValueError(
                    "Invalid value of cuda_graphs: True needs the target and draft on a CUDA "
                    f"device, got {', '.join(bad) or 'no CUDA available'}; use cuda_graphs=False "
                    "(the default) on the CPU"
                )
        self.static = self.cuda_graphs if static_shapes is None else bool(static_shapes)
        if self.cuda_graphs and not self.static:
            raise ValueError("Invalid value of static_shapes: cuda_graphs=True needs it True")
        self.step_graphs = bool(step_graphs)
        if self.step_graphs and policy in ("Cast", "CastGraft"):
            raise ValueError(
                f"Invalid value of step_graphs: True needs a fixed-shape policy (autoregressive, "
                f"chain, EagleStatic), got policy {policy!r}, whose sizes are decided on the host "
                "during a step; use step_graphs=False (per-forward graphs)"
            )
        if self.step_graphs and not self.static:
            raise ValueError(
                "Invalid value of step_graphs: True needs cuda_graphs=True (or static_shapes=True "
                "to run the whole-step body eagerly)"
            )
        self.profile = bool(profile)
        self.check_buckets = bool(check_buckets)
        self._batches: dict[int, _StaticBatch] = {}
        self._pool: Any = None

    # ------------------------------------------------------------------ sizes
    @property
    def capacity(self) -> int:
        """N: verification tree capacity (root included)."""
        return 1 if self.policy is None else self.policy.capacity

    @property
    def draft_capacity(self) -> int:
        """Nd: the draft's working tree (root + a frontier per draft layer after the first)."""
        if self.policy is None:
            return 1
        W, D = self.policy.max_width, self.policy.max_depth
        return 1 + max(D - 1, 1) * W

    # --------------------------------------------------------------- generate
    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int | list[int] = 32,
        *,
        stop_ids: list[int] | None = None,
        sampling: SamplingParams | list[SamplingParams] | None = None,
        generator: torch.Generator | None = None,
    ) -> DecodeResult:
        """Decode every prompt (a list of token ids, length >= 1) until ``max_new_tokens`` (an
        int or one per request) or a stop id (kept in the output). ``sampling``: one
        ``SamplingParams`` for the batch or one per request (temperature 0 rows are greedy);
        uniforms come from ``generator`` (CPU), one per tree node per step."""
        # Triton launches, events and graph captures use the current device: make it the model's
        with torch.cuda.device(self._dev) if self._dev.type == "cuda" else nullcontext():
            if self.step_graphs:
                return self._generate_step(prompts, max_new_tokens, stop_ids, sampling, generator)
            if self.static:
                return self._generate_static(prompts, max_new_tokens, stop_ids, sampling, generator)
            return self._generate_eager(prompts, max_new_tokens, stop_ids, sampling, generator)

    @torch.no_grad()
    def _generate_eager(self, prompts, max_new_tokens, stop_ids, sampling, generator):
        tgt, dft = self.target, self.draft
        dev = tgt.model.embed_tokens.weight.device
        B, budget, per_req, greedy = _requests(prompts, max_new_tokens, sampling)
        g = generator or torch.Generator().manual_seed(0)
        N, Nd = self.capacity, self.draft_capacity
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.int32, device=dev)
        max_len = int(lens.max()) + max(budget) + N + Nd + 1
        tkv = tgt.make_cache(B, max_len, page_size=self.page_size, seed=1)
        dkv = None if dft is None else dft.make_cache(B, max_len, page_size=self.page_size, seed=2)
        stops = None
        if stop_ids:
            stops = torch.tensor(stop_ids, dtype=torch.int64, device=dev)
        res = DecodeResult(tokens=[[] for _ in range(B)])

        # ---- prefill prompt[:-1] as a chain; the last prompt token is the first root
        t0 = time.perf_counter()
        seq_lens = lens - 1
        root, root_feat = self._prefill(prompts, seq_lens, tkv, dkv)
        res.time_prefill = time.perf_counter() - t0

        remaining = torch.tensor(budget, dtype=torch.int64, device=dev)
        active = remaining > 0
        temperature = torch.tensor(
            [max(0.0, sp.temperature) for sp in per_req], dtype=torch.float32, device=dev
        )
        top_k = torch.tensor([sp.top_k for sp in per_req], dtype=torch.int32, device=dev)
        top_p = torch.tensor([sp.top_p for sp in per_req], dtype=torch.float32, device=dev)
        state: DraftState | None = None
        rows = torch.arange(B, device=dev)
        host_remaining = list(budget)
        host_active = [m > 0 for m in budget]
        stop_set = set(int(x) for x in stop_ids or ())
        t_loop = time.perf_counter()
        while any(host_active):
            root = torch.where(active, root, 0)
            # ---- draft
            if self.policy is None:
                par = torch.full((B, 1), -1, dtype=torch.int32, device=dev)
                tree = Tree.from_parents(par, active.to(torch.int32), root[:, None].contiguous())
            else:
                tree, state = self._draft_tree(root, root_feat, seq_lens, active, dkv, state, res)
            # ---- verify
            t0 = time.perf_counter()
            logits, h = tgt(tree.tokens, tkv, seq_lens, tree)
            res.time_verify += time.perf_counter() - t0
            # ---- accept, learn successors, compact
            t0 = time.perf_counter()
            kk = self.adjacency_k if self.table is not None else 0
            mnt = remaining.clamp(min=1)
            if greedy:
                acc = accept_greedy(tree, logits, stop_ids=stops, max_new_tokens=mnt, topk_ids=kk)
            else:
                u = torch.rand(B, N, generator=g).to(dev)
                acc = accept_sample(
                    tree, logits, temperature, top_k, top_p, u,
                    stop_ids=stops, max_new_tokens=mnt, topk_ids=kk,
                )  # fmt: skip
            if self.table is not None:
                self.table.update(tree, topk_ids=acc.topk)
            new_lens = compact_kv(
                tkv.k, tkv.v, tkv.block_table, seq_lens, tree, acc.accepted, acc.accept_len
            )
            res.time_tree += time.perf_counter() - t0
            # ---- emitted tokens (host bookkeeping): one read of the batch's lengths, bonus
            # tokens, tree sizes and accepted paths
            alen = acc.accept_len.long()
            path = acc.accepted.long().clamp(min=0)
            path_tok = tree.tokens.gather(1, path)  # [B, N]
            heads = (alen, acc.bonus, tree.num_nodes)
            host = torch.cat([x[:, None] for x in heads] + [path_tok], 1).tolist()
            _absorb(res, host, 3, N, stop_set, host_remaining, host_active)
            res.steps += 1
            # ---- draft catch-up over the accepted path, with the target's features
            j = torch.arange(N, device=dev)[None, :]
            on_path = j < alen[:, None]
            path_h = h[rows[:, None], path]  # [B, N, H]: target feature at each path node
            if dft is not None:
                t0 = time.perf_counter()
                feats = torch.cat([root_feat[:, None], path_h[:, :-1]], 1)
                ctok = torch.where(on_path, path_tok, 0)
                dft(tgt, ctok, feats, dkv, seq_lens, chain_tree(ctok, alen.to(torch.int32)))
                res.time_draft += time.perf_counter() - t0
            last = (alen - 1).clamp(min=0)
            root_feat = torch.where(active[:, None], path_h[rows, last], root_feat)
            seq_lens = torch.where(active, new_lens, seq_lens)
            root = torch.where(active, acc.bonus, root)
            remaining = remaining - alen
            done = remaining <= 0
            if stops is not None:
                done |= (acc.bonus[:, None] == stops[None, :]).any(1)
            active = active & ~done
        res.time_decode = time.perf_counter() - t_loop
        return res

    # ------------------------------------------------------------------ draft
    def _draft_tree(self, root, root_feat, seq_lens, active, dkv, state, res):
        pol, tgt, dft = self.policy, self.target, self.draft
        assert pol is not None and dft is not None
        dev = root.device
        B = root.shape[0]
        W, K, Nd = pol.max_width, pol.topk, self.draft_capacity
        C = W * K
        H = tgt.cfg.hidden_size
        if state is None:
            state = DraftState.new(pol, root, seq_lens, active)
        else:
            state.reset(root, seq_lens, active)
        parents = torch.zeros(B, Nd, dtype=torch.int32, device=dev)
        tokens = torch.zeros(B, Nd, dtype=torch.int64, device=dev)
        tokens[:, 0] = root
        hid = torch.zeros(B, Nd, H, dtype=root_feat.dtype, device=dev)
        act = active.to(torch.int32)

        def draft_fn(st: DraftState) -> torch.Tensor:
            i = st.layer
            if i == 0:
                q_start = 0
                num = act
                feats = torch.zeros(B, W, H, dtype=hid.dtype, device=dev)
                feats[:, 0] = root_feat
                q_len = act
            else:
                q_start = 1 + (i - 1) * W
                c = st.frontier.long()  # [B, W] candidate index in layer i-1, -1 = unused
                rp = ((c - (i - 1) * C) // K).clamp(min=0)
                pnode = torch.zeros_like(rp) if i == 1 else 1 + (i - 2) * W + rp
                pnode = torch.where(c >= 0, pnode, 0)
                parents[:, q_start : q_start + W] = pnode.to(torch.int32)
                tokens[:, q_start : q_start + W] = st.frontier_tokens
                feats = hid[torch.arange(B, device=dev)[:, None], pnode]
                num = act * (1 + i * W)
                q_len = act * W
            tree = Tree.from_parents(parents, num.to(torch.int32), tokens)
            qs = torch.full((B,), q_start, dtype=torch.int32, device=dev)
            logits, h = dft(tgt, st.frontier_tokens, feats, dkv, seq_lens, tree, qs, q_len)
            if i == 0:
                hid[:, 0] = h[:, 0]
            else:
                hid[:, q_start : q_start + W] = h
            return logits.contiguous()

        keep = self.checkpoints.start(B, dev) if self.graft else None
        while True:
            t0 = time.perf_counter()
            logits = draft_fn(state)
            t1 = time.perf_counter()
            build_tree_expand(logits, state, pol)
            stop_now = False
            if keep is not None:
                best = state.frontier_scores.max(1).values.float().contiguous()
                stop = self.checkpoints.check(state.layer - 1, best, keep)
                # one request: stop drafting once pruned; batched: draft on, prune per request
                stop_now = B == 1 and bool(stop[0])
            more = state.wants_next_layer() if pol.is_cast else state.layer < pol.depth
            res.time_draft += t1 - t0
            res.time_tree += time.perf_counter() - t1
            if stop_now or not more or state.layer >= pol.max_depth:
                break
        t0 = time.perf_counter()
        tree = build_tree_emit(state, pol)
        if keep is not None:
            verify = tree.num_nodes.clone()
            pruned = prune(tree, keep)
            tree = graft(pruned, self.table, self.template, budget=verify)
            res.grafted.append(int((tree.num_nodes - pruned.num_nodes).sum()))
        res.time_tree += time.perf_counter() - t0
        return tree, state

    def _prefill(self, prompts, seq_lens, tkv, dkv) -> tuple[torch.Tensor, torch.Tensor]:
        """Every request's ``prompt[:-1]`` through the target (and the draft) as a chain at
        ``seq_lens`` [B] (= prompt lengths - 1); warms Graft's table. Returns the first roots
        (the last prompt tokens) [B] int64 and their features [B, H] (the target's hidden state
        at the token before; 0 for a one-token prompt)."""
        tgt, dft = self.target, self.draft
        dev, B = seq_lens.device, len(prompts)
        root = torch.tensor([p[-1] for p in prompts], dtype=torch.int64, device=dev)
        root_feat = torch.zeros(
            B, tgt.cfg.hidden_size, dtype=tgt.model.embed_tokens.weight.dtype, device=dev
        )
        if self.graft:
            self.table = AdjacencyTable(tgt.cfg.vocab_size, k=self.adjacency_k, device=dev)
        P = max(len(p) for p in prompts) - 1
        if P > 0:
            ptok = torch.zeros(B, P, dtype=torch.int64, device=dev)
            for b, p in enumerate(prompts):
                ptok[b, : len(p) - 1] = torch.tensor(p[:-1], dtype=torch.int64)
            plen = seq_lens.clone()
            chain = chain_tree(ptok, plen)
            zero = torch.zeros(B, dtype=torch.int32, device=dev)
            logits, h = tgt(ptok, tkv, zero, chain)
            if dft is not None:
                feats = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], 1)
                dft(tgt, ptok, feats, dkv, zero, chain)
            last = (plen.long() - 1).clamp(min=0)
            root_feat = torch.where(
                (plen > 0)[:, None], h[torch.arange(B, device=dev), last], root_feat
            )
            if self.table is not None:
                self.table.warm_start(ptok, logits.contiguous(), plen)
        return root, root_feat

    # ============================================================ static / CUDA-graph path
    def _clock(self) -> float:
        """A timing boundary: ``perf_counter``, after a device sync under ``profile``."""
        if self.profile and self._dev.type == "cuda":
            torch.cuda.synchronize(self._dev)
        return time.perf_counter()

    def _wait(self, res: DecodeResult, fn):
        """One decision point: ``fn()`` waits on one event and reads the pinned buffer."""
        t0 = self._clock()
        out = fn()
        res.time_host_wait += time.perf_counter() - t0
        res.host_waits += 1
        return out

    def _batch(self, B: int, max_len: int) -> _StaticBatch:
        sb = self._batches.get(B)
        if sb is None or sb.max_len < max_len:
            cap = 256
            while cap < max_len:
                cap *= 2
            self._batches.pop(B, None)  # its graphs read the old caches: drop them
            sb = _StaticBatch(self, B, cap)
            self._batches[B] = sb
        return sb

    def _replay(self, sb: _StaticBatch, key: tuple, body, res: DecodeResult):
        """Run ``body`` (a forward over static buffers) as the CUDA graph of ``key``, capturing it
        on first use (two eager warm-up calls on a side stream first: Triton compiles there);
        eagerly without ``cuda_graphs``. Returns the body's outputs (static while the graph
        lives; consume them before the next replay of any graph: the pool is shared)."""
        if not self.cuda_graphs:
            return body()
        ent = sb.graphs.get(key)
        if ent is None:
            t0 = time.perf_counter()
            cur = torch.cuda.current_stream(self._dev)
            try:
                s = torch.cuda.Stream(self._dev)
                s.wait_stream(cur)
                with torch.cuda.stream(s):
                    for _ in range(2):
                        body()
                cur.wait_stream(s)
                if self._pool is None:
                    self._pool = torch.cuda.graph_pool_handle()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=self._pool):
                    out = body()
            except Exception as e:
                # a failed capture_end raises before torch.cuda.graph restores the stream
                torch.cuda.set_stream(cur)
                raise RuntimeError(
                    f"treeops decoder: CUDA-graph capture of the {key[0]} forward failed "
                    f"(policy {self.name}, B={sb.B}, {key[1]} tokens per request): "
                    f"{type(e).__name__}: {e}. Something in that forward syncs with the host or "
                    "allocates outside the graph; cuda_graphs=False runs it eagerly."
                ) from e
            ent = sb.graphs[key] = (g, out)
            res.time_capture += time.perf_counter() - t0
            res.graphs_captured += 1
        g, out = ent
        g.replay()
        return out

    @torch.no_grad()
    def _generate_static(self, prompts, max_new_tokens, stop_ids, sampling, generator):
        dft = self.draft
        dev = self._dev
        B, budget, per_req, greedy = _requests(prompts, max_new_tokens, sampling)
        g = generator or torch.Generator().manual_seed(0)
        N, Nd = self.capacity, self.draft_capacity
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.int32, device=dev)
        max_len = max(len(p) for p in prompts) + max(budget) + N + Nd + 1
        sb = self._batch(B, max_len)
        tkv, dkv = sb.tkv, sb.dkv
        stops = None
        stop_set = set(int(x) for x in stop_ids or ())
        if stop_ids:
            stops = torch.tensor(stop_ids, dtype=torch.int64, device=dev)
        res = DecodeResult(tokens=[[] for _ in range(B)], profiled=self.profile)

        # ---- prefill (eager), as in generate
        t0 = self._clock()
        seq_lens = sb.seq_lens
        seq_lens.copy_(lens - 1)
        root, root_feat = self._prefill(prompts, seq_lens, tkv, dkv)
        if dev.type == "cuda":  # the loop's clock must not start with prefill still queued
            torch.cuda.synchronize(dev)
        res.time_prefill = self._clock() - t0

        t_loop = time.perf_counter()
        remaining = torch.tensor(budget, dtype=torch.int64, device=dev)
        active = remaining > 0
        host_active = [m > 0 for m in budget]
        host_remaining = list(budget)
        temperature = torch.tensor(
            [max(0.0, sp.temperature) for sp in per_req], dtype=torch.float32, device=dev
        )
        top_k = torch.tensor([sp.top_k for sp in per_req], dtype=torch.int32, device=dev)
        top_p = torch.tensor([sp.top_p for sp in per_req], dtype=torch.float32, device=dev)
        rows = torch.arange(B, device=dev)
        vin = sb.vin
        while any(host_active):
            root = torch.where(active, root, 0)
            # ---- draft into sb.vin (its size on the host: n = the verify bucket)
            if self.policy is None:
                t0 = self._clock()
                vin.tokens[:, 0] = root
                vin.num_nodes.copy_(active.to(torch.int32))
                n = 1
                res.time_tree += self._clock() - t0
            else:
                n = self._draft_static(sb, root, root_feat, active, res)
            res.verify_buckets.append(n)
            if self.check_buckets and int(vin.num_nodes.max()) > n:
                raise RuntimeError(
                    f"verify bucket {n} < num_nodes {vin.num_nodes.tolist()} (policy {self.name})"
                )
            # ---- verify: the graph of bucket n
            t0 = self._clock()
            tree, logits, h = self._replay(sb, ("verify", n), sb.verify_body(n), res)
            t1 = self._clock()
            res.time_verify += t1 - t0
            # ---- accept, learn successors, compact (eager treeops ops: no host sync)
            kk = self.adjacency_k if self.table is not None else 0
            mnt = remaining.clamp(min=1)
            if greedy:
                acc = accept_greedy(tree, logits, stop_ids=stops, max_new_tokens=mnt, topk_ids=kk)
            else:
                u = torch.rand(B, N, generator=g)[:, :n].contiguous().to(dev)
                acc = accept_sample(
                    tree, logits, temperature, top_k, top_p, u,
                    stop_ids=stops, max_new_tokens=mnt, topk_ids=kk,
                )  # fmt: skip
            if self.table is not None:
                self.table.update(tree, topk_ids=acc.topk)
            new_lens = compact_kv(
                tkv.k, tkv.v, tkv.block_table, seq_lens, tree, acc.accepted, acc.accept_len
            )
            alen = acc.accept_len.long()
            path = acc.accepted.long().clamp(min=0)  # [B, n]
            path_tok = tree.tokens.gather(1, path)
            path_h = h[rows[:, None], path]  # [B, n, H]
            remaining = remaining - alen
            done = remaining <= 0
            if stops is not None:
                done |= (acc.bonus[:, None] == stops[None, :]).any(1)
            new_active = active & ~done
            # one pinned copy of what the host needs: accepted lengths, bonus, verified sizes,
            # grafted counts, the emitted path tokens
            # (contiguous [B, 4 + n] views of flat buffers: with a bucket n < N, column slices
            # of [B, 4 + N] buffers made copy_ go through temporaries, an extra device copy and
            # a host staging buffer that is not pinned, which can block the host)
            pack = sb.pack[: B * (4 + n)].view(B, 4 + n)
            host_pack = sb.host_pack[: B * (4 + n)].view(B, 4 + n)
            heads = (alen, acc.bonus, vin.num_nodes, sb.grafted)
            torch.cat([x[:, None] for x in heads] + [path_tok], 1, out=pack)
            host_pack.copy_(pack, non_blocking=True)
            if dev.type == "cuda":
                sb.pack_event.record()
            res.time_tree += self._clock() - t1

            host = self._wait(res, lambda hp=host_pack: sb.read_pack(hp))
            t0 = self._clock()
            grafted = _absorb(res, host, 4, n, stop_set, host_remaining, host_active)
            emitted_row = res.emitted[-1]
            if self.graft:
                res.grafted.append(grafted)
            res.steps += 1
            res.time_tree += self._clock() - t0
            # ---- draft catch-up over the accepted path: the graph of bucket max(accept_len)
            amax = max(emitted_row)
            if dft is not None and amax > 0:
                t0 = self._clock()
                rc = bucket_for(amax, N)
                on_path = sb.node_idx[None, :n] < alen[:, None]
                torch.mul(path_tok, on_path, out=sb.c_tok[:, :n])  # 0 past the path
                sb.c_feat[:, 0] = root_feat
                sb.c_feat[:, 1:n] = path_h[:, : n - 1]
                sb.c_len.copy_(acc.accept_len)
                self._replay(sb, ("catchup", rc), sb.catchup_body(rc), res)
                res.catchup_buckets.append(rc)
                res.time_draft += self._clock() - t0
            else:
                res.catchup_buckets.append(0)
            t0 = self._clock()
            last = (alen - 1).clamp(min=0)
            root_feat = torch.where(active[:, None], path_h[rows, last], root_feat)
            torch.where(active, new_lens, seq_lens, out=seq_lens)
            root = torch.where(active, acc.bonus, root)
            active = new_active
            res.time_tree += self._clock() - t0
        if dev.type == "cuda":  # ... nor end with the last step's work still queued
            torch.cuda.synchronize(dev)
        res.time_decode = time.perf_counter() - t_loop
        return res

    def _draft_static(self, sb: _StaticBatch, root, root_feat, active, res: DecodeResult) -> int:
        """Draft one step's tree into ``sb.vin``; returns the verify bucket. The draft's working
        tree ``sb.dtree`` is updated in place layer by layer (depth, anc, num_nodes: what the
        forwards read; its parents, tokens and sibling links are not kept)."""
        pol, dft = self.policy, self.draft
        assert pol is not None and dft is not None
        B = root.shape[0]
        W = pol.max_width
        N = self.capacity
        t0 = self._clock()
        if sb.state is None:
            sb.state = DraftState.new(pol, root, sb.seq_lens, active)
        else:
            sb.state.reset(root, sb.seq_lens, active)
        st = sb.state
        act = active.to(torch.int32)
        torch.addcmul(sb.meta_base, sb.meta_coef, act, out=sb.layer_meta)
        sb.d_meta.copy_(sb.layer_meta[0])
        sb.d_feat[:, 0] = root_feat
        keep = self.checkpoints.start(B, self._dev) if self.graft else None
        if self.graft:
            sb.grafted.zero_()
        R = 1
        res.time_tree += self._clock() - t0
        buckets = []
        while True:
            i = st.layer
            t0 = self._clock()
            if i > 0:  # the frontier of layer i: nodes q_start .. q_start + W - 1
                qs = sb.frontier_inputs(st.frontier, i, W)
                if pol.is_cast:
                    torch.mul(act, R, out=sb.d_qlen)
            else:
                qs = 0
            t1 = self._clock()
            buckets.append(R)
            self._replay(sb, ("draft", R), sb.draft_body(R), res)
            sb.hid[:, qs : qs + R] = sb.d_h[:, :R]
            t2 = self._clock()
            waited = res.time_host_wait
            build_tree_expand(sb.d_logits, st, pol)
            stop_now = False
            if keep is not None:
                best = st.frontier_scores.max(1).values.float().contiguous()
                stop = self.checkpoints.check(st.layer - 1, best, keep)
                if B == 1:  # one request: stop drafting once pruned (a host read)
                    stop_now = bool(self._wait(res, lambda stop=stop: bool(stop[0])))
            t3 = self._clock()
            res.time_draft += t2 - t1
            # the prune-flag wait inside t2..t3 is host-wait time, not tree time
            res.time_tree += (t1 - t0) + (t3 - t2) - (res.time_host_wait - waited)
            if stop_now:
                break
            if pol.is_cast:
                # one event wait: the depth flag and the next frontier's width
                more, width = self._wait(
                    res, lambda: (st.wants_next_layer(), st.width(st.layer - 1))
                )
                R = bucket_for(width, W)
            else:
                more, R = st.layer < pol.depth, W
            if not more or st.layer >= pol.max_depth:
                break
            if self.check_buckets and int(st.frontier_valid.sum(1).max()) > R:
                raise RuntimeError(
                    f"draft bucket {R} < valid frontier rows {st.frontier_valid.sum(1).tolist()}"
                )
        res.draft_buckets.append(buckets)
        t0 = self._clock()
        if keep is not None:
            tree = build_tree_emit(st, pol, out=sb.emit_buf)
            verify = tree.num_nodes.clone()
            pruned = prune(tree, keep)
            graft(pruned, self.table, self.template, budget=verify, out=sb.vin)
            sb.grafted.copy_(sb.vin.num_nodes - pruned.num_nodes)
        else:
            build_tree_emit(st, pol, out=sb.vin)
        res.time_tree += self._clock() - t0
        if not pol.is_cast:
            return N
        return bucket_for(self._wait(res, st.verify_count), N)

    # ============================================================ whole-step graphs
    @torch.no_grad()
    def _generate_step(self, prompts, max_new_tokens, stop_ids, sampling, generator):
        """``generate`` with ``step_graphs``: one replay (or, without ``cuda_graphs``, one eager
        call of ``_step_body``) and one event wait per step."""
        dev = self._dev
        B, budget, per_req, greedy = _requests(prompts, max_new_tokens, sampling)
        g = generator or torch.Generator().manual_seed(0)
        N, Nd = self.capacity, self.draft_capacity
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.int32, device=dev)
        max_len = max(len(p) for p in prompts) + max(budget) + N + Nd + 1
        sb = self._batch(B, max_len)
        sb.step_buffers()
        stops = None
        stop_set: set[int] = set()
        if stop_ids:
            stops = sb.stop_buf(len(stop_ids))
            stops.copy_(torch.tensor(stop_ids, dtype=torch.int64))
            stop_set = set(int(x) for x in stop_ids)
        res = DecodeResult(tokens=[[] for _ in range(B)], profiled=self.profile, step_graphs=True)

        # ---- prefill (eager), as in generate; its outputs go into the step's static buffers
        t0 = self._clock()
        sb.seq_lens.copy_(lens - 1)
        root, root_feat = self._prefill(prompts, sb.seq_lens, sb.tkv, sb.dkv)
        sb.root.copy_(root)
        sb.root_feat.copy_(root_feat)
        sb.remaining.copy_(torch.tensor(budget, dtype=torch.int64))
        torch.gt(sb.remaining, 0, out=sb.active)
        sb.temperature.copy_(torch.tensor([max(0.0, sp.temperature) for sp in per_req]))
        sb.top_k.copy_(torch.tensor([sp.top_k for sp in per_req], dtype=torch.int32))
        sb.top_p.copy_(torch.tensor([sp.top_p for sp in per_req], dtype=torch.float32))
        if self.policy is not None and sb.state is None:  # allocated outside any capture
            sb.state = DraftState.new(self.policy, sb.root, sb.seq_lens, sb.active)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        res.time_prefill = self._clock() - t0

        t_loop = time.perf_counter()
        host_active = [m > 0 for m in budget]
        host_remaining = list(budget)
        key = ("step", greedy, 0 if stops is None else stops.numel())
        W = 0 if self.policy is None else self.policy.max_width
        layers = [] if self.policy is None else [1] + [W] * (self.policy.depth - 1)
        while any(host_active):
            t0 = self._clock()
            if not greedy:  # the eager path's draw, copied into the static buffer
                sb.u_host.copy_(torch.rand(B, N, generator=g))
                sb.u.copy_(sb.u_host, non_blocking=True)
            copied = self._replay_step(sb, key, greedy, stops, res)
            host_pack = sb.host_pack.view(B, 4 + N)
            if not copied:  # (capture fallback: the results' copy after the replay)
                host_pack.copy_(sb.pack.view(B, 4 + N), non_blocking=True)
            if dev.type == "cuda":
                sb.pack_event.record()
            res.time_step += self._clock() - t0

            host = self._wait(res, lambda hp=host_pack: sb.read_pack(hp))
            t0 = self._clock()
            _absorb(res, host, 4, N, stop_set, host_remaining, host_active)
            res.verify_buckets.append(N)
            if self.policy is not None:
                res.draft_buckets.append(list(layers))
            res.catchup_buckets.append(N if self.draft is not None else 0)
            res.steps += 1
            res.time_tree += self._clock() - t0
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        res.time_decode = time.perf_counter() - t_loop
        return res

    def _replay_step(self, sb: _StaticBatch, key: tuple, greedy: bool, stops, res) -> bool:
        """One decoding step: the graph of ``key`` (captured on first use) or, without
        ``cuda_graphs``, ``_step_body`` eagerly. Returns whether the step itself copied its
        results to the pinned buffer (False only after the capture fallback below)."""
        if not self.cuda_graphs:
            self._step_body(sb, greedy, stops, copy_out=True)()
            return True
        ent = sb.graphs.get(key)
        if ent is None:
            t0 = time.perf_counter()
            # The step updates its own inputs (seq_lens, root, ...): the warm-up runs start from
            # a snapshot, restored after each; what they write beyond seq_lens (verify K/V,
            # compaction, catch-up, drafting scratch) is rewritten identically by the replay.
            state = sb.step_state()
            saved = [t.clone() for t in state]
            cur = torch.cuda.current_stream(self._dev)
            err = None
            for copy_out in (True, False):
                body = self._step_body(sb, greedy, stops, copy_out=copy_out)
                try:
                    s = torch.cuda.Stream(self._dev)
                    s.wait_stream(cur)
                    with torch.cuda.stream(s):
                        for _ in range(2):
                            body()
                            for t, v in zip(state, saved):
                                t.copy_(v)
                    cur.wait_stream(s)
                    if self._pool is None:
                        self._pool = torch.cuda.graph_pool_handle()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self._pool):
                        body()
                    ent = sb.graphs[key] = (graph, copy_out)
                    break
                except Exception as e:  # noqa: PERF203
                    err = err or e
                    # a failed capture_end raises before torch.cuda.graph restores the stream
                    torch.cuda.set_stream(cur)
                    torch.cuda.synchronize(self._dev)
                    for t, v in zip(state, saved):
                        t.copy_(v)
            if ent is None:
                assert err is not None
                raise RuntimeError(
                    f"treeops decoder: CUDA-graph capture of the whole step failed (policy "
                    f"{self.name}, B={sb.B}): {type(err).__name__}: {err}. Something in the step "
                    "syncs with the host or allocates outside the graph; step_graphs=False "
                    "(per-forward graphs) or cuda_graphs=False runs it otherwise."
                ) from err
            res.time_capture += time.perf_counter() - t0
            res.graphs_captured += 1
        graph, copy_out = ent
        graph.replay()
        return copy_out

    def _step_body(self, sb: _StaticBatch, greedy: bool, stops, copy_out: bool = True):
        """One whole decoding step over ``sb``'s static buffers, sync-free (no host reads, no
        data-dependent shapes): capturable as one CUDA graph. Reads root, root_feat, seq_lens,
        remaining, active (and u, temperature, top_k, top_p, ``stops``); writes the step's
        results into ``sb.pack`` (and the pinned ``sb.host_pack`` with ``copy_out``) and the
        next step's inputs in place."""
        pol, dft = self.policy, self.draft
        B, N = sb.B, self.capacity
        verify = sb.verify_body(N)
        catchup = None if dft is None else sb.catchup_body(N)
        drafts = {} if pol is None else {R: sb.draft_body(R) for R in (1, pol.max_width)}
        pack = sb.pack.view(B, 4 + N)
        host_pack = sb.host_pack.view(B, 4 + N)
        rows = sb.rows

        def body():
            active = sb.active
            root = torch.where(active, sb.root, 0)
            vin = sb.vin
            if pol is None:
                vin.tokens[:, 0] = root
                vin.num_nodes.copy_(active.to(torch.int32))
            else:
                self._draft_fixed(sb, root, active, drafts)
            tree, logits, h = verify()
            mnt = sb.remaining.clamp(min=1)
            if greedy:
                acc = accept_greedy(tree, logits, stop_ids=stops, max_new_tokens=mnt)
            else:
                acc = accept_sample(
                    tree, logits, sb.temperature, sb.top_k, sb.top_p, sb.u,
                    stop_ids=stops, max_new_tokens=mnt,
                )  # fmt: skip
            tkv = sb.tkv
            new_lens = compact_kv(
                tkv.k, tkv.v, tkv.block_table, sb.seq_lens, tree, acc.accepted, acc.accept_len
            )
            alen = acc.accept_len.long()
            path = acc.accepted.long().clamp(min=0)  # [B, N]
            path_tok = tree.tokens.gather(1, path)
            path_h = h[rows[:, None], path]  # [B, N, H]
            remaining = sb.remaining - alen
            done = remaining <= 0
            if stops is not None:
                done |= (acc.bonus[:, None] == stops[None, :]).any(1)
            heads = (alen, acc.bonus, vin.num_nodes, sb.grafted)
            torch.cat([x[:, None] for x in heads] + [path_tok], 1, out=pack)
            if copy_out:
                host_pack.copy_(pack, non_blocking=True)
            if catchup is not None:  # over the accepted path, at the old seq_lens
                on_path = sb.node_idx[None, :] < alen[:, None]
                torch.mul(path_tok, on_path, out=sb.c_tok)  # 0 past the path
                sb.c_feat[:, 0] = sb.root_feat
                sb.c_feat[:, 1:] = path_h[:, : N - 1]
                sb.c_len.copy_(acc.accept_len)
                catchup()
            last = (alen - 1).clamp(min=0)
            new_feat = torch.where(active[:, None], path_h[rows, last], sb.root_feat)
            new_seq = torch.where(active, new_lens, sb.seq_lens)
            new_root = torch.where(active, acc.bonus, root)
            new_active = active & ~done
            sb.root_feat.copy_(new_feat)
            sb.seq_lens.copy_(new_seq)
            sb.root.copy_(new_root)
            sb.remaining.copy_(remaining)
            sb.active.copy_(new_active)

        return body

    def _draft_fixed(self, sb: _StaticBatch, root, active, drafts) -> None:
        """``_draft_static`` for a fixed-shape policy (EagleStatic, chain), sync-free: layer 0
        drafts the root (1 row), layers 1 .. depth-1 their W-row frontiers; the tree into
        ``sb.vin``."""
        pol = self.policy
        assert pol is not None and sb.state is not None and not pol.is_cast
        W, st = pol.max_width, sb.state
        st.reset(root, sb.seq_lens, active)
        act = active.to(torch.int32)
        torch.addcmul(sb.meta_base, sb.meta_coef, act, out=sb.layer_meta)
        sb.d_meta.copy_(sb.layer_meta[0])
        sb.d_feat[:, 0] = sb.root_feat
        R = 1
        while True:
            i = st.layer
            qs = 0
            if i > 0:
                qs = sb.frontier_inputs(st.frontier, i, W)
            drafts[R]()
            sb.hid[:, qs : qs + R] = sb.d_h[:, :R]
            build_tree_expand(sb.d_logits, st, pol)
            if st.layer >= pol.depth or st.layer >= pol.max_depth:
                break
            R = W
        build_tree_emit(st, pol, out=sb.vin)

    @property
    def _dev(self) -> torch.device:
        return self.target.model.embed_tokens.weight.device


class _StaticBatch:
    """Static buffers of one batch size for the graph path: caches, seq_lens, the verification
    tree (``vin``, capacity N; ``build_tree_emit``/``graft`` write into it), the draft's working
    tree and frontier inputs/outputs, the catch-up inputs, a pinned copy-back buffer, and the
    captured graphs keyed by (kind, token bucket)."""

    def __init__(self, dec: Decoder, B: int, max_len: int):
        tgt, dft = dec.target, dec.draft
        dev = dec._dev
        wdtype = tgt.model.embed_tokens.weight.dtype
        H, V = tgt.cfg.hidden_size, tgt.cfg.vocab_size
        N, Nd = dec.capacity, dec.draft_capacity
        self.dec, self.B, self.max_len = dec, B, max_len
        self.graphs: dict[tuple, tuple[Any, Any]] = {}
        self.tkv: PagedKV = tgt.make_cache(B, max_len, page_size=dec.page_size, seed=1)
        self.dkv: PagedKV | None = None
        self.seq_lens = torch.zeros(B, dtype=torch.int32, device=dev)
        self.vin = Tree.empty(B, N, dev)
        self.vin.anc[:, 0, 0] = 1  # (autoregressive: the one-node tree; others overwrite it)
        self.grafted = torch.zeros(B, dtype=torch.int32, device=dev)
        self.pack = torch.zeros(B * (4 + N), dtype=torch.int64, device=dev)
        self.node_idx = torch.arange(N, device=dev)
        pin = dev.type == "cuda"
        self.host_pack = torch.zeros(B * (4 + N), dtype=torch.int64, pin_memory=pin)
        self.pack_event = torch.cuda.Event() if pin else None
        self.state: DraftState | None = None
        self.step_ready = False
        if dft is None:
            return
        pol = dec.policy
        assert pol is not None
        W = pol.max_width
        self.dkv = dft.make_cache(B, max_len, page_size=dec.page_size, seed=2)
        self.dtree = Tree.empty(B, Nd, dev)
        self.dtree.anc[:, 0, 0] = 1
        self.self_bits = torch.zeros(Nd, anc_words(Nd), dtype=torch.int32, device=dev)
        for k in range(Nd):
            self.self_bits[k, k // 32] = bit_value(k)
        # cand_node[c]: the working-tree node of candidate c's frontier row (candidate c of
        # layer l >= 1 is a child of frontier row (c - l C) // K of layer l, node 1 + (l-1) W +
        # that row; layer 0's candidates are the root's children); the last entry, which a
        # frontier index of -1 reads, is the root
        K, C = pol.topk, pol.max_width * pol.topk
        c = torch.arange(pol.max_depth * C, device=dev)
        lay = c // C
        row = torch.where(lay > 0, 1 + (lay - 1) * W + (c - lay * C) // K, 0)
        self.cand_node = torch.cat([row, row.new_zeros(1)])
        self.hid = torch.zeros(B, Nd, H, dtype=wdtype, device=dev)
        self.d_feat = torch.zeros(B, W, H, dtype=wdtype, device=dev)
        # The draft forward's per-layer [B] inputs share one buffer (one copy per layer): the
        # working tree's num_nodes, q_start and q_len. Layer i's values are meta_base[i] +
        # meta_coef[i] * active: num_nodes 1 + i W, q_start 1 + (i-1) W (0 at layer 0), q_len W
        # rows (1 at layer 0; CAST sets its bucket instead)
        self.d_meta = torch.zeros(3, B, dtype=torch.int32, device=dev)
        self.dtree.num_nodes = self.d_meta[0]
        self.d_qs, self.d_qlen = self.d_meta[1], self.d_meta[2]
        lay = torch.arange(pol.max_depth, dtype=torch.int32, device=dev)
        zero, first = torch.zeros_like(lay), lay == 0
        q_start = torch.where(first, 0, 1 + (lay - 1) * W)
        q_len = torch.where(first, 1, W).to(torch.int32)
        self.meta_coef = torch.stack([1 + lay * W, zero, q_len], 1)[:, :, None]
        self.meta_base = torch.stack([zero, q_start, zero], 1)[:, :, None]
        self.layer_meta = torch.zeros(pol.max_depth, 3, B, dtype=torch.int32, device=dev)
        self.d_logits = torch.zeros(B, W, V, dtype=torch.float32, device=dev)
        self.d_h = torch.zeros(B, W, H, dtype=wdtype, device=dev)
        self.c_tok = torch.zeros(B, N, dtype=torch.int64, device=dev)
        self.c_feat = torch.zeros(B, N, H, dtype=wdtype, device=dev)
        self.c_len = torch.zeros(B, dtype=torch.int32, device=dev)
        self.chains: dict[int, Tree] = {}
        self.emit_buf = Tree.empty(B, N, dev)

    def read_pack(self, host_pack: torch.Tensor) -> list:
        """The step's results from the pinned copy, after the one event wait (CUDA)."""
        if self.pack_event is not None:
            self.pack_event.synchronize()
        return host_pack.tolist()

    def verify_body(self, n: int):
        """Target forward of the first ``n`` nodes of ``vin`` (num_nodes clamped to n, links past
        it cut: a prefix of a rank-ordered tree is a tree). Returns (tree, logits, hidden)."""
        vin, tgt, tkv, seq_lens = self.vin, self.dec.target, self.tkv, self.seq_lens

        def body():
            num = torch.clamp(vin.num_nodes, max=n)

            def link(x):
                x = x[:, :n]
                return torch.where(x < num[:, None], x, -1).contiguous()

            t = Tree(
                tokens=vin.tokens[:, :n].contiguous(),
                parents=vin.parents[:, :n].contiguous(),
                num_nodes=num,
                depth=vin.depth[:, :n].contiguous(),
                anc=vin.anc[:, :n, : anc_words(n)].contiguous(),
                first_child=link(vin.first_child),
                next_sibling=link(vin.next_sibling),
                scores=vin.scores[:, :n].contiguous(),
            )
            logits, h = tgt(t.tokens, tkv, seq_lens, t)
            return t, logits, h

        return body

    def frontier_inputs(self, frontier: torch.Tensor, i: int, W: int) -> int:
        """The draft forward's inputs for the frontier of layer ``i >= 1`` (rows ``q_start ..
        q_start + W - 1`` of ``dtree``): depth and anc from each row's parent node, the parent's
        target feature, and the layer's [B] metadata. Returns q_start."""
        dt, B = self.dtree, self.B
        qs = 1 + (i - 1) * W
        # [B, W] int64: each frontier row's parent node, looked up by its candidate index (-1, an
        # unused row, reads the table's last entry: the root)
        pnode = self.cand_node[frontier]
        Wd, H = dt.anc.shape[2], self.hid.shape[2]
        new = slice(qs, qs + W)
        torch.add(dt.depth.gather(1, pnode), 1, out=dt.depth[:, new])
        pa = dt.anc.gather(1, pnode[:, :, None].expand(B, W, Wd))
        torch.bitwise_or(pa, self.self_bits[new], out=dt.anc[:, new])
        torch.gather(self.hid, 1, pnode[:, :, None].expand(B, W, H), out=self.d_feat)
        self.d_meta.copy_(self.layer_meta[i])  # num_nodes, q_start, q_len (EAGLE: W rows)
        return qs

    def draft_body(self, R: int):
        """Draft forward of frontier rows ``d_qs .. d_qs + R - 1`` of ``dtree``: logits and
        hidden into rows ``:R`` of ``d_logits``/``d_h`` (rows past R are stale: invalid frontier
        rows, ignored by ``build_tree_expand``)."""
        dec = self.dec
        dft = dec.draft
        assert dft is not None and self.state is not None
        tok = self.state.frontier_tokens

        def body():
            # the frontier's tokens are the draft state's own buffer (the root at layer 0)
            logits, h = dft(
                dec.target, tok[:, :R], self.d_feat[:, :R], self.dkv, self.seq_lens,
                self.dtree, self.d_qs, self.d_qlen,
            )  # fmt: skip
            self.d_logits[:, :R].copy_(logits)
            self.d_h[:, :R].copy_(h)

        return body

    def catchup_body(self, R: int):
        """Draft forward over the accepted path (a chain of ``c_len`` nodes, capacity R)."""
        dec = self.dec
        dft = dec.draft
        assert dft is not None
        if R not in self.chains:
            dev = self.c_tok.device
            full = torch.full((self.B,), R, dtype=torch.int32, device=dev)
            ch = chain_tree(torch.zeros(self.B, R, dtype=torch.int64, device=dev), full)
            ch.num_nodes = self.c_len  # the static lengths: nodes past them are masked out
            self.chains[R] = ch
        ch = self.chains[R]

        def body():
            tok = self.c_tok[:, :R].contiguous()
            dft(dec.target, tok, self.c_feat[:, :R], self.dkv, self.seq_lens, ch)

        return body

    # ------------------------------------------------------------ whole-step graphs
    def step_buffers(self) -> None:
        """The static inputs of ``Decoder._step_body`` (allocated once, outside any capture):
        the step's state (root, root feature, remaining budgets, active mask; seq_lens is
        ``self.seq_lens``), the per-request sampling parameters and the uniforms (a pinned host
        staging copy on CUDA)."""
        if self.step_ready:
            return
        dec, B, N = self.dec, self.B, self.dec.capacity
        dev = self.seq_lens.device
        tgt = dec.target
        wdtype = tgt.model.embed_tokens.weight.dtype
        self.root = torch.zeros(B, dtype=torch.int64, device=dev)
        self.root_feat = torch.zeros(B, tgt.cfg.hidden_size, dtype=wdtype, device=dev)
        self.remaining = torch.zeros(B, dtype=torch.int64, device=dev)
        self.active = torch.zeros(B, dtype=torch.bool, device=dev)
        self.temperature = torch.zeros(B, dtype=torch.float32, device=dev)
        self.top_k = torch.zeros(B, dtype=torch.int32, device=dev)
        self.top_p = torch.ones(B, dtype=torch.float32, device=dev)
        self.u = torch.zeros(B, N, dtype=torch.float32, device=dev)
        self.u_host = torch.zeros(B, N, dtype=torch.float32, pin_memory=dev.type == "cuda")
        self.rows = torch.arange(B, device=dev)
        self.stops: dict[int, torch.Tensor] = {}
        self.step_ready = True

    def stop_buf(self, n: int) -> torch.Tensor:
        """The static stop-id buffer of ``n`` ids (the step graphs are keyed by n)."""
        if n not in self.stops:
            self.stops[n] = torch.zeros(n, dtype=torch.int64, device=self.seq_lens.device)
        return self.stops[n]

    def step_state(self) -> list[torch.Tensor]:
        """What a step updates for the next one (restored after each capture warm-up run)."""
        return [self.seq_lens, self.root, self.root_feat, self.remaining, self.active]

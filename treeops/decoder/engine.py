"""The batch decoder: prefill, then one decoding step after another until every request is done.

``Decoder.generate`` prefills ``prompt[:-1]`` of every request as a chain tree through the same
tree forward as the steps (kv_append + tree_attention); the prompt's last token is the first
step's root, so every emitted token, the first included, comes out of ``accept_*``. Then it runs
the step of ``step.py`` (draft a tree, verify it with the target, accept, compact, catch the
draft up; docs/design.md "The example decoder") until every request has spent its budget or
emitted a stop id; finished requests stay in the batch as inactive rows (``num_nodes = 0``).

How a step runs is the decoder's choice of path, the tokens being the same:

* eager (the default): fresh tensors, no CUDA graphs;
* ``static_shapes`` / ``cuda_graphs`` (docs/design.md "Dynamic trees and CUDA graphs"): static
  buffers, every forward padded to a token bucket chosen on the host from the decisions treeops
  wrote to pinned memory, and with ``cuda_graphs`` each forward (verification, draft frontier,
  catch-up) a CUDA graph per (kind, batch size, bucket), captured on first use (``graphs.py``);
* ``step_graphs`` (fixed-shape policies): the whole step one CUDA graph per (batch size,
  ``AcceptMode``, number of stop ids), one host wait per step.

``kv_append`` has no row offset, so the draft's frontier-only write shifts its ``seq_lens`` base
by ``q_start`` and passes depths relative to it (possibly negative).
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch

from .._checks import check_positive_int
from .._graft_types import RankTemplate
from ..build_tree import Cast
from ..cast_plan import CastPlanner
from ..graft import AdjacencyTable, graft
from ..graft_tail import graft_tail
from ..tree import Tree
from .graphs import (
    TOKEN_BUCKETS,
    GraphRunner,
    WholeStep,
    _StaticBatch,
    bucket_for,
    token_buckets,
)
from .model import Draft, Target, chain_tree
from .policies import (
    POLICIES,
    CastGraft,
    Policy,
    as_policy,
    policy_name,
    synthetic_cost_table,
    tree_policy,
)
from .results import DecodeResult, SamplingParams, absorb, check_requests
from .step import Carry, EagerStep, StaticStep, WholeStepBody
from .tp import TPContext, check_cost_table, verified_tokens

__all__ = [
    "POLICIES",
    "SamplingParams",
    "DecodeResult",
    "Decoder",
    # re-exported for callers that import them from here
    "synthetic_cost_table",
    "TOKEN_BUCKETS",
    "token_buckets",
    "bucket_for",
]


GRAFT_SIZES = (0, 2, 4, 8, 16)
"""The graft counts λ-CAST with Graft plans between (each a whole-step graph per shape)."""


class Decoder:
    """Speculative decoder over a ``Target`` and a ``Draft``.

    Args:
        target, draft: the models (the draft may be None for ``autoregressive``).
        policy: a policy object of ``policies.py`` (``Autoregressive()``, ``Chain(depth)``,
            ``treeops.EagleStatic``, ``treeops.Cast``, ``CastGraft``) or a name of ``POLICIES``
            (``make_policy(name)``: its default sizes).
        page_size: KV cache page size.
        cuda_graphs: run the target's verification and the draft's forwards as CUDA graphs, one
            per (batch size, token bucket), captured on first use (CUDA models only; a
            ``ValueError`` otherwise). Prefill stays eager.
        static_shapes: the graph path's code (static buffers, token buckets, decisions read
            from pinned memory) without capturing; default ``cuda_graphs``. On the CPU it is how
            the tests check that path.
        profile: synchronise the device at every timing boundary of the static and graph paths
            so that ``time_draft``, ``time_tree``, ``time_verify`` and ``time_host_wait`` split
            the GPU time (slower; off, the host waits are measured and the rest is enqueue time).
        check_buckets: check on the host that no forward's bucket is smaller than its tokens
            (syncs; a ``RuntimeError`` if one is). Tests use it.
        step_graphs: capture one CUDA graph per (batch size, ``AcceptMode``, number of stop
            ids) for a whole decoding step (all draft layers and tree builds, verification,
            acceptance, compaction, catch-up, the next step's state and the copy of the results
            to pinned memory) instead of one graph per forward with the tree ops eager between
            them. Needs ``cuda_graphs=True`` (or ``static_shapes=True``, which runs the same
            step body eagerly: how the CPU tests check it) and a fixed-shape policy
            (autoregressive, chain, EagleStatic) or λ-CAST (``Cast()`` without thresholds: one
            graph per plan, the plan chosen between steps by a ``treeops.CastPlanner``, which
            the static path requires; ``CastGraft(Cast())``: λ-CAST whose plans also set how
            many of the verified nodes Graft's successor table fills, ``GRAFT_SIZES``); CAST
            with thresholds decides sizes on the host during the step, so it and ``CastGraft``
            over it raise a ``ValueError`` naming ``step_graphs``. The
            catch-up runs at the bucket of the longest possible accepted path (depth + 1 nodes,
            deeper where Graft's template reaches below the draft) instead of the longest
            accepted one. Host waits: one per step.
        launch_ahead: with ``step_graphs``, enqueue step t + 1 before reading step t's results
            whenever some request is sure to outlive step t (its remaining budget exceeds the
            most tokens step t can emit), so the host's per-step work (reading the results,
            appending tokens, the λ-CAST planner) overlaps the device's next step instead of
            leaving it idle; a step enqueued for requests that all stop on a stop id is a
            masked no-op. λ-CAST's plans then follow statistics two steps old. False: launch,
            wait, read, one step at a time.
        planner_options: keyword arguments of λ-CAST's ``CastPlanner`` (e.g. the measured
            ``layer_overhead_us``), kept per decoder: its λ̂, calibration and plans persist
            across ``generate`` calls.
        tp_group: a ``torch.distributed`` process group to decode tensor-parallel over (one
            process per rank, each constructing its decoder; ``tp.py``): ``target`` must be
            sharded for it (``tp.shard_target(target, tp_group)``), the draft is replicated,
            and a CAST cost table must have been measured at this TP degree (its
            ``meta["tp"]``; a ``ValueError`` otherwise, as for a table of another degree
            without a group). Each ``generate`` takes rank 0's arguments and generator state.
            None (the default): one process, nothing of ``tp.py`` runs.
        check_lockstep: with ``tp_group``, all-gather a digest of every step's results
            (accepted lengths, bonus tokens, the verified tree's tokens) and raise a
            ``RuntimeError`` naming the step and the ranks when they differ. It reads the
            tree after each step, so whole steps are not launched ahead.
    """

    def __init__(
        self,
        target: Target,
        draft: Draft | None = None,
        policy: Policy | str = "EagleStatic",
        *,
        page_size: int = 16,
        cuda_graphs: bool = False,
        static_shapes: bool | None = None,
        profile: bool = False,
        check_buckets: bool = False,
        step_graphs: bool = False,
        launch_ahead: bool = True,
        planner_options: dict | None = None,
        tp_group=None,
        check_lockstep: bool = False,
    ):
        self.policy = as_policy(policy)
        self.name = policy_name(self.policy)
        self.tree_policy = tree_policy(self.policy)
        self.graft = self.policy if isinstance(self.policy, CastGraft) else None
        # set by ``calibrate_checkpoints``: the eager path appends each step's checkpoint scores
        # and accepted indices here (host syncs; calibration only)
        self.checkpoint_log: list | None = None
        if self.tree_policy is not None and draft is None:
            raise ValueError(f"policy {self.name!r} needs a draft model")
        self.target = target
        self.draft = None if self.tree_policy is None else draft  # AR needs no draft pass
        self.page_size = page_size
        self.table: AdjacencyTable | None = None
        self._graft_templates: dict[int, RankTemplate] = {}
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
        self.launch_ahead = bool(launch_ahead)
        tp = self.tree_policy
        adaptive = isinstance(tp, Cast) and tp.adaptive
        opts = dict(planner_options or {})
        if adaptive and self.graft is not None:  # λ-CAST plans how many nodes Graft fills
            opts.setdefault("graft_sizes", [g for g in GRAFT_SIZES if g < tp.capacity])
        self.planner = CastPlanner(tp, verify_buckets=token_buckets(tp.capacity),
                                   width_buckets=token_buckets(tp.max_width),
                                   **opts) if adaptive else None  # fmt: skip
        if adaptive and self.graft is not None and not self.step_graphs:
            raise ValueError(
                "Invalid value of step_graphs: CastGraft over λ-CAST (Cast without thresholds) "
                "runs as whole steps only; pass step_graphs=True with cuda_graphs (or "
                "static_shapes)"
            )
        if self.step_graphs and tp is not None and tp.is_cast and not adaptive:
            raise ValueError(
                f"Invalid value of step_graphs: True needs a fixed-shape policy (autoregressive, "
                f"chain, EagleStatic) or λ-CAST (Cast without thresholds), got policy "
                f"{self.name!r} with thresholds, whose sizes are decided on the host during a "
                "step; use step_graphs=False (per-forward graphs)"
            )
        if adaptive and self.static and not self.step_graphs:
            raise ValueError(
                "Invalid value of step_graphs: λ-CAST (Cast without thresholds) runs each step "
                "as one graph of its plan's shape; pass step_graphs=True with cuda_graphs (or "
                "static_shapes)"
            )
        if self.step_graphs and not self.static:
            raise ValueError(
                "Invalid value of step_graphs: True needs cuda_graphs=True (or static_shapes=True "
                "to run the whole-step body eagerly)"
            )
        sharded = getattr(target, "tp_group", None)
        if tp_group is None and sharded is not None:
            raise ValueError("Invalid value of tp_group: None, but the target is sharded")
        if tp_group is not None and sharded is not tp_group:
            raise ValueError(
                "Invalid value of target: not sharded for tp_group; use "
                "treeops.decoder.tp.shard_target(target, tp_group)"
            )
        self.tp = None if tp_group is None else TPContext(tp_group, check_lockstep)
        check_cost_table(getattr(tp, "cost_table", None), 1 if self.tp is None else self.tp.size)
        self.profile = bool(profile)
        self.check_buckets = bool(check_buckets)
        if dev.type == "cuda":
            # the fused forwards' concatenated weights, built now rather than inside a capture
            target.fuse()
            if self.draft is not None:
                self.draft.fuse()
        self._graphs = GraphRunner(self)

    # ------------------------------------------------------------------ sizes
    @property
    def capacity(self) -> int:
        """N: verification tree capacity (root included)."""
        return 1 if self.tree_policy is None else self.tree_policy.capacity

    @property
    def draft_capacity(self) -> int:
        """Nd: the draft's working tree (root + a frontier per draft layer after the first)."""
        if self.tree_policy is None:
            return 1
        W, D = self.tree_policy.max_width, self.tree_policy.max_depth
        return 1 + max(D - 1, 1) * W

    @property
    def _batches(self) -> dict[int, _StaticBatch]:
        """The static batches, one per batch size (static path)."""
        return self._graphs.batches

    @property
    def _dev(self) -> torch.device:
        return self.target.model.embed_tokens.weight.device

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
        max_batch: int | None = None,
    ) -> DecodeResult:
        """Decode every prompt (a list of token ids, length >= 1) until ``max_new_tokens`` (an
        int or one per request) or a stop id (kept in the output). ``sampling``: one
        ``SamplingParams`` for the batch or one per request (temperature 0 rows are greedy);
        uniforms come from ``generator`` (CPU), one per tree node per step.

        ``max_batch``: decode at most this many requests at once (the batch size of the steps;
        None: all of them). The first ``max_batch`` start together; when one ends, the next
        waiting request takes its row between two steps (its prompt prefilled into that row's
        caches), as an engine's continuous batching does, so no row idles while requests wait.
        A refill is queued behind the step already launched ahead, which then runs with the row
        idle; ``DecodeResult.time_refill`` holds the refills' device time (inside
        ``time_decode``). Results stay per request, in the order given."""
        # Triton launches, events and graph captures use the current device: make it the model's
        if self.tp is not None:  # every rank decodes rank 0's requests with its generator
            prompts, max_new_tokens, stop_ids, sampling, generator, max_batch = (
                self.tp.sync_requests(
                    prompts, max_new_tokens, stop_ids, sampling, generator, max_batch
                )
            )
        lockstep = self.tp is not None and self.tp.check_lockstep
        with torch.cuda.device(self._dev) if self._dev.type == "cuda" else nullcontext():
            R, budget, per_req, mode = check_requests(prompts, max_new_tokens, sampling)
            if max_batch is not None:
                check_positive_int("max_batch", max_batch)
            B = R if max_batch is None else min(R, max_batch)
            g = generator or torch.Generator().manual_seed(0)
            step, res, refill = self._start(prompts, budget, per_req, mode, stop_ids, g, B)
            stop_set = set(int(x) for x in stop_ids or ())
            host_remaining = budget[:B]
            if isinstance(step, (WholeStep, EagerStep)):  # the planner's measure reads them
                step.remaining = host_remaining
            host_active = [m > 0 for m in host_remaining]
            req_of = list(range(B))  # the request each row decodes
            waiting = [r for r in range(R - 1, B - 1, -1) if budget[r] > 0]  # popped from the end
            row_len = [len(p) for p in prompts[:B]]  # each row's context (the planner's ctx)
            t_loop = time.perf_counter()

            full_open = True  # the full-batch window (``DecodeResult.steps_full``)

            def end_full() -> None:
                """Closes the full-batch window once a row idles with no request waiting."""
                nonlocal full_open
                if full_open and not waiting and not all(host_active):
                    full_open = False
                    res.steps_full = res.steps
                    res.time_full = time.perf_counter() - t_loop
                    res.capture_full = res.time_capture

            def refill_rows() -> None:
                """The rows whose request ended take the next waiting requests."""
                rows = [b for b in range(B) if not host_active[b]][: len(waiting)]
                if rows:
                    reqs = [waiting.pop() for _ in rows]
                    refill(rows, reqs)
                    for b, r in zip(rows, reqs):
                        req_of[b], host_remaining[b], host_active[b] = r, budget[r], True
                        row_len[b] = len(prompts[r])
                end_full()

            def take(rows, n, launched=None):
                t0 = step.clock()
                grafted = absorb(res, rows, n, stop_set, host_remaining, host_active, req_of)
                for b, e in enumerate(res.emitted[-1]):
                    row_len[b] += e
                live = [n for n, a in zip(row_len, host_active) if a]
                if live and hasattr(step, "ctx"):  # the longest live context (refills shrink it)
                    step.ctx = max(live)
                if self.graft is not None:
                    res.grafted.append(grafted)
                if launched is None:
                    step.record(res)
                else:
                    step.record(res, launched)
                if lockstep:
                    self.tp.check_step(res.steps, rows, verified_tokens(step, launched))
                res.steps += 1
                res.time_tree += step.clock() - t0

            if isinstance(step, WholeStep):
                # with launch_ahead, step t + 1 is enqueued before step t's results are read
                # whenever some request is sure to outlive step t: the host's work overlaps the
                # device's (the lockstep check reads each step's tree first: one at a time)
                ahead = self.launch_ahead and not lockstep
                refill_rows()
                cur = step.launch() if any(host_active) else None
                while cur is not None:
                    sure = ahead and any(
                        a and r > cur.emit for a, r in zip(host_active, host_remaining)
                    )
                    nxt = step.launch() if sure else None
                    take(step.collect(cur), cur.n, cur)
                    refill_rows()
                    if not any(host_active):
                        break  # (a step launched ahead of a stop-id ending is left uncollected)
                    cur = nxt or step.launch()
            else:
                refill_rows()
                while any(host_active):
                    take(*step())
                    refill_rows()
            if self.static and self._dev.type == "cuda":  # nor end with work still queued
                torch.cuda.synchronize(self._dev)
            res.time_decode = time.perf_counter() - t_loop
            res.time_refill = refill.seconds()
            res.time_refill_host = refill.host_s
            if full_open:  # no row idled while requests waited: the whole loop is full
                res.steps_full, res.time_full = res.steps, res.time_decode
                res.capture_full = res.time_capture
            res.tokens_full = sum(sum(e) for e in res.emitted[: res.steps_full])
            return res

    def _start(self, prompts, budget, per_req, mode, stop_ids, g, B: int):
        """Buffers for a batch of ``B`` rows (caches long enough for any of the requests), the
        first ``B`` requests' prefill, and the step of this decoder's path; returns (step,
        result, the ``_Refill`` that puts a waiting request into a row)."""
        dev = self._dev
        tgt = self.target
        N, Nd = self.capacity, self.draft_capacity
        lens = torch.tensor([len(p) for p in prompts[:B]], dtype=torch.int32, device=dev)
        max_len = max(len(p) for p in prompts) + max(budget) + N + Nd + 1
        stops = None
        if self.static:
            sb = self._graphs.batch(B, max_len)
            carry, tkv, dkv = Carry.of(sb), sb.tkv, sb.dkv
            if stop_ids and self.step_graphs:  # the step graphs read a static buffer
                stops = sb.stop_buf(len(stop_ids))
                stops.copy_(torch.tensor(stop_ids, dtype=torch.int64))
            clock = self._clock
        else:
            tkv = tgt.make_cache(B, max_len, page_size=self.page_size, seed=1)
            dkv = None
            if self.draft is not None:
                dkv = self.draft.make_cache(B, max_len, page_size=self.page_size, seed=2)
            wdtype = tgt.model.embed_tokens.weight.dtype
            carry = Carry.new(B, tgt.cfg.hidden_size, wdtype, dev)
            clock = time.perf_counter
        if stop_ids and stops is None:
            stops = torch.tensor(stop_ids, dtype=torch.int64, device=dev)
        res = DecodeResult(
            tokens=[[] for _ in prompts], profiled=self.profile and self.static,
            step_graphs=self.step_graphs,
        )  # fmt: skip

        # prefill prompt[:-1] as a chain (eager on every path); the last prompt token is the
        # first root
        t0 = clock()
        if self.graft is not None:
            # one table per decoder, emptied in place for each batch: a captured step graph
            # holds its address (a new table per batch left the graphs reading and writing
            # the freed one)
            if self.table is None or self.table.device != dev:
                k = self.graft.adjacency_k
                self.table = AdjacencyTable(tgt.cfg.vocab_size, k=k, device=dev)
            else:
                self.table.reset()
        carry.seq_lens.copy_(lens - 1)
        root, root_feat = self._prefill(prompts[:B], carry.seq_lens, tkv, dkv)
        carry.start(root, root_feat, budget[:B], per_req[:B])
        if self.static:
            if dev.type == "cuda":  # the loop's clock must not start with prefill still queued
                torch.cuda.synchronize(dev)
        res.time_prefill = clock() - t0

        refill = _Refill(self, carry, tkv, dkv, prompts, budget, per_req)
        if not self.static:
            return EagerStep(self, carry, tkv, dkv, res, mode, stops, g), res, refill
        if self.step_graphs:

            def make_body(pb) -> WholeStepBody:
                return WholeStepBody(self, sb, mode, stops, pb)

            ctx = max(len(p) for p in prompts[:B])
            return WholeStep(self, sb, res, mode, stops, g, make_body, ctx), res, refill
        return StaticStep(self, sb, res, mode, stops, g), res, refill

    def _prefill(self, prompts, seq_lens, tkv, dkv) -> tuple[torch.Tensor, torch.Tensor]:
        """Every request's ``prompt[:-1]`` through the target (and the draft) as a chain at
        ``seq_lens`` [B] (= prompt lengths - 1); warms Graft's table. Returns the first roots
        (the last prompt tokens) [B] int64 and their features [B, H] (the target's hidden state
        at the token before; 0 for a one-token prompt)."""
        return self._prefill_tokens(_prompt_tokens(prompts, seq_lens.device), seq_lens, tkv, dkv)

    def _prefill_tokens(self, toks, seq_lens, tkv, dkv) -> tuple[torch.Tensor, torch.Tensor]:
        """``_prefill`` from the prompts on the device (``_prompt_tokens``): device work only,
        no host read (a refill queues it behind the step launched ahead)."""
        tgt, dft = self.target, self.draft
        dev, B, P = seq_lens.device, toks.shape[0], toks.shape[1] - 1
        root = toks[:, 0]
        root_feat = torch.zeros(
            B, tgt.cfg.hidden_size, dtype=tgt.model.embed_tokens.weight.dtype, device=dev
        )
        if P > 0:
            ptok = toks[:, 1:].contiguous()
            plen = seq_lens.clone()
            chain = chain_tree(ptok, plen)
            zero = torch.zeros(B, dtype=torch.int32, device=dev)
            # the logits only warm Graft's table: without one, no LM head over the prompts
            want = "none" if self.table is None else "float32"
            logits, h = tgt(ptok, tkv, zero, chain, logits=want)
            if dft is not None:
                feats = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], 1)
                dft(tgt, ptok, feats, dkv, zero, chain, outputs=False)
            last = (plen.long() - 1).clamp(min=0)
            root_feat = torch.where(
                (plen > 0)[:, None], h[torch.arange(B, device=dev), last], root_feat
            )
            if self.table is not None:
                self.table.warm_start(ptok, logits.contiguous(), plen)
        return root, root_feat

    def refill(self, pruned: Tree, budget, g: int | None = None, out: Tree | None = None) -> Tree:
        """Graft's refill of a pruned tree, up to ``budget`` nodes (root included), by the
        policy's ``anchor``: successors from the root (``graft``: the policy's template, or
        ``graft_template(g)`` for a λ-CAST plan grafting ``g``), or a chain below the best
        leaf (``graft_tail``: as many nodes as the policy's template has past its root, or
        ``g`` capped by that number, so a root-only template grafts nothing whatever the plan:
        prune-only Graft). Into ``out`` when given."""
        assert self.graft is not None and self.table is not None
        if self.graft.anchor == "leaf":
            n = self.graft.template.size - 1
            n = n if g is None else min(g, n)
            return graft_tail(pruned, self.table, n, budget, max_count=n, out=out)
        tpl = self.graft.template if g is None else self.graft_template(g)
        return graft(pruned, self.table, tpl, budget=budget, out=out)

    def graft_template(self, g: int) -> RankTemplate:
        """The successor template of a λ-CAST plan that grafts ``g`` nodes: the policy
        template's ``g`` + 1 most probable nodes (``RankTemplate.most_probable``; the default's
        rank-0 chain first), so a budget of g slots gets the likeliest successors rather than
        the first g of a breadth-first fill. One object per g for the decoder's life (the step
        graphs hold its device copy)."""
        t = self._graft_templates.get(g)
        if t is None:
            assert self.graft is not None
            t = self._graft_templates[g] = self.graft.template.most_probable(g + 1)
        return t

    # ------------------------------------------------------- timing and host waits
    def _step_time(self, seconds: float) -> float:
        """The step time λ-CAST's planner observes: rank 0's under TP (the same plan on every
        rank), else ``seconds``."""
        return seconds if self.tp is None else self.tp.step_time(seconds)

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


def _upload(host: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """``host`` on ``dev``: through pinned memory, asynchronously on CUDA (a copy from pageable
    memory would wait for every step queued before it)."""
    if dev.type != "cuda":
        return host.to(dev)
    return host.pin_memory().to(dev, non_blocking=True)


def _prompt_tokens(prompts: list[list[int]], dev: torch.device) -> torch.Tensor:
    """[B, P] int64 on ``dev`` (P = the longest prompt's length): column 0 each prompt's last
    token (the first root), then its other tokens, zero-padded; one upload."""
    P = max(len(p) for p in prompts)
    host = torch.zeros(len(prompts), P, dtype=torch.int64)
    for b, p in enumerate(prompts):
        host[b, : len(p)] = torch.tensor(p[-1:] + p[:-1], dtype=torch.int64)
    return _upload(host, dev)


class _Refill:
    """Puts waiting requests into rows of a running batch (``generate``'s ``max_batch``): their
    prompts prefilled into those rows' caches (``PagedKV.rows``: the rows' pages, the same pools),
    the rows' carried state set, Graft's table warmed. Everything is queued on the current
    stream behind the step launched before it, with no host sync; its device time is kept with
    CUDA events and read once, at the end (``seconds``)."""

    def __init__(self, dec: Decoder, carry: Carry, tkv, dkv, prompts, budget, per_req):
        self.dec, self.carry, self.tkv, self.dkv = dec, carry, tkv, dkv
        self.prompts, self.budget, self.per_req = prompts, budget, per_req
        self.events: list = []
        self.host_s = 0.0

    def __call__(self, rows: list[int], reqs: list[int]) -> None:
        """Row ``rows[i]`` (whose request ended) starts request ``reqs[i]``."""
        dev = self.carry.rows.device
        t0 = time.perf_counter()
        cuda = dev.type == "cuda"
        if cuda:
            ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            ev[0].record()
        ps = [self.prompts[r] for r in reqs]
        sp = [self.per_req[r] for r in reqs]
        # the rows' new state: a row per field, each a contiguous [R] tensor on the device
        st = _upload(torch.tensor(
            [rows, [len(p) - 1 for p in ps], [self.budget[r] for r in reqs], [s.top_k for s in sp]],
            dtype=torch.int64,
        ), dev)  # fmt: skip
        fl = _upload(
            torch.tensor([[max(0.0, s.temperature) for s in sp], [s.top_p for s in sp]]), dev
        )
        self.apply(_prompt_tokens(ps, dev), st, fl)
        if cuda:
            ev[1].record()
            self.events.append(ev)
        self.host_s += time.perf_counter() - t0

    def apply(self, toks: torch.Tensor, st: torch.Tensor, fl: torch.Tensor) -> None:
        """The refill's device work, no host read: ``toks`` the prompts (``_prompt_tokens``),
        ``st`` [4, R] int64 (rows, prompt lengths - 1, budgets, top-k), ``fl`` [2, R] float32
        (temperatures, top-p)."""
        idx, lens = st[0], st[1].to(torch.int32)
        dkv = None if self.dkv is None else self.dkv.rows(idx)
        root, feat = self.dec._prefill_tokens(toks, lens, self.tkv.rows(idx), dkv)
        self.carry.start_rows(idx, lens, root, feat, st[2], st[3], fl[0], fl[1])

    def seconds(self) -> float:
        """The refills' time: device time on CUDA (waits for the last refill), else host."""
        if not self.events:
            return self.host_s
        self.events[-1][1].synchronize()  # (the last refill's end: every one before it ran)
        return sum(a.elapsed_time(b) for a, b in self.events) / 1e3

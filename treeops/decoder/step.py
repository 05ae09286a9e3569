"""One decoding step: the body every path of ``Decoder.generate`` runs.

A step over a batch of B requests (each with its own tree, length and stop condition)::

    root      = the last emitted token (0 on finished rows)
    tree      = draft(root)              # build_tree_expand per draft layer, build_tree_emit;
                                         # CastGraft: prune at the checkpoints, graft
    logits    = target(tree)             # verification
    acc       = accept_greedy / accept_sample (stop ids, per-request budgets)
    seq_lens' = compact_kv(target cache, accepted path)
    results  -> host                     # accept lengths, bonus tokens, tree sizes, path tokens
    draft catch-up over the accepted path
    advance: root = bonus, root feature, seq_lens, budgets, active flags (``Carry``)

``StepBody`` is that sequence, written once; its parts differ per path only in how they run:

* ``EagerStep``: fresh tensors each step; the draft's working tree is rebuilt per draft layer
  with ``Tree.from_parents``; the host reads the results with one ``tolist``.
* ``StaticStep`` (``static_shapes``, ``cuda_graphs``): the static buffers of a ``_StaticBatch``;
  each forward runs through ``GraphRunner.replay`` at a token bucket chosen on the host from the
  decisions treeops wrote to pinned memory, read after one event wait per decision point: after
  each CAST draft layer (width of the next frontier and whether to go on), after the rerank
  (verification count) and after acceptance (accepted lengths, bonus tokens, which requests are
  done: the catch-up bucket and the loop's end). EAGLE and chain trees have static sizes and wait
  only after acceptance.
* ``WholeStepBody`` (``step_graphs``: fixed-shape policies, and λ-CAST per plan): the static
  path with nothing in the step depending on the host (frontier width, depth, verification
  count and catch-up size fixed by the policy or the plan; padding beyond ``accept_len``
  masked), so the whole body, the non-blocking copy of its results (and λ-CAST's statistics)
  into pinned memory included, is one CUDA graph; ``graphs.WholeStep`` replays it, waits on one
  event per step and, under λ-CAST, hands the statistics to the planner, whose plan picks the
  next step's graph.

The draft's working tree during a step: node 0 = root, the frontier of draft layer ``l >= 1`` at
nodes ``1 + (l-1)W .. lW`` (W = the tree shape's frontier capacity: on the static path each
shape, each λ-CAST plan, has its own working tree; unused rows hang off the root with token 0
and are ignored). Each draft forward computes only the frontier rows (``q_start``/``q_len``). Draft
input at a node = (embedding of its token, feature of its parent): the target's final hidden
state at the last accepted position for the root, the draft's own output hidden for deeper
nodes. The draft's KV cache is recomputed, not compacted: after each verification the draft runs
once over the accepted path (root + accepted nodes) with the target's features, so its length
always equals the target's ``seq_lens``; its drafting-time K/V beyond that is scratch.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .._draft_state import DraftState
from ..accept import accept_greedy, accept_sample
from ..build_tree import build_tree_emit, build_tree_expand
from ..cast_plan import cast_step_stats
from ..compact_kv import compact_kv
from ..prune import prune
from ..tree import Tree
from .graphs import (
    PlanBuffers,
    _StaticBatch,
    bucket_for,
    catchup_bucket,
    path_cols,
    planner_tokens,
)
from .model import PagedKV, chain_tree
from .results import AcceptMode, DecodeResult

if TYPE_CHECKING:
    from .engine import Decoder

__all__ = ["Carry", "StepBody", "EagerStep", "StaticStep", "WholeStepBody"]


@dataclass
class Carry:
    """The decoding state between steps, per request: ``root`` [B] int64 (the next root token),
    ``root_feat`` [B, H] (its draft feature: the target's hidden state at the token before),
    ``seq_lens`` [B] int32 (cached tokens), ``remaining`` [B] int64 (token budgets), ``active``
    [B] bool, the sampling parameters ``temperature`` [B] float32, ``top_k`` [B] int32, ``top_p``
    [B] float32, and ``rows`` = arange(B). Each step updates the first five in place."""

    root: torch.Tensor
    root_feat: torch.Tensor
    seq_lens: torch.Tensor
    remaining: torch.Tensor
    active: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    rows: torch.Tensor

    @classmethod
    def new(cls, B: int, H: int, dtype: torch.dtype, device: torch.device) -> Carry:
        def z(*shape, dtype):
            return torch.zeros(*shape, dtype=dtype, device=device)

        return cls(
            root=z(B, dtype=torch.int64), root_feat=z(B, H, dtype=dtype),
            seq_lens=z(B, dtype=torch.int32), remaining=z(B, dtype=torch.int64),
            active=z(B, dtype=torch.bool), temperature=z(B, dtype=torch.float32),
            top_k=z(B, dtype=torch.int32), top_p=z(B, dtype=torch.float32),
            rows=torch.arange(B, device=device),
        )  # fmt: skip

    @classmethod
    def of(cls, sb: _StaticBatch) -> Carry:
        """The static decoding state of ``sb`` (``sb.step_buffers()`` allocates it)."""
        sb.step_buffers()
        return cls(
            root=sb.root, root_feat=sb.root_feat, seq_lens=sb.seq_lens, remaining=sb.remaining,
            active=sb.active, temperature=sb.temperature, top_k=sb.top_k, top_p=sb.top_p,
            rows=sb.rows,
        )  # fmt: skip

    def start(self, root, root_feat, budget: list[int], per_req: list) -> None:
        """The first step's state: the prefill's roots and features, the budgets and sampling
        parameters (host lists), every request with a positive budget active."""
        self.root.copy_(root)
        self.root_feat.copy_(root_feat)
        self.remaining.copy_(torch.tensor(budget, dtype=torch.int64))
        torch.gt(self.remaining, 0, out=self.active)
        self.temperature.copy_(torch.tensor([max(0.0, sp.temperature) for sp in per_req]))
        self.top_k.copy_(torch.tensor([sp.top_k for sp in per_req], dtype=torch.int32))
        self.top_p.copy_(torch.tensor([sp.top_p for sp in per_req], dtype=torch.float32))

    def start_rows(self, idx, seq_lens, root, root_feat, budget, top_k, temperature, top_p):
        """Rows ``idx`` [R] (int64) start new requests (continuous batching), from device
        tensors in ``idx``'s order, with no host read: their prefilled lengths, roots and
        features, budgets, and sampling parameters; each becomes active."""
        self.seq_lens.index_copy_(0, idx, seq_lens.to(self.seq_lens.dtype))
        self.root.index_copy_(0, idx, root)
        self.root_feat.index_copy_(0, idx, root_feat)
        self.remaining.index_copy_(0, idx, budget.to(self.remaining.dtype))
        self.active.index_fill_(0, idx, True)
        self.top_k.index_copy_(0, idx, top_k.to(self.top_k.dtype))
        self.temperature.index_copy_(0, idx, temperature.to(self.temperature.dtype))
        self.top_p.index_copy_(0, idx, top_p.to(self.top_p.dtype))


@dataclass
class Verified:
    """A verified step: the acceptance, accepted lengths [B] int64, the accepted path's tokens
    [B, n] and target features [B, n, H], and the target cache's lengths after compaction."""

    acc: Any
    alen: torch.Tensor
    path_tok: torch.Tensor
    path_h: torch.Tensor
    new_lens: torch.Tensor


class StepBody:
    """One decoding step over ``carry`` (see the module docstring). Calling it runs the step and
    returns (the host's copy of the step's results, one row per request: ``[accept_len, bonus,
    verified nodes, grafted nodes] + accepted path tokens``, or None where the host reads them
    after the step; the verification bucket n). Subclasses say how each part runs."""

    grafted: torch.Tensor  # [B] int32: nodes Graft added this step per request

    def __init__(self, dec: Decoder, carry: Carry, tkv: PagedKV, res: DecodeResult,
                 mode: AcceptMode, stops: torch.Tensor | None,
                 generator: torch.Generator | None):  # fmt: skip
        self.dec, self.carry, self.tkv, self.res = dec, carry, tkv, res
        self.mode, self.stops, self.g = mode, stops, generator
        self.B = carry.rows.shape[0]

    def clock(self) -> float:
        """A timing boundary."""
        return time.perf_counter()

    def __call__(self) -> tuple[list | None, int]:
        c, res = self.carry, self.res
        root = torch.where(c.active, c.root, 0)
        n = self.draft(root)
        t0 = self.clock()
        tree, logits, h = self.verify(n)
        t1 = self.clock()
        res.time_verify += t1 - t0
        v = self.accept(tree, logits, h, n)
        pack = self.pack(v, tree, n)
        self.send(pack)
        res.time_tree += self.clock() - t1
        rows = self.receive(pack)
        self.catch_up(v, rows, n)
        t0 = self.clock()
        self.advance(v, root)
        res.time_tree += self.clock() - t0
        return rows, n

    # ------------------------------------------------------------- the parts every path shares
    def uniforms(self, n: int) -> torch.Tensor:
        """[B, n] sampling uniforms: a [B, N] draw from the CPU generator, cut to the bucket."""
        u = torch.rand(self.B, self.dec.capacity, generator=self.g)
        return u[:, :n].contiguous().to(self.carry.rows.device)

    def accept(self, tree: Tree, logits, h, n: int) -> Verified:
        """Acceptance (greedy or sampled; the successor table learns the tree), compaction of the
        target cache, and the accepted path."""
        c, table = self.carry, self.dec.table
        mnt = c.remaining.clamp(min=1)
        mode = self.mode
        if mode.greedy:
            acc = accept_greedy(tree, logits, stop_ids=self.stops, max_new_tokens=mnt)
        else:  # the truncation tensors only where some request truncates (no kept-set pass)
            acc = accept_sample(
                tree, logits, c.temperature, c.top_k if mode.top_k else None,
                c.top_p if mode.top_p else None, self.uniforms(n),
                stop_ids=self.stops, max_new_tokens=mnt,
            )  # fmt: skip
        if table is not None:
            # from the logits, not acceptance's fused top-k ids: those cost acceptance an int64
            # order key per logit, and the two passes together ran 1.4-2.6x faster on the H200
            # (bench_graft.py --learn, docs/benchmarks.md)
            table.update(tree, logits)
        tkv = self.tkv
        new_lens = compact_kv(
            tkv.k, tkv.v, tkv.block_table, c.seq_lens, tree, acc.accepted, acc.accept_len
        )
        alen = acc.accept_len.long()
        path = acc.accepted.long().clamp(min=0)  # [B, n]
        path_tok = tree.tokens.gather(1, path)
        path_h = h[c.rows[:, None], path]  # [B, n, H]: the target's feature at each path node
        return Verified(acc, alen, path_tok, path_h, new_lens)

    def pack(self, v: Verified, tree: Tree, n: int) -> torch.Tensor:
        """What the host needs, in one [B, 4 + P] int64 tensor: accepted lengths, bonus tokens,
        verified sizes, grafted counts, the accepted path's tokens (P = ``path_cols(n)``)."""
        heads = (v.alen, v.acc.bonus, self.num_nodes(tree), self.grafted)
        cols = [x[:, None] for x in heads] + [v.path_tok[:, : self.path_cols(n)]]
        out = self.pack_buffer(n)
        return torch.cat(cols, 1) if out is None else torch.cat(cols, 1, out=out)

    def advance(self, v: Verified, root: torch.Tensor) -> None:
        """The next step's state, in place: on active rows the bonus token becomes the root, its
        feature the target's at the last accepted node, seq_lens the compacted lengths; budgets
        shrink by the accepted lengths; a spent budget or a stop id ends a request."""
        c, acc = self.carry, v.acc
        active = c.active
        remaining = c.remaining - v.alen
        done = remaining <= 0
        if self.stops is not None:
            done |= (acc.bonus[:, None] == self.stops[None, :]).any(1)
        last = (v.alen - 1).clamp(min=0)
        new_feat = torch.where(active[:, None], v.path_h[c.rows, last], c.root_feat)
        new_seq = torch.where(active, v.new_lens, c.seq_lens)
        new_root = torch.where(active, acc.bonus, root)
        new_active = active & ~done
        c.root_feat.copy_(new_feat)
        c.seq_lens.copy_(new_seq)
        c.root.copy_(new_root)
        c.remaining.copy_(remaining)
        c.active.copy_(new_active)

    def record(self, res: DecodeResult) -> None:
        """Per-step bookkeeping after the host took the results (buckets of a whole step)."""

    # ----------------------------------------------------------- the parts each path runs its way
    def draft(self, root: torch.Tensor) -> int:
        """Draft the step's tree (kept for ``verify``); returns the verification bucket n."""
        raise NotImplementedError

    def verify(self, n: int) -> tuple[Tree, torch.Tensor, torch.Tensor]:
        """The target's forward of the tree: (tree, logits, hidden)."""
        raise NotImplementedError

    def num_nodes(self, tree: Tree) -> torch.Tensor:
        """Each request's drafted tree size (before any cut to the bucket)."""
        return tree.num_nodes

    def pack_buffer(self, n: int) -> torch.Tensor | None:
        return None

    def path_cols(self, n: int) -> int:
        """Columns of the accepted path in the results pack (the longest path it can hold)."""
        return n

    def send(self, pack: torch.Tensor) -> None:
        """Start the results' copy to the host (nothing to do on the eager path)."""

    def receive(self, pack: torch.Tensor) -> list | None:
        """The results on the host (after one wait), or None if read after the step."""
        raise NotImplementedError

    def catch_up(self, v: Verified, rows: list | None, n: int) -> None:
        """The draft's forward over the accepted path, with the target's features."""
        raise NotImplementedError


def early_stop_budget(tree: Tree, active: torch.Tensor, capacity: int, stopped: bool):
    """Graft's verify budget [B] int32 for thresholded CAST: the emitted tree's sizes (what CAST
    chose for the whole tree), or, when drafting stopped early because every request was pruned,
    ``capacity`` per active request: the budget is never the size of a tree cut short."""
    if not stopped:
        return tree.num_nodes.clone()
    return torch.where(active, capacity, 0).to(torch.int32)


class _HostFlag:
    """A device bool copied to pinned host memory behind an event (CUDA), so a decision point
    that waits on a later event reads it with no wait of its own; on CPU read directly."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.host = torch.zeros((), dtype=torch.bool, pin_memory=True)
            self.event = torch.cuda.Event()

    def publish(self, flag: torch.Tensor):
        """Queue ``flag``'s copy; returns the reader (call it inside a wait)."""
        if not self.cuda:
            return lambda: bool(flag)
        self.host.copy_(flag, non_blocking=True)
        self.event.record()
        return self._read

    def _read(self) -> bool:
        self.event.synchronize()
        return bool(self.host)


class EagerStep(StepBody):
    """The eager path: fresh tensors each step, no buckets, no waits counted."""

    def __init__(self, dec, carry, tkv, dkv, res, mode, stops, generator):
        super().__init__(dec, carry, tkv, res, mode, stops, generator)
        self.dkv = dkv
        self.state: DraftState | None = None
        self.tree: Tree | None = None
        self.t_last = time.perf_counter()
        self.remaining: list[int] | None = None  # the host's budgets (``planner_tokens``)
        self.ctx = int(carry.seq_lens.max()) + 1 if self.B else 0
        self.grafted = torch.zeros(self.B, dtype=torch.int32, device=carry.rows.device)

    def draft(self, root):
        c, planner = self.carry, self.dec.planner
        if self.dec.tree_policy is None:
            par = torch.full((self.B, 1), -1, dtype=torch.int32, device=root.device)
            self.tree = Tree.from_parents(par, c.active.to(torch.int32), root[:, None].contiguous())
            return self.dec.capacity
        pol = self.dec.tree_policy
        if planner is not None:  # λ-CAST: this step drafts the planner's shape
            self.plan = planner.plan(self.B)
            pol = planner.policy_for(self.plan)
        self.tree = self._draft_tree(root, pol)
        return pol.capacity

    def accept(self, tree, logits, h, n):
        v = super().accept(tree, logits, h, n)
        log = self.dec.checkpoint_log
        if log is not None and self.dec.graft is not None:
            # calibration (host syncs allowed): per active request, the checkpoints' best
            # scores and the largest node index on its accepted path (nodes are in rank order)
            last = v.acc.accepted.gather(1, (v.alen.long() - 1).clamp(min=0)[:, None])[:, 0]
            on = self.carry.active
            log.append((self.checkpoint_best[on].cpu(), last[on].long().cpu()))
        planner = self.dec.planner
        if planner is not None:
            dev = self.carry.rows.device
            self.stats = torch.zeros(planner.size, dtype=torch.float32, device=dev)
            rates = torch.tensor(planner.rates(self.B), dtype=torch.float32, device=dev)
            assert self.state is not None
            cast_step_stats(
                self.state.cand_scores, tree, v.acc.accepted, v.acc.accept_len,
                self.carry.active, rates, self.stats, max_depth=planner.D, max_width=planner.W,
                capacity=planner.N,
            )  # fmt: skip
        return v

    def verify(self, n):
        tree = self.tree
        assert tree is not None
        logits, h = self.dec.target(tree.tokens, self.tkv, self.carry.seq_lens, tree,
                                    logits="native")  # fmt: skip
        return tree, logits, h

    def receive(self, pack):
        rows = pack.tolist()
        planner = self.dec.planner
        if planner is not None:  # the step's time: from the previous step's end
            now = time.perf_counter()
            step_s, self.t_last = self.dec._step_time(now - self.t_last), now
            acc = [r[0] for r in rows if r[0] > 0]
            tokens = 0.0
            if acc:
                self.ctx += max(acc)
                p = self.plan
                emit = p.verify if self.dec.graft is not None and p.graft else p.depth + 1
                tokens = planner_tokens(rows, self.remaining, emit)
                planner.observe(self.B, self.stats.tolist(), p, tokens, step_s, self.ctx)
            p = self.plan
            lam = round(planner.lam(self.B), 4)
            row = [p.width, p.depth, p.verify, lam, p.graft, p.topk, step_s, tokens]
            self.res.plans.append(row)
            self.res.time_plan += time.perf_counter() - now
        return rows

    def catch_up(self, v, rows, n):
        dec, c = self.dec, self.carry
        dft = dec.draft
        if dft is None:
            return
        t0 = time.perf_counter()
        j = torch.arange(v.path_tok.shape[1], device=c.rows.device)[None, :]
        on_path = j < v.alen[:, None]
        feats = torch.cat([c.root_feat[:, None], v.path_h[:, :-1]], 1)
        ctok = torch.where(on_path, v.path_tok, 0)
        chain = chain_tree(ctok, v.alen.to(torch.int32))
        dft(dec.target, ctok, feats, self.dkv, c.seq_lens, chain, outputs=False)
        self.res.time_draft += time.perf_counter() - t0

    def _draft_tree(self, root: torch.Tensor, pol) -> Tree:
        """Draft ``pol``'s tree layer by layer over a working tree rebuilt per layer, emit the
        tree (CastGraft: prune and graft; ``self.grafted`` = the nodes added)."""
        dec, c, res = self.dec, self.carry, self.res
        tgt, dft, gp = dec.target, dec.draft, dec.graft
        assert pol is not None and dft is not None
        root_feat, seq_lens, active, dkv = c.root_feat, c.seq_lens, c.active, self.dkv
        dev = root.device
        B = root.shape[0]
        W, K, Nd = pol.max_width, pol.topk, dec.draft_capacity
        C = W * K
        H = tgt.cfg.hidden_size
        same = (
            self.state is not None
            and self.state.cand_scores.shape[1:] == (pol.max_depth, pol.max_width * pol.topk)
            and self.state.workspace["sel"].shape[1] == pol.capacity
        )
        if same:
            self.state.reset(root, seq_lens, active)
        else:
            self.state = DraftState.new(pol, root, seq_lens, active)
        state = self.state
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

        keep = gp.checkpoints.start(B, dev) if gp is not None else None
        log = dec.checkpoint_log if gp is not None else None
        if log is not None:  # calibration: each checkpoint's best score (NaN: not reached)
            self.checkpoint_best = torch.full((B, len(gp.checkpoints.steps)), math.nan, device=dev)
        while True:
            t0 = time.perf_counter()
            logits = draft_fn(state)
            t1 = time.perf_counter()
            # layer 0 reads the root's row alone: the launch covers B rows, not B·W
            build_tree_expand(logits[:, :1] if state.layer == 0 else logits, state, pol)
            stop_now = False
            if keep is not None:
                best = state.frontier_scores.max(1).values.float().contiguous()
                if log is not None and state.layer - 1 in gp.checkpoints.steps:
                    self.checkpoint_best[:, gp.checkpoints.steps.index(state.layer - 1)] = best
                stop = gp.checkpoints.check(state.layer - 1, best, keep)
                # stop drafting once every active request is pruned (the eager path reads the
                # depth flag on the host every layer anyway)
                stop_now = bool((stop | ~active).all())
            more = state.wants_next_layer() if pol.is_cast else state.layer < pol.depth
            res.time_draft += t1 - t0
            res.time_tree += time.perf_counter() - t1
            if stop_now or not more or state.layer >= pol.max_depth:
                break
        res.draft_buckets.append([1] + [W] * (state.layer - 1))  # rows per draft forward
        t0 = time.perf_counter()
        tree = build_tree_emit(state, pol)
        if keep is not None:
            # the graft budget: what CAST chose for the whole tree, or after an early stop (the
            # tree cut short) the capacity, never the cut tree's size
            verify = early_stop_budget(tree, active, pol.capacity, stop_now)
            pruned = prune(tree, keep)
            tree = dec.refill(pruned, verify)
            self.grafted = tree.num_nodes - pruned.num_nodes
        res.time_tree += time.perf_counter() - t0
        return tree


class StaticStep(StepBody):
    """The static path: every forward over the static buffers of ``sb``, at a token bucket,
    through ``GraphRunner.replay`` (captured, or eager without ``cuda_graphs``); decisions read
    from pinned memory after one event wait each (``Decoder._wait``). ``pb``: the tree shape's
    buffers (default the decoder's own policy)."""

    def __init__(self, dec, sb: _StaticBatch, res, mode, stops, generator,
                 pb: PlanBuffers | None = None):  # fmt: skip
        super().__init__(dec, Carry.of(sb), sb.tkv, res, mode, stops, generator)
        self.sb = sb
        self.pb = sb.default if pb is None and dec.tree_policy is not None else pb
        self.grafted = sb.grafted
        self.check_buckets = dec.check_buckets
        self.pruned_flag = _HostFlag(sb.seq_lens.device)  # thresholded Graft: all pruned

    def clock(self):
        return self.dec._clock()

    def wait(self, fn):
        """One decision point: ``fn()`` waits on one event and reads the pinned buffer."""
        return self.dec._wait(self.res, fn)

    def run(self, kind: str, R: int):
        """The forward of ``kind`` at bucket ``R``, as its CUDA graph."""
        return self.dec._graphs.replay(self.sb, (kind, R), self.sb.body(kind, R), self.res)

    @property
    def vin(self) -> Tree:
        """The verification tree this step drafts into."""
        return self.sb.vin if self.pb is None else self.pb.vin

    def draft(self, root):
        dec, res = self.dec, self.res
        vin = self.vin
        if dec.tree_policy is None:
            t0 = self.clock()
            vin.tokens[:, 0] = root
            vin.num_nodes.copy_(self.carry.active.to(torch.int32))
            n = 1
            res.time_tree += self.clock() - t0
        else:
            n = self._draft_tree(root)
        res.verify_buckets.append(n)
        if self.check_buckets and int(vin.num_nodes.max()) > n:
            raise RuntimeError(
                f"verify bucket {n} < num_nodes {vin.num_nodes.tolist()} (policy {dec.name})"
            )
        return n

    def verify(self, n):
        return self.run("verify", n)

    def num_nodes(self, tree):
        return self.vin.num_nodes

    def path_cols(self, n):
        return path_cols(self.dec.graft is not None, self.pb, n)

    def pack_buffer(self, n):
        # contiguous [B, 4 + P] views of flat buffers: with a bucket n < N, column slices of
        # [B, 4 + N] buffers made copy_ go through temporaries, an extra device copy and a host
        # staging buffer that is not pinned, which can block the host
        w = 4 + self.path_cols(n)
        return self.sb.pack[: self.B * w].view(self.B, w)

    def _host_pack(self, pack):
        return self.sb.host_pack[: pack.numel()].view(pack.shape)

    def send(self, pack):
        self._host_pack(pack).copy_(pack, non_blocking=True)
        if self.sb.pack_event is not None:
            self.sb.pack_event.record()

    def receive(self, pack):
        sb, host_pack = self.sb, self._host_pack(pack)
        return self.wait(lambda: sb.read_pack(host_pack))

    def catch_up(self, v, rows, n):
        """At the bucket of the longest accepted path (skipped if no request accepted)."""
        dec, res = self.dec, self.res
        amax = max(row[0] for row in rows)
        if dec.draft is not None and amax > 0:
            t0 = self.clock()
            rc = bucket_for(amax, dec.capacity)
            self.catchup_inputs(v, n, rc)
            self.run("catchup", rc)
            res.catchup_buckets.append(rc)
            res.time_draft += self.clock() - t0
        else:
            res.catchup_buckets.append(0)

    def catchup_inputs(self, v: Verified, n: int, R: int) -> None:
        """The accepted path into the catch-up buffers of bucket ``R`` (``sb.catchup_rows``; R
        at least the longest accepted path), at the old seq_lens: its tokens (0 past the path;
        columns past n stale, masked by the lengths), the features (the root's, then the
        target's at each path node), lengths."""
        sb = self.sb
        tok, feat = sb.catchup_rows(R)
        k = min(n, R)
        on_path = sb.node_idx[None, :k] < v.alen[:, None]
        torch.mul(v.path_tok[:, :k], on_path, out=tok[:, :k])  # 0 past the path
        feat[:, 0] = self.carry.root_feat
        feat[:, 1:k] = v.path_h[:, : k - 1]
        sb.c_len.copy_(v.acc.accept_len)

    def _draft_tree(self, root: torch.Tensor) -> int:
        """Draft one step's tree into ``self.vin``; returns the verify bucket. The draft's
        working tree ``pb.dtree`` is updated in place layer by layer (depth, anc, num_nodes: what
        the forwards read; its parents, tokens and sibling links are not kept)."""
        dec, sb, res, clock = self.dec, self.sb, self.res, self.clock
        pb, gp = self.pb, dec.graft
        assert pb is not None and dec.draft is not None
        pol = pb.policy
        active = self.carry.active
        B = root.shape[0]
        W = pol.max_width
        N = pol.capacity
        t0 = clock()
        st = pb.state
        st.reset(root, sb.seq_lens, active)
        act = active.to(torch.int32)
        torch.addcmul(pb.meta_base, pb.meta_coef, act, out=pb.layer_meta)
        sb.d_meta.copy_(pb.layer_meta[0])
        pb.d_feat[:, 0] = self.carry.root_feat
        # thresholded CAST prunes at Graft's checkpoints; λ-CAST's plan sets its graft count
        keep = None
        if gp is not None and dec.planner is None:
            keep = gp.checkpoints.start(B, dec._dev)
        if gp is not None:
            sb.grafted.zero_()
        R = 1
        res.time_tree += clock() - t0
        buckets = []
        logits = pb.d_logits
        while True:
            i = st.layer
            t0 = clock()
            if i > 0:  # the frontier of layer i: nodes q_start .. q_start + W - 1
                qs = sb.frontier_inputs(pb, st.frontier, i)
                if pol.is_cast:
                    torch.mul(act, R, out=sb.d_qlen)
            else:
                qs = 0
            t1 = clock()
            buckets.append(R)
            self.run("draft", R)
            pb.hid[:, qs : qs + R] = pb.d_h[:, :R]
            t2 = clock()
            waited = res.time_host_wait
            # layer 0 reads the root's row alone (the draft wrote row 0): B rows, not B·W
            build_tree_expand(logits[:, :1] if i == 0 else logits, st, pol)
            pruned_all = None
            if keep is not None:
                best = st.frontier_scores.max(1).values.float().contiguous()
                stop = gp.checkpoints.check(st.layer - 1, best, keep)
                pruned_all = self.pruned_flag.publish((stop | ~active).all())
            t3 = clock()
            res.time_draft += t2 - t1
            res.time_tree += (t1 - t0) + (t3 - t2) - (res.time_host_wait - waited)
            stop_now = False
            if pol.is_cast:
                # one event wait: every request pruned (drafting stops), the depth flag and the
                # next frontier's width
                def decide(pruned_all=pruned_all):
                    if pruned_all is not None and pruned_all():
                        return True, False, 1
                    return False, st.wants_next_layer(), st.width(st.layer - 1)

                stop_now, more, width = self.wait(decide)
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
        t0 = clock()
        if keep is not None:
            tree = build_tree_emit(st, pol, out=sb.emit_buf)
            verify = early_stop_budget(tree, active, N, stop_now)
            pruned = prune(tree, keep, out=sb.pruned_buf)
            dec.refill(pruned, verify, out=self.vin)
            sb.grafted.copy_(self.vin.num_nodes - pruned.num_nodes)
            if stop_now:  # the budget is the capacity: verify at its bucket
                res.time_tree += clock() - t0
                return N
        elif pb.graft:  # λ-CAST with Graft: the plan's n - g best draft nodes, g retrieved
            tree = build_tree_emit(st, pol, out=pb.emit)
            # keep counts the nodes below the root
            pruned = prune(tree, N - 1 - pb.graft, out=pb.pruned)
            dec.refill(pruned, N, pb.graft, out=self.vin)
            sb.grafted.copy_(self.vin.num_nodes - pruned.num_nodes)
        else:
            build_tree_emit(st, pol, out=self.vin)
        res.time_tree += clock() - t0
        if not pol.is_cast:
            return N
        return bucket_for(self.wait(st.verify_count), N)


class WholeStepBody(StaticStep):
    """The static path's step with no host read inside, capturable as one CUDA graph: a
    fixed-shape tree (``pb``'s policy: verification at its capacity n, draft forwards of 1 then
    w rows, catch-up at the bucket of the longest possible accepted path, depth + 1 nodes;
    padding beyond ``accept_len`` masked). It reads the ``Carry`` in ``sb`` (and the uniforms
    ``sb.u``, the stop ids ``stops``, λ-CAST's calibration ``sb.rates``), writes the results into
    ``sb.pack`` (λ-CAST's statistics into ``sb.stats``; ``graphs.WholeStep`` copies both to the
    host after the replay) and the next step's state in place. Its forwards are built once,
    outside any capture."""

    def __init__(self, dec, sb: _StaticBatch, mode: AcceptMode, stops,
                 pb: PlanBuffers | None = None):  # fmt: skip
        # bookkeeping goes to a throwaway result: the host records the step after the replay
        super().__init__(dec, sb, DecodeResult(tokens=[]), mode, stops, None, pb)
        self.check_buckets = False
        pb = self.pb
        N = dec.capacity if pb is None else pb.capacity
        self.bodies = {("verify", N): sb.verify_body(N, self.vin)}
        if dec.draft is not None and pb is not None:
            self.catchup_size = catchup_bucket(dec, pb)
            self.bodies["catchup", self.catchup_size] = sb.catchup_body(self.catchup_size)
            for R in (1, pb.w):
                self.bodies["draft", R] = sb.draft_body(R, pb)

    def clock(self):
        return 0.0

    def wait(self, fn):
        raise AssertionError("a whole-step body never waits on the host")

    def run(self, kind, R):
        return self.bodies[kind, R]()

    def uniforms(self, n):
        return self.sb.u[:, :n].contiguous()

    def accept(self, tree, logits, h, n):
        v = super().accept(tree, logits, h, n)
        planner, sb = self.dec.planner, self.sb
        if planner is not None and self.pb is not None:
            cast_step_stats(
                self.pb.state.cand_scores, tree, v.acc.accepted, v.acc.accept_len,
                self.carry.active, sb.rates, sb.stats, max_depth=planner.D, max_width=planner.W,
                capacity=planner.N, grafted=sb.grafted if planner.graft_sizes else None,
            )  # fmt: skip
        return v

    def send(self, pack):
        return None  # the results stay in sb.pack: graphs.WholeStep copies them after the replay

    def receive(self, pack):
        return None

    def catch_up(self, v, rows, n):
        """Over the accepted path at ``catchup_size`` (padding beyond ``accept_len`` masked)."""
        if self.dec.draft is not None:
            self.catchup_inputs(v, n, self.catchup_size)
            self.run("catchup", self.catchup_size)

"""The graph runner: static buffers, token buckets, CUDA-graph capture and replay.

With ``static_shapes`` (and ``cuda_graphs``, which implies it) a decoder keeps one
``_StaticBatch`` per batch size: every buffer a forward reads (paged caches and block tables,
seq_lens, the verification tree, the draft's working tree, frontier and catch-up inputs, the
decoding state between steps) lives there, at a fixed address, so a forward over them can be
captured once and replayed every step. The token count of each forward is padded up to a bucket
(``token_buckets``); padding nodes beyond ``num_nodes`` are masked out by every op.

``GraphRunner.replay`` runs one forward (kind ``verify``, ``draft`` or ``catchup``, one graph per
(kind, batch size, token bucket)); ``GraphRunner.replay_step`` runs a whole step (one graph per
(batch size, ``results.AcceptMode``, number of stop ids)). Without ``cuda_graphs`` both run their
bodies eagerly: the CPU tests check the graph path's logic that way.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from .._draft_state import DraftState
from ..tree import Tree, anc_words, bit_value
from . import fused
from .model import PagedKV, chain_tree
from .results import AcceptMode, DecodeResult

if TYPE_CHECKING:
    from .engine import Decoder

__all__ = [
    "TOKEN_BUCKETS",
    "token_buckets",
    "bucket_for",
    "GraphRunner",
    "PlanBuffers",
    "WholeStep",
]

TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def rows_view(store: torch.Tensor, B: int, rows: int, *tail: int) -> torch.Tensor:
    """A contiguous [B, rows, *tail] view of the flat ``store``'s first elements: buffers whose
    row count depends on the plan or bucket share one store, and a forward's whole input or
    output is then one contiguous block (a [B, r] column slice of a [B, R_max] buffer is
    strided, and a copy into it an elementwise kernel instead of a memcpy)."""
    n = B * rows
    for t in tail:
        n *= t
    return store[:n].view(B, rows, *tail)


def token_buckets(capacity: int) -> list[int]:
    """Token counts a forward of at most ``capacity`` tokens per request is padded up to: the
    members of ``TOKEN_BUCKETS`` below ``capacity``, then ``capacity`` itself."""
    if capacity < 1:
        raise ValueError(f"Invalid value of capacity: expected >= 1, got {capacity}")
    return [b for b in TOKEN_BUCKETS if b < capacity] + [capacity]


def path_cols(grafting: bool, pb: PlanBuffers | None, n: int) -> int:
    """Columns of accepted-path tokens in a step's results pack: the longest path the step's
    tree can accept (its draft depth + 1, within the verified bucket n; n where Graft may add
    nodes below the draft's depth). Fewer columns, less for the host to read each step."""
    return n if grafting or pb is None else min(n, pb.depth + 1)


def catchup_bucket(dec, pb: PlanBuffers) -> int:
    """The rows of a whole step's catch-up forward for tree shape ``pb``: the bucket of the
    longest path the step can accept (the draft's depth + 1; where the shape grafts from the
    root, 1 + its successor template's depth if that is deeper, grafted nodes hanging at their
    template depth; from the best leaf, 1 + the draft's depth + the graft count), capped at the
    shape's capacity."""
    deepest = pb.depth
    if dec.graft is not None and pb.graft:
        if dec.graft.anchor == "leaf":
            deepest = pb.depth + pb.graft
        else:
            deepest = max(deepest, dec.graft_template(pb.graft).max_depth)
    return min(pb.capacity, bucket_for(deepest + 1, dec.capacity))


def planner_tokens(rows: list, remaining: list[int] | None, emit: int) -> float:
    """The tokens per request of one step that λ-CAST's planner measures a plan by: the mean
    accept length (``rows[b][0]``) over the requests that had more than ``emit`` tokens (the most
    the step can emit) left before it, so that no budget cut the step short (a request's last
    step emits what its budget allows, and steps near a batch's end would rate whatever plan ran
    them low); 0 when none had (such a step is no measure of its plan). ``remaining``: the
    host's budgets before the step (None: every active request counts)."""
    if remaining is None:
        acc = [r[0] for r in rows if r[0] > 0]
    else:
        acc = [r[0] for r, m in zip(rows, remaining, strict=True) if r[0] > 0 and m > emit]
    return sum(acc) / len(acc) if acc else 0.0


def bucket_for(n: int, capacity: int) -> int:
    """The smallest bucket of ``token_buckets(capacity)`` holding ``n`` tokens (``n`` is clamped
    to ``[1, capacity]``): never smaller than ``n`` while ``n <= capacity``."""
    n = min(max(int(n), 1), capacity)
    for b in token_buckets(capacity):
        if b >= n:
            return b
    return capacity  # unreachable: capacity is the last bucket


@contextlib.contextmanager
def _capture(graph: torch.cuda.CUDAGraph, pool):
    """``torch.cuda.graph`` with Python's garbage collector held off until the capture ends: a
    collection inside the capture can run a destructor that makes a capture-unsafe CUDA call
    (an event query of a freed pinned buffer, a free), which invalidates the capture; the
    collection runs before it instead (``torch.cuda.graph`` collects on entry). ``thread_local``
    keeps other threads' unsafe calls (a data loader's pinned copies) from invalidating it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            yield
    finally:
        if enabled:
            gc.enable()


class PlanBuffers:
    """The buffers of one tree shape (``policy``: its frontier rows w, top-k K, depth D, capacity
    n; ``graft``: of the n verified nodes, how many Graft's successor table fills) over a static
    batch: the ``DraftState``, the candidate -> working-tree-node table, the draft forwards'
    per-layer [B] metadata, the draft's working tree ``dtree`` and the verification tree ``vin``
    (capacity n), and, as contiguous views of ``sb``'s stores shaped by w, the frontier's input
    features ``d_feat`` [B, w, H], the draft forward's outputs ``d_logits`` [B, w, V] (the
    expand's input) and ``d_h`` [B, w, H], and the draft's hidden state per working-tree node
    ``hid``.

    The working tree is the shape's own: the frontier of layer l >= 1 at nodes
    ``1 + (l-1) w .. l w``, capacity ``1 + max(D - 1, 1) w``, so a narrow plan's draft attention
    runs over its own nodes, not the decoder's widest tree (a chain of depth 6 attends over 6
    query rows, not 91). Its num_nodes is ``sb``'s shared [B] metadata row."""

    def __init__(self, sb: _StaticBatch, policy, vin: Tree | None = None, graft: int = 0):
        dev, B = sb.seq_lens.device, sb.B
        self.policy = policy
        self.graft = graft
        w, K, D = policy.max_width, policy.topk, policy.max_depth
        self.w, self.depth, self.capacity = w, D, policy.capacity
        W = w  # the working tree's frontier spacing
        nd = 1 + max(D - 1, 1) * w
        self.dtree = Tree.empty(B, nd, dev)
        self.dtree.anc[:, 0, 0] = 1
        self.dtree.num_nodes = sb.d_meta[0]
        H, V = sb.hidden_size, sb.vocab_size
        self.d_feat = rows_view(sb.feat_store, B, w, H)
        self.d_logits = rows_view(sb.logits_store, B, w, V)
        self.d_h = rows_view(sb.h_store, B, w, H)
        self.hid = rows_view(sb.hid_store, B, nd, H)
        # cand_node[c]: the working-tree node of candidate c's frontier row (candidate c of
        # layer l >= 1 is a child of frontier row (c - l C) // K of layer l, node 1 + (l-1) W +
        # that row; layer 0's candidates are the root's children); the last entry, which a
        # frontier index of -1 reads, is the root
        C = w * K
        c = torch.arange(D * C, device=dev)
        lay = c // C
        row = torch.where(lay > 0, 1 + (lay - 1) * W + (c - lay * C) // K, 0)
        self.cand_node = torch.cat([row, row.new_zeros(1)])
        # layer i's [B] metadata = meta_base[i] + meta_coef[i] * active: num_nodes 1 + i W,
        # q_start 1 + (i-1) W (0 at layer 0), q_len w rows (1 at layer 0; CAST with thresholds
        # sets its bucket instead)
        lay = torch.arange(D, dtype=torch.int32, device=dev)
        zero, first = torch.zeros_like(lay), lay == 0
        q_start = torch.where(first, 0, 1 + (lay - 1) * W)
        q_len = torch.where(first, 1, w).to(torch.int32)
        self.meta_coef = torch.stack([1 + lay * W, zero, q_len], 1)[:, :, None]
        self.meta_base = torch.stack([zero, q_start, zero], 1)[:, :, None]
        self.layer_meta = torch.zeros(D, 3, B, dtype=torch.int32, device=dev)
        root = torch.zeros(B, dtype=torch.int64, device=dev)
        self.state = DraftState.new(policy, root, sb.seq_lens, sb.seq_lens > 0)
        if vin is None:
            vin = Tree.empty(B, policy.capacity, dev)
            vin.anc[:, 0, 0] = 1
        self.vin = vin
        # with grafting: the draft tree is emitted here, its best n - graft nodes kept and the
        # successor table's nodes merged in, into ``vin``
        self.emit = Tree.empty(B, policy.capacity, dev) if graft else None
        self.pruned = Tree.empty(B, policy.capacity, dev) if graft else None


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
        self.hidden_size, self.vocab_size = H, V
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
        # the whole-step path's two result slots (a step launched while the last is collected)
        self.host_packs = [self.host_pack, torch.zeros_like(self.host_pack, pin_memory=pin)]
        self.pack_events = [torch.cuda.Event(enable_timing=True) if pin else None for _ in "ab"]
        # each slot's step start: a whole step's device time is start -> its pack event
        self.step_starts = [torch.cuda.Event(enable_timing=True) if pin else None for _ in "ab"]
        self.step_ready = False
        if dft is None:
            return
        pol = dec.tree_policy
        assert pol is not None
        W = pol.max_width
        self.dkv = dft.make_cache(B, max_len, page_size=dec.page_size, seed=2)
        # working-tree scratch shared by every tree shape (each PlanBuffers has its own tree, at
        # most Nd nodes): a node's own ancestor bit; the stores of the draft's hidden state per
        # node and of the frontier's inputs and outputs, which each shape views at its own row
        # count (``rows_view``; one shape runs at a time)
        self.self_bits = torch.zeros(Nd, anc_words(Nd), dtype=torch.int32, device=dev)
        for k in range(Nd):
            self.self_bits[k, k // 32] = bit_value(k)
        self.hid_store = torch.zeros(B * Nd * H, dtype=wdtype, device=dev)
        self.feat_store = torch.zeros(B * W * H, dtype=wdtype, device=dev)
        # The draft forward's per-layer [B] inputs share one buffer (one copy per layer): the
        # working tree's num_nodes, q_start and q_len (``PlanBuffers.layer_meta``)
        self.d_meta = torch.zeros(3, B, dtype=torch.int32, device=dev)
        self.d_qs, self.d_qlen = self.d_meta[1], self.d_meta[2]
        self.logits_store = torch.zeros(B * W * V, dtype=torch.float32, device=dev)
        self.h_store = torch.zeros(B * W * H, dtype=wdtype, device=dev)
        # the catch-up's inputs, viewed [B, R] and [B, R, H] at its bucket R (``catchup_rows``)
        self.c_tok_store = torch.zeros(B * N, dtype=torch.int64, device=dev)
        self.c_feat_store = torch.zeros(B * N * H, dtype=wdtype, device=dev)
        self.c_len = torch.zeros(B, dtype=torch.int32, device=dev)
        self.chains: dict[int, Tree] = {}
        self.emit_buf = Tree.empty(B, N, dev)
        self.pruned_buf = Tree.empty(B, N, dev)  # the emitted tree pruned (Graft's policies)
        self.plans: dict[tuple, PlanBuffers] = {}
        self.default = self.plan_buffers(pol)

    def plan_buffers(self, policy, graft: int = 0) -> PlanBuffers:
        """The draft buffers of ``policy``'s tree shape with ``graft`` grafted nodes (allocated
        on first use, outside any capture); the decoder's own policy verifies into ``vin``."""
        # the kind too: a plan's EagleStatic of the λ-CAST policy's own maxima has its shape,
        # and must draft as a fixed tree, not with thresholds the policy does not have
        key = (type(policy), policy.max_width, policy.topk, policy.max_depth, policy.capacity,
               graft)  # fmt: skip
        pb = self.plans.get(key)
        if pb is None:
            own = policy is self.dec.tree_policy
            pb = self.plans[key] = PlanBuffers(self, policy, self.vin if own else None, graft)
        return pb

    def catchup_rows(self, R: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The catch-up forward's inputs at bucket ``R``: tokens [B, R] int64 and features
        [B, R, H], contiguous views of the catch-up stores."""
        B, H = self.B, self.hidden_size
        return rows_view(self.c_tok_store, B, R), rows_view(self.c_feat_store, B, R, H)

    def read_pack(self, host_pack: torch.Tensor) -> list:
        """The step's results from the pinned copy, after the one event wait (CUDA)."""
        if self.pack_event is not None:
            self.pack_event.synchronize()
        return host_pack.tolist()

    def verify_body(self, n: int, vin: Tree | None = None):
        """Target forward of the first ``n`` nodes of ``vin`` (default the decoder's own
        verification tree; num_nodes clamped to n, links past it cut: a prefix of a rank-ordered
        tree is a tree). Returns (tree, logits, hidden)."""
        vin = self.vin if vin is None else vin
        tgt, tkv, seq_lens = self.dec.target, self.tkv, self.seq_lens

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
            logits, h = tgt(t.tokens, tkv, seq_lens, t, logits="native")  # accept upcasts
            return t, logits, h

        return body

    def frontier_inputs(self, pb: PlanBuffers, frontier: torch.Tensor, i: int) -> int:
        """The draft forward's inputs for the frontier of layer ``i >= 1`` (rows ``q_start ..
        q_start + w - 1`` of ``pb.dtree``, w = the plan's frontier rows): depth and anc from
        each row's parent node, the parent's target feature, and the layer's [B] metadata.
        Returns q_start."""
        qs = 1 + (i - 1) * pb.w
        dt = pb.dtree
        # one launch on CUDA; the layer's metadata (num_nodes, q_start, q_len) lands in d_meta
        run = fused.frontier_inputs if fused.use_kernels(frontier) else fused.frontier_inputs_torch
        run(frontier, pb.cand_node, qs, dt.depth, dt.anc, self.self_bits, pb.hid, pb.d_feat,
            pb.layer_meta[i], self.d_meta)  # fmt: skip
        return qs

    def draft_body(self, R: int, pb: PlanBuffers | None = None):
        """Draft forward of frontier rows ``d_qs .. d_qs + R - 1`` of ``pb.dtree`` (the frontier
        of ``pb``'s state, default the decoder's own shape): logits and hidden into rows ``:R`` of
        ``pb.d_logits``/``pb.d_h`` (rows past R are stale: invalid frontier rows, ignored by
        ``build_tree_expand``; at R = w, every layer after the first, one contiguous copy each)."""
        dec = self.dec
        dft = dec.draft
        assert dft is not None
        pb = pb or self.default
        tok = pb.state.frontier_tokens

        def body():
            # the frontier's tokens are the draft state's own buffer (the root at layer 0); the
            # logits go straight into the expand's input (the head's one converting copy)
            _, h = dft(
                dec.target, tok[:, :R], pb.d_feat[:, :R], self.dkv, self.seq_lens,
                pb.dtree, self.d_qs, self.d_qlen, logits_out=pb.d_logits[:, :R],
            )  # fmt: skip
            pb.d_h[:, :R].copy_(h)

        return body

    def catchup_body(self, R: int):
        """Draft forward over the accepted path (a chain of ``c_len`` nodes, capacity R)."""
        dec = self.dec
        dft = dec.draft
        assert dft is not None
        if R not in self.chains:
            dev = self.c_tok_store.device
            full = torch.full((self.B,), R, dtype=torch.int32, device=dev)
            ch = chain_tree(torch.zeros(self.B, R, dtype=torch.int64, device=dev), full)
            ch.num_nodes = self.c_len  # the static lengths: nodes past them are masked out
            self.chains[R] = ch
        ch = self.chains[R]
        tok, feat = self.catchup_rows(R)

        def body():
            dft(dec.target, tok, feat, self.dkv, self.seq_lens, ch, outputs=False)

        return body

    def body(self, kind: str, R: int):
        """The forward of ``kind`` (``verify``, ``draft`` or ``catchup``) at token bucket ``R``."""
        make = {"verify": self.verify_body, "draft": self.draft_body, "catchup": self.catchup_body}
        return make[kind](R)

    # ------------------------------------------------------------ the decoding state
    def step_buffers(self) -> None:
        """The static decoding state between steps (allocated once, outside any capture): root,
        root feature, remaining budgets, active mask (seq_lens is ``self.seq_lens``), the
        per-request sampling parameters and the uniforms (a pinned host staging copy on CUDA);
        ``Carry.of(sb)`` hands them to the step."""
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
        # the uniforms' host staging, one per result slot (a step launched ahead may still be
        # waiting to copy the other)
        pin = dev.type == "cuda"
        self.u_hosts = [torch.zeros(B, N, dtype=torch.float32, pin_memory=pin) for _ in range(2)]
        self.rows = torch.arange(B, device=dev)
        self.stops: dict[int, torch.Tensor] = {}
        planner = dec.planner
        if planner is not None:  # λ-CAST: the calibration in, the step's statistics out
            pin = dev.type == "cuda"
            nb = len(planner.rates(B))
            self.rates = torch.zeros(nb, dtype=torch.float32, device=dev)
            self.stats = torch.zeros(planner.size, dtype=torch.float32, device=dev)
            self.host_stats = [
                torch.zeros(planner.size, dtype=torch.float32, pin_memory=pin) for _ in range(2)
            ]  # one per result slot
        self.step_ready = True

    def stop_buf(self, n: int) -> torch.Tensor:
        """The static stop-id buffer of ``n`` ids (the step graphs are keyed by n)."""
        if n not in self.stops:
            self.stops[n] = torch.zeros(n, dtype=torch.int64, device=self.seq_lens.device)
        return self.stops[n]

    def step_state(self) -> list[torch.Tensor]:
        """What a step updates for the next one (restored after each capture warm-up run): the
        carried state and, under Graft, the successor table, which every step's update changes
        (unrestored, a batch that captures would decode over a table two steps ahead of the one
        a batch replaying the same graphs sees)."""
        state = [self.seq_lens, self.root, self.root_feat, self.remaining, self.active]
        if self.dec.table is not None:
            state.append(self.dec.table.table)
        return state


class GraphRunner:
    """A decoder's static batches (one ``_StaticBatch`` per batch size) and the CUDA graphs
    captured over them: each captured on first use (two warm-up runs on a side stream, then the
    capture into the decoder's one graph pool) and replayed after."""

    def __init__(self, dec: Decoder):
        self.dec = dec
        self.batches: dict[int, _StaticBatch] = {}
        self.pool: Any = None

    def batch(self, B: int, max_len: int) -> _StaticBatch:
        """The static batch of ``B`` requests, its caches holding ``max_len`` tokens per request
        (rounded up to a power of two >= 256; a larger need replaces it and its graphs)."""
        sb = self.batches.get(B)
        if sb is None or sb.max_len < max_len:
            cap = 256
            while cap < max_len:
                cap *= 2
            self.batches.pop(B, None)  # its graphs read the old caches: drop them
            sb = _StaticBatch(self.dec, B, cap)
            self.batches[B] = sb
        return sb

    def replay(self, sb: _StaticBatch, key: tuple, body, res: DecodeResult):
        """Run ``body`` (a forward over static buffers) as the CUDA graph of ``key``, capturing it
        on first use (two eager warm-up calls on a side stream first: Triton compiles there);
        eagerly without ``cuda_graphs``. Returns the body's outputs (static while the graph
        lives; consume them before the next replay of any graph: the pool is shared)."""
        if not self.dec.cuda_graphs:
            return body()
        ent = sb.graphs.get(key)
        if ent is None:
            t0 = time.perf_counter()
            cur = torch.cuda.current_stream(self.dec._dev)
            try:
                s = torch.cuda.Stream(self.dec._dev)
                s.wait_stream(cur)
                with torch.cuda.stream(s):
                    for _ in range(2):
                        body()
                cur.wait_stream(s)
                if self.pool is None:
                    self.pool = torch.cuda.graph_pool_handle()
                g = torch.cuda.CUDAGraph()
                with _capture(g, self.pool):
                    out = body()
            except Exception as e:
                # a failed capture_end raises before torch.cuda.graph restores the stream
                torch.cuda.set_stream(cur)
                raise RuntimeError(
                    f"treeops decoder: CUDA-graph capture of the {key[0]} forward failed "
                    f"(policy {self.dec.name}, B={sb.B}, {key[1]} tokens per request): "
                    f"{type(e).__name__}: {e}. Something in that forward syncs with the host or "
                    "allocates outside the graph; cuda_graphs=False runs it eagerly."
                ) from e
            ent = sb.graphs[key] = (g, out)
            res.time_capture += time.perf_counter() - t0
            res.graphs_captured += 1
        g, out = ent
        g.replay()
        return out

    def replay_step(self, sb: _StaticBatch, key: tuple, make_body, res: DecodeResult) -> None:
        """One whole decoding step: the graph of ``key`` (captured on first use) or, without
        ``cuda_graphs``, ``make_body()()`` eagerly. ``make_body()`` builds the step, which
        leaves its results in ``sb.pack`` (and λ-CAST's statistics in ``sb.stats``)."""
        if not self.dec.cuda_graphs:
            make_body()()
            return
        ent = sb.graphs.get(key)
        if ent is None:
            t0 = time.perf_counter()
            # The step updates its own inputs (seq_lens, root, ..., Graft's table): the warm-up
            # runs start from a snapshot, restored after each; what they write beyond seq_lens
            # (verify K/V, compaction, catch-up, drafting scratch) is rewritten identically by
            # the replay.
            state = sb.step_state()
            saved = [t.clone() for t in state]
            cur = torch.cuda.current_stream(self.dec._dev)
            body = make_body()
            try:
                s = torch.cuda.Stream(self.dec._dev)
                s.wait_stream(cur)
                with torch.cuda.stream(s):
                    for _ in range(2):
                        body()
                        for t, v in zip(state, saved):
                            t.copy_(v)
                cur.wait_stream(s)
                if self.pool is None:
                    self.pool = torch.cuda.graph_pool_handle()
                graph = torch.cuda.CUDAGraph()
                with _capture(graph, self.pool):
                    body()
            except Exception as e:
                # a failed capture_end raises before torch.cuda.graph restores the stream
                torch.cuda.set_stream(cur)
                torch.cuda.synchronize(self.dec._dev)
                for t, v in zip(state, saved):
                    t.copy_(v)
                raise RuntimeError(
                    f"treeops decoder: CUDA-graph capture of the whole step failed (policy "
                    f"{self.dec.name}, B={sb.B}): {type(e).__name__}: {e}. Something in the "
                    "step syncs with the host or allocates outside the graph; step_graphs=False "
                    "(per-forward graphs) or cuda_graphs=False runs it otherwise."
                ) from e
            ent = sb.graphs[key] = (graph, None)
            res.time_capture += time.perf_counter() - t0
            res.graphs_captured += 1
        ent[0].replay()


class WholeStep:
    """The whole-step path on the host. ``launch()`` enqueues one step: the sampling uniforms
    (drawn from the CPU generator as on the eager path) and, under λ-CAST, a changed calibration
    copied in; one replay of the step's graph (``GraphRunner.replay_step``; the body eagerly
    without ``cuda_graphs``); its results (and statistics) copied into one of two pinned slots
    and an event recorded. ``collect(launched)`` waits on that event (the step's one host wait)
    and reads the results. ``make_body(pb)`` builds the step (``step.WholeStepBody``)
    for the tree shape ``pb``.

    Two slots let the caller launch step t + 1 before collecting step t: a whole step reads only
    device state, so the host's work on step t's results (appending tokens, the planner)
    overlaps the device running step t + 1, as an engine's overlapped scheduler does.

    Under λ-CAST (``dec.planner``) each step runs the planner's current plan (one graph per plan,
    captured on first use); at its collection, the step's statistics, its measured time (on
    CUDA the step's device time between two events around it, so refills queued between steps
    and host stalls are left out, 0 for the step whose launch captured its graph; elsewhere the
    time since the previous collection, 0 when a capture ran in between) and its emitted tokens
    update the planner, so a plan lags the statistics it follows by the steps in flight; the
    calibration goes to the device at a launch whenever the planner changed it."""

    def __init__(self, dec: Decoder, sb: _StaticBatch, res: DecodeResult, mode: AcceptMode, stops,
                 generator: torch.Generator, make_body: Callable[..., Callable],
                 ctx: int = 0):  # fmt: skip
        self.dec, self.sb, self.res = dec, sb, res
        self.mode, self.stops, self.g = mode, stops, generator
        self.make_body = make_body
        self.key = ("step", mode, 0 if stops is None else stops.numel())
        self.ctx = ctx  # the longest context: prompt + tokens emitted so far
        self.t_last = time.perf_counter()
        self.captures_seen = res.graphs_captured
        self.plans: dict = {}  # plan -> (its buffers, its graph key)
        self.rates_version = -1
        self.remaining: list[int] | None = None  # the host's budgets (``planner_tokens``)
        self.slot = 0
        self.pin = sb.seq_lens.device.type == "cuda"

    def clock(self) -> float:
        return self.dec._clock()

    def launch(self) -> _Launched:
        """Enqueue one step; returns what ``collect`` needs (no host wait here)."""
        dec, sb, res = self.dec, self.sb, self.res
        planner = dec.planner
        B = sb.B
        key, plan, pb = self.key, None, (None if dec.tree_policy is None else sb.default)
        if planner is not None:
            plan = planner.plan(B)
            ent = self.plans.get(plan)
            if ent is None:
                pb = sb.plan_buffers(planner.policy_for(plan), graft=plan.graft)
                ent = self.plans[plan] = (pb, (*key, plan))
            pb, key = ent
            version = planner.rates_version(B)
            if version != self.rates_version:  # a new calibration after a decision
                self.rates_version = version
                # fresh pinned memory (rare): the caching host allocator keeps it until the
                # copy from it ran, which a step launched ahead may still be waiting for
                rates = torch.tensor(planner.rates(B), dtype=torch.float32)
                sb.rates.copy_(rates.pin_memory() if self.pin else rates, non_blocking=True)
        n = dec.capacity if pb is None else pb.capacity
        t0 = self.clock()
        # this launch's pinned slot (uniforms in, results out): the next launch uses the other,
        # and the one after this launch's collection, when its copies have run
        slot, self.slot = self.slot, 1 - self.slot
        if not self.mode.greedy:  # the eager path's draw, in step order
            u = torch.rand(B, dec.capacity, generator=self.g, out=sb.u_hosts[slot])
            sb.u.copy_(u, non_blocking=True)
        start = sb.step_starts[slot]
        if start is not None:
            start.record()
        captures = res.graphs_captured
        dec._graphs.replay_step(sb, key, lambda pb=pb: self.make_body(pb), res)
        captured = res.graphs_captured != captures
        w = 4 + path_cols(dec.graft is not None, pb, n)
        host_pack = sb.host_packs[slot][: B * w].view(B, w)
        host_pack.copy_(sb.pack[: B * w].view(B, w), non_blocking=True)
        host_stats = None
        if planner is not None:
            host_stats = sb.host_stats[slot]
            host_stats.copy_(sb.stats, non_blocking=True)
        event = sb.pack_events[slot]
        if event is not None:
            event.record()
        res.time_step += self.clock() - t0
        # the most tokens a request can emit: the draft's depth + 1, or n where nodes are grafted
        emit = n if pb is None or (dec.graft is not None and pb.graft) else pb.depth + 1
        return _Launched(plan, pb, n, emit, host_pack, host_stats, event, start, captured)

    def collect(self, launched: _Launched) -> list:
        """Wait for ``launched`` and read its results: a row per request (``absorb``'s)."""
        dec, res = self.dec, self.res
        planner = dec.planner

        def read():
            if launched.event is not None:
                launched.event.synchronize()
            return launched.host_pack.tolist()

        rows = dec._wait(res, read)
        now = time.perf_counter()
        step_s, self.t_last = now - self.t_last, now
        if launched.start is not None and launched.event is not None:
            # the step's own device time: a refill queued between two steps, or a host stall
            # (a compile for a refill's new prompt length), is no part of any plan's cost. Its
            # events hold the capture (warm-ups, compiles, the device idle meanwhile) of the
            # graph it is the first replay of: no step time then
            step_s = 0.0 if launched.captured else launched.start.elapsed_time(launched.event) / 1e3
        elif res.graphs_captured != self.captures_seen:
            # host time since the previous collection, which held the launch of this step and
            # of the one launched after it: a capture in either is no step time
            step_s = 0.0
        self.captures_seen = res.graphs_captured
        if planner is not None:
            t_plan = time.perf_counter()
            step_s = dec._step_time(step_s)  # under TP rank 0's: one plan on every rank
            acc = [r[0] for r in rows if r[0] > 0]
            tokens = 0.0
            if acc:
                self.ctx += max(acc)
                tokens = planner_tokens(rows, self.remaining, launched.emit)
                planner.observe(self.sb.B, launched.host_stats.numpy(), launched.plan, tokens,
                                step_s, self.ctx)  # fmt: skip
            p = launched.plan
            lam = round(planner.lam(self.sb.B), 4)
            res.plans.append([p.width, p.depth, p.verify, lam, p.graft, p.topk, step_s, tokens])
            res.time_plan += time.perf_counter() - t_plan
        return rows

    def record(self, res: DecodeResult, launched: _Launched) -> None:
        """The shapes the collected step ``launched`` ran."""
        pb, n = launched.pb, launched.n
        res.verify_buckets.append(n)
        if pb is not None:
            res.draft_buckets.append([1] + [pb.w] * (pb.depth - 1))
        catchup = 0
        if self.dec.draft is not None and pb is not None:
            catchup = catchup_bucket(self.dec, pb)
        res.catchup_buckets.append(catchup)


class _Launched(NamedTuple):
    """A launched whole step: its plan (λ-CAST) and tree shape, the verified bucket n, the most
    tokens it can emit per request, its pinned results (and statistics), their event and the
    event recorded before the step (CUDA; the two time it) and whether its launch captured
    the step's graph (its events then time the capture, not the step)."""

    plan: Any
    pb: PlanBuffers | None
    n: int
    emit: int
    host_pack: torch.Tensor
    host_stats: torch.Tensor | None
    event: Any
    start: Any = None
    captured: bool = False

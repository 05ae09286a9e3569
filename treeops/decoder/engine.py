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

Workarounds of op gaps (see the final report / README): ``kv_append`` has no row offset, so the
draft's frontier-only write shifts its ``seq_lens`` base by ``q_start`` and passes depths relative
to it (possibly negative).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..accept import accept_greedy, accept_sample
from ..build import Cast, DraftState, EagleStatic, build_tree_emit, build_tree_expand
from ..compact import compact_kv
from ..graft import AdjacencyTable, PruneCheckpoints, RankTemplate, graft, prune
from ..reference.cast import CostTable
from ..tree import Tree
from .model import Draft, Target, chain_tree

__all__ = ["POLICIES", "SamplingParams", "DecodeResult", "Decoder", "synthetic_cost_table"]

POLICIES = ("autoregressive", "chain", "EagleStatic", "Cast", "CastGraft")


@dataclass
class SamplingParams:
    """``temperature = 0`` is greedy; ``top_k <= 0`` and ``top_p = 1`` disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0


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
        tgt, dft = self.target, self.draft
        dev = tgt.model.embed_tokens.weight.device
        B = len(prompts)
        if B == 0 or any(len(p) < 1 for p in prompts):
            raise ValueError("expected at least one prompt, each of at least one token")
        budget = [max_new_tokens] * B if isinstance(max_new_tokens, int) else list(max_new_tokens)
        samp = sampling or SamplingParams()
        per_req = samp if isinstance(samp, list) else [samp] * B
        if len(per_req) != B:
            raise ValueError(f"expected {B} SamplingParams, got {len(per_req)}")
        greedy = all(sp.temperature <= 0 for sp in per_req)
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
        H = tgt.cfg.hidden_size
        wdtype = tgt.model.embed_tokens.weight.dtype

        # ---- prefill prompt[:-1] as a chain; the last prompt token is the first root
        t0 = time.perf_counter()
        seq_lens = lens - 1
        P = int(seq_lens.max())
        root = torch.tensor([p[-1] for p in prompts], dtype=torch.int64, device=dev)
        root_feat = torch.zeros(B, H, dtype=wdtype, device=dev)
        if self.graft:
            self.table = AdjacencyTable(tgt.cfg.vocab_size, k=self.adjacency_k, device=dev)
        if P > 0:
            ptok = torch.zeros(B, P, dtype=torch.int64, device=dev)
            for b, p in enumerate(prompts):
                ptok[b, : len(p) - 1] = torch.tensor(p[:-1], dtype=torch.int64)
            chain = chain_tree(ptok, seq_lens)
            zero = torch.zeros(B, dtype=torch.int32, device=dev)
            logits, h = tgt(ptok, tkv, zero, chain)
            if dft is not None:
                feats = torch.cat([torch.zeros_like(h[:, :1]), h[:, :-1]], 1)
                dft(tgt, ptok, feats, dkv, zero, chain)
            last = (seq_lens.long() - 1).clamp(min=0)
            root_feat = torch.where(
                (seq_lens > 0)[:, None], h[torch.arange(B), last], torch.zeros_like(root_feat)
            )
            if self.table is not None:
                self.table.warm_start(ptok, logits.contiguous(), seq_lens)
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
        while bool(active.any()):
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
            # ---- emitted tokens (host bookkeeping)
            alen = acc.accept_len.long()
            path = acc.accepted.long().clamp(min=0)
            path_tok = tree.tokens.gather(1, path)  # [B, N]
            emitted_row = []
            for b in range(B):
                n = int(alen[b])
                emitted_row.append(n)
                if n == 0:
                    continue
                out = path_tok[b, 1:n].tolist() + [int(acc.bonus[b])]
                res.tokens[b].extend(out)
            res.emitted.append(emitted_row)
            res.verified.append(tree.num_nodes.tolist())
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

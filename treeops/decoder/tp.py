"""Tensor-parallel decoding for the example decoder over ``torch.distributed``.

One process per rank, each holding a shard of the target and a whole copy of the draft:

* **Split** (Megatron-style). Attention: rank r keeps KV heads ``[r Hkv/P, (r+1) Hkv/P)`` and
  the query heads of those GQA groups (HF Llama orders q heads group by group, so the groups stay
  whole on one rank), i.e. the rows of q/k/v_proj and the columns of o_proj; its paged KV cache
  holds its KV heads only, and ``kv_append``, ``tree_attention`` and ``compact_kv`` run on that
  shard unchanged. MLP: the rows of gate/up_proj and the columns of down_proj
  (``intermediate_size / P`` each). o_proj and down_proj are ``RowParallelLinear``: the local
  GEMM, then a sum all-reduce over the TP group, so the residual stream is replicated.
* **Replicated**: the embedding, every RMSNorm, and the LM head. The head is replicated rather
  than split over the vocabulary and all-gathered: every rank then computes the full logits
  from the same all-reduced hidden state with no further collective, and the draft (which shares
  the target's embedding and head) runs with no collective at all, inside or outside its graphs.
  The price is the head's GEMM done P times (V·H per token, e.g. ~6% of a Llama-3-8B forward).
  The draft is small: replicated on every rank, it drafts the same tree everywhere.
* **Why the ranks agree.** An all-reduce (NCCL or gloo) reduces each element once and
  distributes that value, so every rank holds bitwise the same residual stream after it; every
  later op (norm, LM head, acceptance, CAST's selection, the planner's statistics, Graft's table
  and merge, compaction's indices, the draft) is replicated computation on bitwise equal inputs,
  hence equal decisions with deterministic kernels. ``check_lockstep=True`` verifies it.
* **Broadcast from rank 0** (on a gloo group: host values, no device sync): each ``generate``
  call's requests (prompts, budgets, stop ids, sampling parameters) and the sampling generator's
  state, so every rank draws the same uniforms; and λ-CAST's measured step time before each
  ``CastPlanner.observe`` (rank 0's clock; the ranks' forwards synchronise in the all-reduces,
  so the times differ by noise only), so every rank's planner keeps the same λ̂ and makes the
  same plan.
* **Cost tables** are per TP degree (a forward's time depends on it): ``CostTable.meta["tp"]``
  records the degree a table was measured at (absent: 1); the decoder refuses a table of another
  degree (``check_cost_table``); ``with_tp_degree`` stamps one.

On CUDA the all-reduces run inside the decoder's CUDA graphs (NCCL collectives can be captured;
the graph paths are otherwise unchanged).

Collective order: every rank runs the same forwards in the same order (prefill, then per step
the verification and, under λ-CAST, the step-time broadcast, then the lockstep digest), so the
sequence of collectives matches as long as the ranks agree; a disagreement is caught by the
lockstep check at the end of the step that produced it, before any forward of another shape.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..cost_table import CostTable
from .model import Target

__all__ = [
    "RowParallelLinear",
    "TPContext",
    "shard_target",
    "tp_degree",
    "check_cost_table",
    "with_tp_degree",
]


class RowParallelLinear(nn.Linear):
    """A bias-free linear layer over a column shard of the input features: ``forward`` is the
    local GEMM followed by a sum all-reduce over ``group``, so every rank returns the full
    output. ``weight``: this rank's [out, in / P] columns."""

    def __init__(self, weight: torch.Tensor, group: Any):
        super().__init__(weight.shape[1], weight.shape[0], bias=False, device="meta")
        self.weight = nn.Parameter(weight.detach().contiguous(), requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = nn.functional.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y


def _rows(lin: nn.Linear, lo: int, hi: int) -> None:
    lin.weight = nn.Parameter(lin.weight.detach()[lo:hi].clone(), requires_grad=False)
    lin.out_features = hi - lo


@torch.no_grad()
def shard_target(target: Target, group: Any) -> Target:
    """Shard ``target`` in place for this process's rank of ``group`` (module docstring) and
    return it. Needs ``num_key_value_heads`` and ``intermediate_size`` divisible by the group's
    size (a ``ValueError`` otherwise). Afterwards ``target.cfg`` is the rank's local config
    (heads and intermediate size divided by P; ``make_cache`` sizes the rank's KV shard from it),
    ``target.full_cfg`` the original, ``target.tp_group`` / ``tp_rank`` / ``tp_size`` the
    group; the shard is for inference (``forward``), not for training or ``save_pretrained``."""
    if getattr(target, "tp_group", None) is not None:
        raise ValueError("Invalid value of target: already sharded")
    rank, P = dist.get_rank(group), dist.get_world_size(group)
    cfg = target.cfg
    Hq, Hkv, D, I = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.intermediate_size,
    )
    if Hkv % P or I % P:
        raise ValueError(
            f"Invalid value of group: {P} ranks must divide num_key_value_heads = {Hkv} and "
            f"intermediate_size = {I}"
        )
    local = dataclasses.replace(
        cfg, num_attention_heads=Hq // P, num_key_value_heads=Hkv // P, intermediate_size=I // P
    )
    q0, q1 = rank * (Hq // P) * D, (rank + 1) * (Hq // P) * D
    k0, k1 = rank * (Hkv // P) * D, (rank + 1) * (Hkv // P) * D
    m0, m1 = rank * (I // P), (rank + 1) * (I // P)
    for layer in target.model.layers:
        a, mlp = layer.self_attn, layer.mlp
        _rows(a.q_proj, q0, q1)
        _rows(a.k_proj, k0, k1)
        _rows(a.v_proj, k0, k1)
        a.o_proj = RowParallelLinear(a.o_proj.weight[:, q0:q1], group)
        _rows(mlp.gate_proj, m0, m1)
        _rows(mlp.up_proj, m0, m1)
        mlp.down_proj = RowParallelLinear(mlp.down_proj.weight[:, m0:m1], group)
        a.cfg = local
        # the fused path's cached concatenations were built from the full weights
        a.__dict__.pop("_wqkv", None)
        mlp.__dict__.pop("_wgu", None)
    target.full_cfg = cfg
    target.cfg = local
    target.tp_group, target.tp_rank, target.tp_size = group, rank, P
    return target


def tp_degree(table: CostTable) -> int:
    """The TP degree ``table`` was measured at: ``meta["tp"]``, 1 when absent."""
    return int(table.meta.get("tp", 1))


def with_tp_degree(table: CostTable, degree: int) -> CostTable:
    """``table`` with ``meta["tp"] = degree`` (a new table; the times are shared)."""
    meta = {**table.meta, "tp": int(degree)}
    return CostTable(table.batch_sizes, table.L, table.target, table.draft, meta)


def check_cost_table(table: CostTable | None, degree: int) -> None:
    """Refuse (``ValueError`` naming ``policy.cost_table``) a table measured at another TP degree
    than ``degree``: its times would misprice every CAST decision."""
    if table is not None and tp_degree(table) != degree:
        raise ValueError(
            f"Invalid value of policy.cost_table: measured at TP degree {tp_degree(table)} "
            f"(meta['tp']), the decoder runs at TP degree {degree} (tp_group); calibrate a table "
            "at this degree or stamp one with treeops.decoder.tp.with_tp_degree"
        )


def _digest(values: Sequence[int]) -> int:
    data = torch.tensor(list(values), dtype=torch.int64).numpy().tobytes()
    return zlib.crc32(data)


class TPContext:
    """The decoder's side of a TP group: the host collectives (requests, step times, lockstep
    digests) on ``cpu_group``, a gloo group over the same ranks (``group`` itself when it is
    gloo), so they need no device tensor and never wait on the device's queue. Creating the gloo
    group is a collective over the default group: every process constructs its decoder."""

    FIELDS = ("accepted lengths", "bonus tokens", "tree tokens")

    def __init__(self, group: Any, check_lockstep: bool = False):
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.src = dist.get_global_rank(group, 0)
        if dist.get_backend(group) == "gloo":
            self.cpu_group = group
        else:
            self.cpu_group = dist.new_group(dist.get_process_group_ranks(group), backend="gloo")
        self.check_lockstep = bool(check_lockstep)

    def sync_requests(self, prompts, max_new_tokens, stop_ids, sampling, generator, max_batch):
        """Rank 0's ``generate`` arguments on every rank, and its generator's state in this
        rank's generator (a new one where this rank passed none); returns them."""
        state = None if generator is None else generator.get_state()
        box = [prompts, max_new_tokens, stop_ids, sampling, state, max_batch]
        dist.broadcast_object_list(box, src=self.src, group=self.cpu_group)
        prompts, max_new_tokens, stop_ids, sampling, state, max_batch = box
        if state is not None:
            generator = generator or torch.Generator()
            generator.set_state(state)
        return prompts, max_new_tokens, stop_ids, sampling, generator, max_batch

    def step_time(self, seconds: float) -> float:
        """Rank 0's measured step time, on every rank (what λ-CAST's planner observes)."""
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.broadcast(t, src=self.src, group=self.cpu_group)
        return float(t.item())

    def check_step(self, step: int, rows: list, tree_tokens: torch.Tensor | None) -> None:
        """All-gather this step's digest (accepted lengths, bonus tokens, the verified tree's
        tokens); a ``RuntimeError`` naming the step, the ranks and the fields if any rank's
        differs from rank 0's."""
        toks = [] if tree_tokens is None else tree_tokens.flatten().tolist()
        # the path's tokens are part of the tree: a differing accepted path shows there too
        toks += [t for r in rows for t in r[4:]]
        mine = torch.tensor(
            [_digest([r[0] for r in rows]), _digest([r[1] for r in rows]), _digest(toks)],
            dtype=torch.int64,
        )
        out = [torch.empty_like(mine) for _ in range(self.size)]
        dist.all_gather(out, mine, group=self.cpu_group)
        bad = [r for r in range(1, self.size) if not torch.equal(out[r], out[0])]
        if bad:
            diff = sorted(
                {self.FIELDS[i] for r in bad for i in range(3) if out[r][i] != out[0][i]},
                key=self.FIELDS.index,
            )
            raise RuntimeError(
                f"tensor-parallel ranks out of lockstep at step {step}: rank(s) {bad} differ "
                f"from rank 0 in {', '.join(diff)}"
            )


def verified_tokens(step: Any, launched: Any = None) -> torch.Tensor | None:
    """The tokens of the tree the step just verified, padding as -1 (for the lockstep digest):
    the eager step's ``tree``, the static step's verification tree, or the whole step's plan
    buffers' (read after the step, before the next launch)."""
    if launched is not None:
        tree = step.sb.vin if launched.pb is None else launched.pb.vin
    elif hasattr(step, "vin"):
        tree = step.vin
    else:
        tree = getattr(step, "tree", None)
    if tree is None:
        return None
    j = torch.arange(tree.tokens.shape[1], device=tree.tokens.device)
    return torch.where(j[None, :] < tree.num_nodes[:, None].long(), tree.tokens, -1).cpu()

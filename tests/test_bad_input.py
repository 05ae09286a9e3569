"""Every public op rejects bad input with a ValueError that names the argument.

One table of valid calls (one per op); from each, every tensor argument is corrupted in turn —
wrong dtype, wrong shape, another device ("meta"), a strided view (stride 2 along the last
dimension, same values) and, for [B] vectors, a stride-0 ``expand`` — and, with ``validate=True``,
out-of-range indices, malformed trees and NaN scores. The valid call itself must succeed, so a
check that rejects everything would fail here too; likewise a strided view of an argument whose
strides the kernel receives (``STRIDES_OK``) must still be accepted.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

import treeops
from strategies import make_tree, paged_kv

B, N, V, H_Q, H_KV, D = 2, 8, 32, 4, 2, 64


def _tree() -> treeops.Tree:
    rng = random.Random(0)
    return make_tree([[-1, 0, 0, 1, 3], [-1, 0, 1]], N, V, rng)


def _kv():
    return paged_kv([20 + N, 9 + N], 16, H_KV, D, torch.float32, random.Random(1))


@dataclass
class Op:
    name: str
    fn: Callable
    args: Callable[[], dict]  # fresh keyword arguments of a valid call
    validate_cases: list[tuple[str, Callable[[dict], None], str]] = field(default_factory=list)


def _attention_args():
    kv = _kv()
    return dict(
        q=torch.randn(B, N, H_Q, D),
        k_cache=kv.k_cache,
        v_cache=kv.v_cache,
        block_table=kv.block_table,
        seq_lens=torch.tensor([20, 9], dtype=torch.int32),
        tree=_tree(),
        q_start=torch.tensor([0, 1], dtype=torch.int32),
        q_len=torch.tensor([N, 2], dtype=torch.int32),
    )


def _kv_append_args():
    a = _attention_args()
    t = a.pop("tree")
    for k in ("q", "q_start", "q_len"):
        a.pop(k)
    return dict(
        k=torch.randn(B, N, H_KV, D),
        v=torch.randn(B, N, H_KV, D),
        **a,
        num_tokens=t.num_nodes,
        depth=t.depth,
    )


def _accept_args():
    return dict(
        tree=_tree(),
        target_logits=torch.randn(B, N, V),
        stop_ids=torch.tensor([V - 1, V - 2]),
        max_new_tokens=torch.tensor([4, 6], dtype=torch.int32),
    )


def _sample_args():
    return dict(
        **_accept_args(),
        temperature=torch.tensor([0.7, 1.0]),
        top_k=torch.tensor([0, 5], dtype=torch.int32),
        top_p=torch.tensor([0.9, 1.0]),
        uniforms=torch.rand(B, N),
    )


def _compact_args():
    kv = _kv()
    t = _tree()
    acc = treeops.accept_greedy(t, torch.randn(B, N, V))
    return dict(
        k_caches=kv.k_cache[None].clone(),
        v_caches=kv.v_cache[None].clone(),
        block_table=kv.block_table,
        seq_lens=torch.tensor([20, 9], dtype=torch.int32),
        tree=t,
        accepted=acc.accepted,
        accept_len=acc.accept_len,
        out=torch.empty(B, dtype=torch.int32),
    )


def _table():
    table = treeops.AdjacencyTable(V, k=4)
    table.warm_start(torch.randint(0, V, (1, 12)), torch.randn(1, 12, V))
    return table


def _graft_args():
    return dict(
        tree=_tree(),
        table=_table(),
        template=treeops.RankTemplate.chain(3),
        budget=torch.tensor([N, 5], dtype=torch.int32),
        count=torch.tensor([3, 2], dtype=torch.int32),
    )


def _graft_merge_args():
    a = _graft_args()
    r = a["table"].retrieve(a["tree"].tokens[:, 0], a["template"])
    return dict(tree=a["tree"], retrieved=r, budget=a["budget"])


def _retrieve_args():
    return dict(
        self=_table(),
        root_tokens=_tree().tokens[:, 0],  # a column: its stride is passed to the kernel
        template=treeops.RankTemplate.chain(3),
        count=torch.tensor([3, 2], dtype=torch.int32),
    )


def _update_args():
    table = treeops.AdjacencyTable(V, k=4)
    return dict(self=table, tree=_tree(), target_logits=torch.randn(B, N, V))


def _update_ids_args():
    table = treeops.AdjacencyTable(V, k=4)
    ids = torch.randint(-1, V, (B, N, 3), dtype=torch.int32)
    return dict(self=table, tree=_tree(), topk_ids=ids)


def _warm_start_args():
    return dict(
        self=treeops.AdjacencyTable(V, k=4),
        prompt_tokens=torch.randint(0, V, (B, 12)),
        prefill_logits=torch.randn(B, 12, V),
        lengths=torch.tensor([12, 7], dtype=torch.int32),
    )


def _cast_width_args():
    return dict(scores=torch.rand(B, 6), costs=torch.linspace(1, 2, 4), C1=0.5)


def _set(key: str, value_fn: Callable[[dict], object]) -> Callable[[dict], None]:
    def apply(a: dict) -> None:
        a[key] = value_fn(a)

    return apply


def _bad_parent(a: dict) -> None:
    a["tree"].parents[0, 3] = 3  # parents[i] must be < i


def _nan_score(a: dict) -> None:
    a["tree"].scores[0, 1] = float("nan")


TREE_CASES = [
    ("malformed tree", _bad_parent, r"Invalid tree: request 0: parents\[3\] = 3"),
    ("NaN tree score", _nan_score, r"scores\[1\] = nan"),
]

OPS = [
    Op(
        "tree_attention",
        treeops.tree_attention,
        _attention_args,
        TREE_CASES
        + [
            (
                "block_table out of range",
                _set("block_table", lambda a: a["block_table"] + 1000),
                r"Invalid value in block_table",
            )
        ],
    ),
    Op(
        "kv_append",
        treeops.kv_append,
        _kv_append_args,
        [
            (
                "negative seq_lens",
                _set("seq_lens", lambda a: a["seq_lens"] - 100),
                r"Invalid value in seq_lens",
            )
        ],
    ),
    Op("accept_greedy", treeops.accept_greedy, _accept_args, TREE_CASES),
    Op("accept_sample", treeops.accept_sample, _sample_args, TREE_CASES),
    Op("compact_kv", treeops.compact_kv, _compact_args, TREE_CASES),
    Op(
        "graft",
        treeops.graft,
        _graft_args,
        TREE_CASES
        + [
            (
                "zero budget for an active request",
                _set("budget", lambda a: torch.tensor([0, 5], dtype=torch.int32)),
                r"Invalid value in budget: expected >= 1 for an active request",
            )
        ],
    ),
    Op("graft_merge", treeops.graft_merge, _graft_merge_args, TREE_CASES),
    Op("prune", treeops.prune, lambda: dict(tree=_tree(), keep=3), TREE_CASES),
    Op(
        "AdjacencyTable.update",
        lambda self, **kw: self.update(**kw),
        _update_args,
        TREE_CASES
        + [
            (
                "token beyond the vocabulary",
                lambda a: a["tree"].tokens.__setitem__((0, 1), V + 5),
                r"Invalid value in tokens",
            )
        ],
    ),
    Op(
        "AdjacencyTable.update(topk_ids)",
        lambda self, **kw: self.update(**kw),
        _update_ids_args,
        [
            (
                "id beyond the vocabulary",
                lambda a: a["topk_ids"].__setitem__((0, 1, 0), V),
                r"Invalid value in topk_ids",
            )
        ],
    ),
    Op(
        "AdjacencyTable.warm_start",
        lambda self, **kw: self.warm_start(**kw),
        _warm_start_args,
        [
            (
                "length beyond L",
                _set("lengths", lambda a: torch.tensor([13, 7], dtype=torch.int32)),
                r"Invalid value in lengths",
            )
        ],
    ),
    Op("AdjacencyTable.retrieve", lambda self, **kw: self.retrieve(**kw), _retrieve_args),
    Op(
        "cast_width",
        treeops.cast_width,
        _cast_width_args,
        [
            (
                "NaN score",
                lambda a: a["scores"].__setitem__((0, 0), float("nan")),
                r"Invalid value in scores",
            ),
            (
                "negative score",
                lambda a: a["scores"].__setitem__((0, 0), -0.5),
                r"Invalid value in scores",
            ),
        ],
    ),
]


def _tensor_args(a: dict) -> list[str]:
    return [k for k, v in a.items() if isinstance(v, torch.Tensor)]


def _wrong_dtype(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int16) if t.is_floating_point() else t.to(torch.float64)


@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
def test_valid_call_succeeds(op):
    op.fn(**op.args())


# Arguments whose strides the kernel receives (any strides, last dimension included): a strided
# view must be accepted. Every other tensor argument is read at least partly as unit-stride.
STRIDES_OK = {
    "tree_attention": {"q", "k_cache", "v_cache"},
    "kv_append": {"k", "v", "k_cache", "v_cache", "depth"},
    "accept_greedy": {"target_logits"},
    "accept_sample": {"target_logits"},
    "compact_kv": {"k_caches", "v_caches"},
    "AdjacencyTable.retrieve": {"root_tokens"},
    "cast_width": {"scores", "costs"},  # PyTorch code, no kernel
}
TREE_FIELDS = treeops.Tree.FIELDS
RETRIEVED_FIELDS = ("tokens", "parents", "depth", "num_nodes")


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as ``t`` in a view with stride 2 along the last dimension."""
    return torch.stack([t, torch.zeros_like(t)], dim=-1)[..., 0]


def _expanded(t: torch.Tensor) -> torch.Tensor:
    """A stride-0 view of ``t``'s first element, ``t``'s shape (1-D)."""
    return t[:1].expand_as(t)


def _corruptions():
    for op in OPS:
        a = op.args()
        for arg in _tensor_args(a):
            kinds = ["dtype", "shape", "device", "strided"]
            if a[arg].dim() == 1 and arg not in STRIDES_OK.get(op.name, ()):
                kinds.append("expanded")
            for kind in kinds:
                yield pytest.param(op, arg, kind, id=f"{op.name}-{arg}-{kind}")
        # the tree's own fields
        if "tree" in a:
            for f in ("parents", "anc", "scores"):
                yield pytest.param(op, f"tree.{f}", "dtype", id=f"{op.name}-tree.{f}-dtype")
            for f in TREE_FIELDS:
                yield pytest.param(op, f"tree.{f}", "strided", id=f"{op.name}-tree.{f}-strided")
            yield pytest.param(op, "tree.num_nodes", "expanded", id=f"{op.name}-tree.nn-expanded")
        if "retrieved" in a:
            for f in RETRIEVED_FIELDS:
                yield pytest.param(
                    op, f"retrieved.{f}", "strided", id=f"{op.name}-retrieved.{f}-strided"
                )


@pytest.mark.parametrize("op, arg, kind", list(_corruptions()))
def test_corrupted_argument_is_named(op, arg, kind):
    a = op.args()
    if "." in arg:  # a field of the tree / of retrieved
        holder, name = arg.split(".")
        obj = a[holder]
        t = getattr(obj, name)
        if kind == "dtype":
            setattr(obj, name, _wrong_dtype(t))
            pattern = rf"Invalid dtype of {re.escape(arg)}: expected"
        else:
            setattr(obj, name, _strided(t) if kind == "strided" else _expanded(t))
            pattern = rf"Invalid stride of {re.escape(arg)}: expected a contiguous tensor"
        with pytest.raises(ValueError, match=pattern):
            op.fn(**a)
        return
    t = a[arg]
    if kind == "dtype":
        a[arg] = _wrong_dtype(t)
        pattern = rf"Invalid dtype of {arg}: expected"
    elif kind == "shape":
        a[arg] = t.reshape(-1) if t.dim() > 1 else t[None].expand(3, *t.shape)
        pattern = rf"Invalid (shape|stride)[^:]* of {arg}\b"
    elif kind in ("strided", "expanded"):
        a[arg] = _strided(t) if kind == "strided" else _expanded(t)
        assert a[arg].stride(-1) != 1
        if arg in STRIDES_OK.get(op.name, ()):
            op.fn(**a)  # the kernel takes these strides: accepted
            return
        pattern = rf"Invalid (stride|layout) of {arg}: expected "
    else:
        a[arg] = t.to("meta")
        pattern = r"Invalid device of \w+: expected"
    with pytest.raises(ValueError, match=pattern):
        op.fn(**a)


def _validate_cases():
    for op in OPS:
        for what, corrupt, pattern in op.validate_cases:
            yield pytest.param(op, corrupt, pattern, id=f"{op.name}-{what}")


@pytest.mark.parametrize("op, corrupt, pattern", list(_validate_cases()))
def test_validate_rejects(op, corrupt, pattern):
    a = op.args()
    corrupt(a)
    with pytest.raises(ValueError, match=pattern):
        op.fn(**a, validate=True)


# ------------------------------------------------------------ strides beyond the table's arguments
def test_strided_workspace_is_rejected():
    a = _attention_args()
    a["workspace"] = torch.zeros(16)[::2]
    with pytest.raises(ValueError, match=r"Invalid stride of workspace: expected a contiguous"):
        treeops.tree_attention(**a)


@pytest.mark.parametrize("field_name", TREE_FIELDS)
@pytest.mark.parametrize("op", ["graft", "graft_merge", "build_tree_emit"])
def test_strided_out_tree_is_rejected(op, field_name):
    if op == "build_tree_emit":
        pol = treeops.EagleStatic(depth=2, topk=2, budget=N)
        st = treeops.DraftState.new(pol, torch.tensor([1, 2]), torch.tensor([5, 6]))
        treeops.build_tree_expand(torch.randn(B, 2, V), st, pol)
        out = treeops.Tree.empty(B, N)
        setattr(out, field_name, _strided(getattr(out, field_name)))

        def call():
            treeops.build_tree_emit(st, pol, out=out)
    else:
        a = _graft_args() if op == "graft" else _graft_merge_args()
        out = treeops.Tree.empty(B, N)
        setattr(out, field_name, _strided(getattr(out, field_name)))
        fn = treeops.graft if op == "graft" else treeops.graft_merge

        def call():
            fn(**a, out=out)

    with pytest.raises(ValueError, match=rf"Invalid stride of out\.{field_name}: expected"):
        call()


@pytest.mark.parametrize(
    "field_name",
    ["root_tokens", "seq_lens", "cand_tokens", "cand_scores", "frontier", "frontier_scores"],
)
def test_strided_draft_state_is_rejected(field_name):
    pol = treeops.EagleStatic(depth=2, topk=2, budget=N)
    st = treeops.DraftState.new(pol, torch.tensor([1, 2]), torch.tensor([5, 6]))
    setattr(st, field_name, _strided(getattr(st, field_name)))
    with pytest.raises(ValueError, match=rf"Invalid stride of state\.{field_name}: expected"):
        treeops.build_tree_expand(torch.randn(B, 2, V), st, pol)


def test_draft_state_inputs_are_copied_whatever_their_strides():
    # DraftState.new/reset copy root_tokens/seq_lens/active into the state's own buffers
    pol = treeops.EagleStatic(depth=2, topk=2, budget=N)
    roots, lens = torch.tensor([[1, 0], [2, 0]])[:, 0], torch.tensor([5]).expand(B)
    st = treeops.DraftState.new(pol, roots, lens, torch.ones(1, dtype=torch.bool).expand(B))
    assert st.root_tokens.tolist() == [1, 2] and st.seq_lens.tolist() == [5, 5]
    st.reset(roots, lens)
    treeops.build_tree_expand(torch.randn(B, 2, V), st, pol)


def test_size_one_last_dim_with_odd_stride_is_rejected():
    # [B, 1] with strides (1, B) counts as contiguous for torch, but the acceptance kernel
    # reads tree.tokens / tree.parents with a unit stride along N: rejected for every tree field
    t = treeops.Tree.from_parents(
        torch.full((B, 1), -1, dtype=torch.int32), torch.ones(B, dtype=torch.int32)
    )
    t.tokens = torch.zeros(1, B, dtype=torch.int64).t()
    assert t.tokens.is_contiguous() and t.tokens.stride(-1) != 1
    with pytest.raises(ValueError, match=r"Invalid stride of tree\.tokens"):
        treeops.accept_greedy(t, torch.randn(B, 1, V))


def test_update_with_strided_topk_ids_leaves_the_table_alone():
    a = _update_ids_args()
    table = a.pop("self")
    table.warm_start(torch.randint(0, V, (1, 12)), torch.randn(1, 12, V))
    before = table.table.clone()
    with pytest.raises(ValueError, match=r"Invalid stride of topk_ids"):
        table.update(a["tree"], topk_ids=_strided(a["topk_ids"]))
    assert torch.equal(table.table, before)
    table.update(a["tree"], topk_ids=a["topk_ids"])  # and the table still works


def test_single_page_block_table_column_is_accepted():
    # a [B, 1] block table: its last stride is never used
    a = _attention_args()
    kv = paged_kv([8 + N, 3 + N], None, H_KV, D, torch.float32, random.Random(2))
    a.update(
        k_cache=kv.k_cache,
        v_cache=kv.v_cache,
        block_table=torch.cat([kv.block_table, kv.block_table], 1)[:, :1].t().contiguous().t(),
        seq_lens=torch.tensor([8, 3], dtype=torch.int32),
    )
    assert a["block_table"].shape == (B, 1) and a["block_table"].stride(-1) != 1
    treeops.tree_attention(**a)

"""Every public op rejects bad input with a ValueError that names the argument.

One table of valid calls (one per op); from each, every tensor argument is corrupted in turn —
wrong dtype, wrong shape, another device ("meta") — and, with ``validate=True``, out-of-range
indices, malformed trees and NaN scores. The valid call itself must succeed, so a check that
rejects everything would fail here too.
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
    )


def _kv_append_args():
    a = _attention_args()
    t = a.pop("tree")
    a.pop("q")
    return dict(
        k=torch.randn(B, N, H_KV, D),
        v=torch.randn(B, N, H_KV, D),
        **a,
        num_tokens=t.num_nodes,
        depth=t.depth,
    )


def _accept_args():
    return dict(tree=_tree(), target_logits=torch.randn(B, N, V))


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
    )


def _graft_args():
    table = treeops.AdjacencyTable(V, k=4)
    table.warm_start(torch.randint(0, V, (1, 12)), torch.randn(1, 12, V))
    return dict(tree=_tree(), table=table, template=treeops.RankTemplate.chain(3), budget=N)


def _graft_merge_args():
    a = _graft_args()
    r = a["table"].retrieve(a["tree"].tokens[:, 0], a.pop("template"))
    a.pop("table")
    return dict(tree=a["tree"], retrieved=r, budget=a["budget"])


def _update_args():
    table = treeops.AdjacencyTable(V, k=4)
    return dict(self=table, tree=_tree(), target_logits=torch.randn(B, N, V))


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


def _corruptions():
    for op in OPS:
        for arg in _tensor_args(op.args()):
            for kind in ("dtype", "shape", "device"):
                yield pytest.param(op, arg, kind, id=f"{op.name}-{arg}-{kind}")
        # the tree's own fields
        if "tree" in op.args():
            for f in ("parents", "anc", "scores"):
                yield pytest.param(op, f"tree.{f}", "dtype", id=f"{op.name}-tree.{f}-dtype")


@pytest.mark.parametrize("op, arg, kind", list(_corruptions()))
def test_corrupted_argument_is_named(op, arg, kind):
    a = op.args()
    if arg.startswith("tree."):
        tree = a["tree"]
        name = arg.split(".")[1]
        setattr(tree, name, _wrong_dtype(getattr(tree, name)))
        with pytest.raises(ValueError, match=rf"Invalid dtype of {re.escape(arg)}: expected"):
            op.fn(**a)
        return
    t = a[arg]
    if kind == "dtype":
        a[arg] = _wrong_dtype(t)
        pattern = rf"Invalid dtype of {arg}: expected"
    elif kind == "shape":
        a[arg] = t.reshape(-1) if t.dim() > 1 else t[None].expand(3, *t.shape)
        pattern = rf"Invalid (shape|stride)[^:]* of {arg}\b"
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

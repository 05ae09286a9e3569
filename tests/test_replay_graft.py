"""Graft's replays (``treeops.kernels._replay``): a repeated plain call of ``AdjacencyTable``'s
update, warm start and retrieval, ``graft_merge``, ``graft``, ``graft_tail``, ``prune`` and
``PruneCheckpoints.check`` launches, argument for argument, what the op's Python path launches
for the same tensors, with the table's, template's and caller's buffers re-read per call."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from replay_stand_in import PRELUDE

import treeops

ROOT = Path(__file__).resolve().parent.parent

_STAND_IN = (
    PRELUDE
    + r"""
GR, GT = sys.modules["treeops.graft"], sys.modules["treeops.graft_tail"]
PR = sys.modules["treeops.prune"]
from treeops.kernels import _launch
from treeops.kernels import graft as KG
from treeops.kernels import graft_update as KGU

# every _launch.scratch set handed out (held, so that no address is reused): the graft kernels'
# sets are several allocations, whose offsets to each other differ between a replay (the cached
# set) and the op's own call (a recording's fresh set), so the harness's norm names a scratch
# pointer by its set's key, its index in the set and its offset in it (NAMED)
_scratch = _launch.scratch


def scratch(key, device, make):
    bufs = _scratch(key, device, make)
    NAMED.append((str(key[0]), bufs))  # the harness's norm names pointers into these
    return bufs


_launch.scratch = KG.scratch = scratch


class CudaLike(treeops.AdjacencyTable):
    # a CPU table with a CUDA table's own buffers: the owner array and the update workspace
    # cached per shape (on CPU the table has neither and the launcher makes its own workspace)
    def __init__(self, V, k):
        super().__init__(V, k)
        self._owner = torch.full((V,), 2**31 - 1, dtype=torch.int32)

    def _update_workspace(self, tokens, logits):
        if logits is None or tokens.numel() == 0:
            return None, None
        key = KGU.update_workspace_key(tokens.numel(), self.vocab_size, self.k, self.device)
        if key not in self._workspace:
            n = key[0] * key[1] * key[2]
            self._workspace[key] = (torch.empty(n), torch.empty(n, dtype=torch.int32))
        return self._workspace[key]


def bufs(table, *templates):
    # the table's (and templates') own tensors as inputs of run()'s comparison: keyword
    # arguments that the wrappers below drop before the call
    ts = [table.table, table._owner, *[t for p in table._workspace.values() for t in p]]
    for tpl in templates:
        ts += list(tpl.tensors(table.device))
    return {f"buf_{i}": t for i, t in enumerate(ts) if t is not None}


def plain(kw):
    return {k: v for k, v in kw.items() if not k.startswith("buf_")}


def update(table, *a, **kw):
    return table.update(*a, **plain(kw))


def warm_start(table, *a, **kw):
    return table.warm_start(*a, **plain(kw))


def retrieve(table, *a, **kw):
    r = table.retrieve(*a, **plain(kw))
    return (r.tokens, r.parents, r.depth, r.num_nodes)


def graft_merge(tree, retrieved, *a, **kw):
    return treeops.graft_merge(tree, retrieved, *a, **plain(kw))


def graft(tree, table, *a, **kw):
    return treeops.graft(tree, table, *a, **plain(kw))


def graft_tail(tree, table, *a, **kw):
    return treeops.graft_tail(tree, table, *a, **plain(kw))


def ptrs(call):
    return {x.data_ptr() if isinstance(x, torch.Tensor) else x for x in call}


with bench_host.launchers_on_cpu():
    g = torch.Generator().manual_seed(0)
    B, N, V, K = 2, 8, 64, 4
    par = torch.tensor([[-1] + [(i - 1) // 2 for i in range(1, N)]] * B, dtype=torch.int32)
    tree = treeops.Tree.from_parents(par, torch.tensor([N, 5], dtype=torch.int32),
                                     torch.arange(B * N).view(B, N) % 50 + 1,
                                     torch.linspace(1, 0.1, N).expand(B, N).contiguous())
    tpl = treeops.RankTemplate.from_paths([(0,), (1,), (0, 0), (0, 1), (0, 0, 0)])
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)
    tab = CudaLike(V, K)
    tab.table.copy_(torch.randint(0, V, (V, K), generator=g, dtype=torch.int32))
    topk = lambda: torch.randint(0, V, (B, N, K), generator=g, dtype=torch.int32)
    logits = lambda: torch.randn(B, N, V, generator=g)
    res = {}

    def upd(form):
        def make():
            kw = dict(topk_ids=topk()) if form == "ids" else dict(target_logits=logits())
            tab._update_workspace(tree.tokens, kw.get("target_logits"))
            return (tab, tree), {**kw, **bufs(tab)}
        return make

    res["update_ids"] = run("update_ids", GR._UPDATE_REPLAYS, update, upd("ids"))
    res["update_logits"] = run("update_logits", GR._UPDATE_REPLAYS, update, upd("logits"))

    def warm(form, lengths):
        def make():
            toks = torch.randint(0, V, (B, 6), generator=g)
            kw = (dict(topk_ids=torch.randint(0, V, (B, 6, K), generator=g, dtype=torch.int32))
                  if form == "ids" else dict(prefill_logits=torch.randn(B, 6, V, generator=g)))
            if lengths:
                kw["lengths"] = i32(6, 3)
            tab._update_workspace(toks, kw.get("prefill_logits"))
            return (tab, toks), {**kw, **bufs(tab)}
        return make

    for form in ("ids", "logits"):
        for lengths in (False, True):
            name = f"warm_{form}" + ("_lengths" if lengths else "")
            res[name] = run(name, GR._WARM_START_REPLAYS, warm_start, warm(form, lengths))

    def retr(count):
        def make():
            kw = {} if count is None else dict(count=i32(1, 3) if count == "t" else count)
            return (tab, tree.tokens[:, 0], tpl), {**kw, **bufs(tab, tpl)}
        return make

    for count in (None, 2, "t"):
        res[f"retrieve_{count}"] = run(f"retrieve_{count}", GR._RETRIEVE_REPLAYS, retrieve,
                                       retr(count))
    r = tab.retrieve(tree.tokens[:, 0], tpl)
    n0 = GR._RETRIEVE_REPLAYS.replays
    r = tab.retrieve(tree.tokens[:, 0], tpl)
    res["retrieved"] = dict(replayed=GR._RETRIEVE_REPLAYS.replays - n0,
                            type=type(r).__name__, max_depth=r.max_depth)
    # the merge's input from the reference (the stub kernels compute nothing; validate reads it)
    from treeops.reference import graft as RG
    retrieved = RG.adjacency_retrieve(tab.table, tree.tokens[:, 0], tpl, tpl.size - 1)

    def merge(budget, out):
        def make():
            kw = dict(out=treeops.Tree.uninitialized(B, N)) if out else {}
            fields = (retrieved.tokens, retrieved.parents, retrieved.depth, retrieved.num_nodes)
            kw.update({f"buf_{i}": t for i, t in enumerate(fields)})
            return (tree, retrieved, i32(6, 3) if budget == "t" else budget), kw
        return make

    for budget, out in ((N, False), (5, False), ("t", False), (6, True), ("t", True)):
        name = f"merge_{budget}" + ("_out" if out else "")
        res[name] = run(name, GR._GRAFT_MERGE_REPLAYS, graft_merge, merge(budget, out))

    def grf(budget, count, out, table=lambda: tab, template=lambda: tpl):
        def make():
            t, template_ = table(), template()
            kw = dict(out=treeops.Tree.uninitialized(B, N)) if out else {}
            c = i32(0, 2) if count == "t" else count
            return (tree, t, template_, i32(7, 4) if budget == "t" else budget, c), \
                {**kw, **bufs(t, template_)}
        return make

    for budget, count, out in ((N, None, False), (5, 3, False), ("t", "t", False),
                               (6, None, True), ("t", 2, True)):
        name = f"graft_{budget}_{count}" + ("_out" if out else "")
        res[name] = run(name, GR._GRAFT_REPLAYS, graft, grf(budget, count, out))

    def tail(count, budget, out, max_count=None, table=lambda: tab):
        def make():
            t = table()
            kw = dict(out=treeops.Tree.uninitialized(B, N)) if out else {}
            if max_count is not None:
                kw["max_count"] = max_count
            return (tree, t, i32(2, 1) if count == "t" else count,
                    i32(7, 4) if budget == "t" else budget), {**kw, **bufs(t)}
        return make

    for count, budget, out, mc in ((3, N, False, None), ("t", 6, False, None),
                                   (2, "t", True, None), ("t", "t", False, 4)):
        name = f"tail_{count}_{budget}" + ("_out" if out else "") + (f"_max{mc}" if mc else "")
        res[name] = run(name, GT._GRAFT_TAIL_REPLAYS, graft_tail, tail(count, budget, out, mc))

    for keep, out in ((3, False), (treeops.NO_PRUNE, False), ("t", False), (5, True)):
        name = f"prune_{keep}" + ("_out" if out else "")
        kw = dict(out=treeops.Tree.uninitialized(B, N)) if out else {}
        res[name] = run(name, PR._PRUNE_REPLAYS, treeops.prune,
                        lambda: ((tree, i32(2, 4) if keep == "t" else keep), kw))
    ckpt = treeops.PruneCheckpoints()
    for step in (0, 1, 3):
        res[f"check_{step}"] = run(
            f"check_{step}", PR._CHECKPOINT_REPLAYS, ckpt.check,
            lambda: ((step, torch.rand(B, generator=g), ckpt.start(B)), {}))

    # two tables (and templates) of one shape share a key: each replay launches its own
    tab2 = CudaLike(V, K)
    tab2.table.copy_(torch.randint(0, V, (V, K), generator=g, dtype=torch.int32))
    tpl2 = treeops.RankTemplate.from_paths([(0,), (1,), (1, 0), (1, 1), (1, 0, 0)])
    assert (tpl2.size, tpl2.max_rank, tpl2.max_depth, tpl2.max_width) == \
        (tpl.size, tpl.max_rank, tpl.max_depth, tpl.max_width)
    seq = iter([tab] + [tab2] * 8)
    res["graft_two_tables"] = run("graft_two_tables", GR._GRAFT_REPLAYS, graft,
                                  grf(4, 2, False, table=lambda: next(seq)))
    seq = iter([tab] + [tab2] * 8)
    res["tail_two_tables"] = run("tail_two_tables", GT._GRAFT_TAIL_REPLAYS, graft_tail,
                                 tail(1, 4, False, table=lambda: next(seq)))
    seq = iter([tpl] + [tpl2] * 8)
    res["graft_two_templates"] = run("graft_two_templates", GR._GRAFT_REPLAYS, graft,
                                     grf(3, 1, False, template=lambda: next(seq)))
    own = {}
    for name, reps, call_on in (
        ("update", GR._UPDATE_REPLAYS,
         lambda t: t.update(tree, topk_ids=torch.zeros(B, N, K, dtype=torch.int32))),
        ("update_logits", GR._UPDATE_REPLAYS,
         lambda t: t.update(tree, torch.zeros(B, N, V))),
        ("retrieve", GR._RETRIEVE_REPLAYS, lambda t: t.retrieve(tree.tokens[:, 0], tpl)),
        ("graft", GR._GRAFT_REPLAYS, lambda t: treeops.graft(tree, t, tpl, 6)),
        ("tail", GT._GRAFT_TAIL_REPLAYS, lambda t: treeops.graft_tail(tree, t, 2, 6)),
    ):
        call_on(tab)  # recorded (or replayed) on the first table
        calls.clear(); n0 = reps.replays
        call_on(tab2)
        seen = set().union(*map(ptrs, calls))
        mine = {tab2.table.data_ptr(), tab2._owner.data_ptr()}
        theirs = {tab.table.data_ptr(), tab._owner.data_ptr()}
        if name == "update_logits":
            # the int32 slots every update method launches (the block maxima, the default,
            # allocate no float32 ones: an empty tensor, whose null pointer names no buffer)
            mine |= {p[1].data_ptr() for p in tab2._workspace.values()}
            theirs |= {t.data_ptr() for p in tab._workspace.values() for t in p if t.numel()}
        if name in ("retrieve", "graft", "tail"):  # these read the table only
            mine, theirs = {tab2.table.data_ptr()}, {tab.table.data_ptr()}
        own[name] = dict(replayed=reps.replays - n0, mine=mine <= seen, theirs=bool(theirs & seen))
    res["own_pointers"] = own

    # not replayed: validate=True, a changed update tuning; out is returned itself, and its
    # aliasing of the tree is still refused on a replayable signature
    nv = {}
    topk0 = topk()
    for name, reps, fn in (
        ("update", GR._UPDATE_REPLAYS,
         lambda v: tab.update(tree, topk_ids=topk0, validate=v)),
        ("graft", GR._GRAFT_REPLAYS, lambda v: treeops.graft(tree, tab, tpl, 5, validate=v)),
        ("merge", GR._GRAFT_MERGE_REPLAYS,
         lambda v: treeops.graft_merge(tree, retrieved, 5, validate=v)),
        ("tail", GT._GRAFT_TAIL_REPLAYS, lambda v: treeops.graft_tail(tree, tab, 2, 5,
                                                                      validate=v)),
        ("prune", PR._PRUNE_REPLAYS, lambda v: treeops.prune(tree, 3, validate=v)),
    ):
        fn(False); fn(False)
        n0 = reps.replays
        fn(True)
        nv[name] = reps.replays - n0
    n0 = GR._UPDATE_REPLAYS.replays
    tab.update(tree, topk_ids=topk0)
    n1 = GR._UPDATE_REPLAYS.replays
    was = dict(KGU.UPDATE_TUNING)
    KGU.UPDATE_TUNING["merge"] = "passes"
    try:
        tab.update(tree, topk_ids=topk0)
    finally:
        KGU.UPDATE_TUNING.clear(); KGU.UPDATE_TUNING.update(was)
    n2 = GR._UPDATE_REPLAYS.replays
    o = treeops.Tree.uninitialized(B, N)
    treeops.graft(tree, tab, tpl, 6, out=o)
    n3 = GR._GRAFT_REPLAYS.replays
    same_out = treeops.graft(tree, tab, tpl, 6, out=o) is o
    n4 = GR._GRAFT_REPLAYS.replays
    try:
        treeops.graft(tree, tab, tpl, 6, out=treeops.Tree(*tree.tensors()))
        refused = False
    except ValueError as e:
        refused = "shares memory" in str(e)
    res["not_replayed"] = dict(validate=nv, before_tuning=n1 - n0, after_tuning=n2 - n1,
                               out_is_out=same_out and n4 - n3 == 1, alias_refused=refused)
print("RESULT" + json.dumps(res))
"""
)

# (fresh results, fresh bytes) per replay: the outputs an op makes, never its table's buffers
_FRESH = {
    "update_ids": (0, 0), "update_logits": (0, 0), "warm_ids": (0, 0),
    "warm_ids_lengths": (0, 0), "warm_logits": (0, 0), "warm_logits_lengths": (0, 0),
    "retrieve_None": (4, 0), "retrieve_2": (4, 0), "retrieve_t": (4, 0),
    "merge_8": (8, 0), "merge_5": (8, 0), "merge_t": (8, 0), "merge_6_out": (0, 0),
    "merge_t_out": (0, 0),
    "graft_8_None": (8, 0), "graft_5_3": (8, 0), "graft_t_t": (8, 0), "graft_6_None_out": (0, 0),
    "graft_t_2_out": (0, 0),
    "tail_3_8": (8, 0), "tail_t_6": (8, 0), "tail_2_t_out": (0, 0), "tail_t_t_max4": (8, 0),
    "prune_3": (8, 0), f"prune_{treeops.NO_PRUNE}": (8, 0), "prune_t": (8, 0),
    "prune_5_out": (0, 0), "check_0": (1, 0), "check_1": (1, 0), "check_3": (1, 0),
    "graft_two_tables": (8, 0), "tail_two_tables": (8, 0), "graft_two_templates": (8, 0),
}  # fmt: skip


def test_graft_replays_launch_what_the_ops_launch():
    """Against stub kernels (bench/bench_host.py's stand-in driver), with a CPU table that has
    a CUDA table's own buffers: the second call of each signature replays, launching argument
    for argument what the op's own path launches for the same tensors, and returns the given
    ``out`` where the op does and fresh results of the op's shapes where it makes them. The
    update from top-k ids and from logits (two launches each, the table's owner and cached
    workspace passed as inputs), the warm start with and without lengths, retrieval (a
    ``Retrieved`` back), ``graft_merge``, ``graft`` and ``graft_tail`` with int and tensor
    budgets and counts, with and without ``out``, ``prune`` with an int and a tensor ``keep``
    (and into ``out``),
    and checkpoints at and between the checkpoint steps."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _STAND_IN], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(proc.stdout.split("RESULT", 1)[1])
    for name in _FRESH:
        r = res[name]
        assert r["replayed"] == 1 and r["same"] and r["meta"] and r["launches"] >= 1, (name, r)
    fresh = {name: (res[name]["fresh_results"], res[name]["fresh_bytes"]) for name in _FRESH}
    assert fresh == _FRESH, fresh
    for name in ("update_ids", "update_logits"):
        assert res[name]["launches"] == 2 and res[name]["returned_none"], (name, res[name])
    assert res["merge_6_out"]["returned_inputs"] == [True] * 8
    assert res["graft_8_None"]["returned_inputs"] == [False] * 8
    assert res["retrieved"] == {"replayed": 1, "type": "Retrieved", "max_depth": 3}
    # a second table of the same shape: its own table, owner and workspace pointers launched,
    # none of the first's
    own = res["own_pointers"]
    for name, r in own.items():
        assert r == {"replayed": 1, "mine": True, "theirs": False}, (name, r)
    nr = res["not_replayed"]
    assert nr["validate"] == {"update": 0, "graft": 0, "merge": 0, "tail": 0, "prune": 0}, nr
    assert nr["before_tuning"] == 1 and nr["after_tuning"] == 0, nr
    assert nr["out_is_out"] and nr["alias_refused"], nr


@pytest.mark.gpu
def test_gpu_graft_replays_equal_the_ops(monkeypatch):
    """A few decoding steps of Graft's ops on CUDA (update from ids and from logits, retrieval,
    graft_merge, graft, graft_tail, prune, checkpoints), each call made twice from equal
    inputs: replayed, and with every replay table emptied first (the ops' own Python path).
    Every output and the table itself (its rows and its owner array) agree bitwise."""
    gr, gt = sys.modules["treeops.graft"], sys.modules["treeops.graft_tail"]
    pr = sys.modules["treeops.prune"]
    monkeypatch.setattr(sys.modules["treeops.kernels._replay"], "ENABLED", True)
    reps = (gr._UPDATE_REPLAYS, gr._WARM_START_REPLAYS, gr._RETRIEVE_REPLAYS,
            gr._GRAFT_MERGE_REPLAYS, gr._GRAFT_REPLAYS, pr._PRUNE_REPLAYS,
            pr._CHECKPOINT_REPLAYS, gt._GRAFT_TAIL_REPLAYS)  # fmt: skip
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(5)
    B, N, V, K = 3, 16, 4096, 8
    par = torch.tensor([[-1] + [(i - 1) // 3 for i in range(1, N)]] * B, dtype=torch.int32)
    scores = torch.linspace(1, 0.1, N).expand(B, N).contiguous()
    tree = treeops.Tree.from_parents(
        par, torch.tensor([N, 9, 1], dtype=torch.int32), torch.randint(0, V, (B, N), generator=g),
        scores,
    ).to(dev)  # fmt: skip
    tpl = treeops.RankTemplate.default()
    tables = [treeops.AdjacencyTable(V, K, device=dev) for _ in range(2)]  # replayed, reference
    ckpt = treeops.PruneCheckpoints()

    def i32(*v):
        return torch.tensor(v, dtype=torch.int32, device=dev)

    def step(table, x, reference):
        def do(fn):
            if reference:
                for r in reps:
                    r._runs.clear()
            return fn()

        lg, ids, best, budget = x
        outs = []
        do(lambda: table.warm_start(tree.tokens, lg))
        do(lambda: table.update(tree, topk_ids=ids))
        do(lambda: table.update(tree, lg))
        r = do(lambda: table.retrieve(tree.tokens[:, 0], tpl, 20))
        outs += [r.tokens, r.parents, r.depth, r.num_nodes]
        outs += do(lambda: treeops.graft_merge(tree, r, budget)).tensors()
        outs += do(lambda: treeops.graft(tree, table, tpl, 12, i32(5, 30, 0))).tensors()
        o = treeops.Tree.uninitialized(B, N, dev)
        outs += do(lambda: treeops.graft(tree, table, tpl, budget, out=o)).tensors()
        outs += do(lambda: treeops.graft_tail(tree, table, 4, budget)).tensors()
        outs += do(lambda: treeops.graft_tail(tree, table, i32(1, 3, 9), 14)).tensors()
        keep = ckpt.start(B, dev)
        for s in range(3):
            outs.append(do(lambda s=s: ckpt.check(s, best, keep)))
        outs.append(keep)
        outs += do(lambda: treeops.prune(tree, keep)).tensors()
        outs += do(lambda: treeops.prune(tree, 6)).tensors()
        o = treeops.Tree.uninitialized(B, N, dev)
        outs += do(lambda: treeops.prune(tree, keep, out=o)).tensors()
        return outs + [table.table, table._owner]

    counts = [r.replays for r in reps]
    for _ in range(4):
        lg = torch.randn(B, N, V, generator=g).to(dev)
        ids = torch.randint(-1, V, (B, N, K), generator=g, dtype=torch.int32).to(dev)
        best = torch.rand(B, generator=g).to(dev) * 0.5
        x = (lg, ids, best, i32(10, 16, 3))
        got = step(tables[0], x, reference=False)
        saved = [dict(r._runs) for r in reps]
        want = step(tables[1], x, reference=True)
        for r, runs in zip(reps, saved, strict=True):
            r._runs.clear()
            r._runs.update(runs)
        assert len(got) == len(want)
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert torch.equal(a, b), i
    after = [r.replays for r in reps]
    assert all(a > c for a, c in zip(after, counts, strict=True)), (counts, after)

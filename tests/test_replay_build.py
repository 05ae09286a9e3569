"""The tree build's replays (``treeops.kernels._replay``): a repeated plain ``build_tree_expand``
or ``build_tree_emit`` of a signature, draft layer and CAST thresholds launches, argument for
argument, what the op's Python path launches for the same tensors, with a fresh ``Tree`` where
the op makes one; the layer counter, publish and the checks stay the public function's."""

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
from treeops._draft_state import STATE_TENSORS

BT = sys.modules["treeops.build_tree"]
EX, EM = BT._EXPAND_REPLAYS, BT._EMIT_REPLAYS
with bench_host.launchers_on_cpu():
    g = torch.Generator().manual_seed(0)
    B, V = 2, 64
    table = treeops.CostTable.from_functions(
        lambda B, c, n: 100.0 + c * B / 512 + B * n, lambda B, c, n: 10.0 + B * n,
        batch_sizes=[1, 2, 4], L=64, M=4, n_max=32)
    policies = {
        "eagle": treeops.EagleStatic(depth=3, topk=4, budget=8),
        "cast": treeops.Cast(C1=0.1, C2=0.05, C3=0.1, R=4, cost_table=table, topk=4,
                             max_width=4, max_depth=3, capacity=16),
    }
    states = {name: treeops.DraftState.new(pol, torch.tensor([3, 5]), torch.tensor([100, 300]))
              for name, pol in policies.items()}

    def bufs(state):
        # the state's buffers as keyword inputs: the harness names pointers into them
        d = {f: getattr(state, f) for f in STATE_TENSORS}
        d.update({"ws_" + k: t for k, t in state.workspace.items()})
        return d

    def expand(logits, state, pol, layer, validate=False, **_):
        state.layer = layer
        return treeops.build_tree_expand(logits, state, pol, validate=validate)

    def emit(state, pol, layer, out=None, validate=False, **_):
        state.layer = layer
        return treeops.build_tree_emit(state, pol, out=out, validate=validate)

    def logits(pol):
        return torch.randn(B, pol.max_width, V, generator=g)

    res = {}
    for name, pol in policies.items():
        st = states[name]
        for layer in range(pol.max_depth):
            res[f"{name}_expand_{layer}"] = run(
                "expand", EX, expand, lambda: ((logits(pol), st, pol, layer), bufs(st)))
            res[f"{name}_expand_{layer}"]["layer_after"] = st.layer
        for layer in (1, pol.max_depth):
            res[f"{name}_emit_{layer}"] = run(
                "emit", EM, emit, lambda: ((st, pol, layer), bufs(st)))
            out = treeops.Tree.uninitialized(B, pol.capacity)
            res[f"{name}_emit_out_{layer}"] = run(
                "emit", EM, emit, lambda: ((st, pol, layer), dict(bufs(st), out=out)))
            n0 = EM.replays
            res[f"{name}_emit_out_{layer}"]["out_back"] = (
                emit(st, pol, layer, out=out) is out and EM.replays == n0 + 1)

    # another layer than the one recorded: recorded anew, not replayed
    pol, st = policies["eagle"], states["eagle"]
    EX._runs.clear(); EM._runs.clear()
    expand(logits(pol), st, pol, 0)
    emit(st, pol, 1)
    n0, m0 = EX.replays, EM.replays
    expand(logits(pol), st, pol, 1)
    emit(st, pol, 2)
    res["other_layer"] = dict(expand=EX.replays - n0, emit=EM.replays - m0)

    # validate=True: never recorded, never replayed (the same call without it then replays)
    for name, pol in policies.items():
        st = states[name]
        EX._runs.clear(); EM._runs.clear()
        n0, m0 = EX.replays, EM.replays
        empty = treeops.Tree.empty(B, pol.capacity)  # valid as it stays: the stubs write nothing
        for _ in range(3):
            expand(logits(pol), st, pol, 0, validate=True)
            emit(st, pol, 1, out=empty, validate=True)
        recorded = len(EX._runs) + len(EM._runs)
        expand(logits(pol), st, pol, 0)
        expand(logits(pol), st, pol, 0)
        res[f"{name}_validate"] = dict(replays=EX.replays - n0 + EM.replays - m0,
                                       recorded=recorded, plain_replays=EX.replays - n0)

    # CAST: thresholds changed in place (a frozen policy forced) record anew, and the cost rows'
    # pointers are read per call
    pol, st = policies["cast"], states["cast"]
    EX._runs.clear(); EM._runs.clear()
    ptrs = lambda: {x.data_ptr() if isinstance(x, torch.Tensor) else x
                    for c in calls for x in c}
    expand(logits(pol), st, pol, 0)
    emit(st, pol, 1)
    n0, m0 = EX.replays, EM.replays
    object.__setattr__(pol, "C1", 0.3)
    object.__setattr__(pol, "C3", 0.4)
    calls.clear()
    expand(logits(pol), st, pol, 0)
    emit(st, pol, 1)
    seen = ptrs()
    res["cast_thresholds"] = dict(replays=EX.replays - n0 + EM.replays - m0,
                                  launched=[0.3 in seen, 0.4 in seen])
    old = table.device_tables(B, "cpu")  # kept alive: the new rows get other addresses
    table._dev_cache.clear()
    new = table.device_tables(B, "cpu")
    n0, m0 = EX.replays, EM.replays
    calls.clear()
    expand(logits(pol), st, pol, 0)
    emit(st, pol, 1)
    seen = ptrs()
    res["cast_rows"] = dict(replays=EX.replays - n0 + EM.replays - m0,
                            new=[t.data_ptr() in seen for t in new],
                            old=[t.data_ptr() in seen for t in old])
print("RESULT" + json.dumps(res))
"""
)


def _stand_in() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", _STAND_IN], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.split("RESULT", 1)[1])


@pytest.fixture(scope="module")
def stand_in() -> dict:
    return _stand_in()


def test_replay_launches_what_the_op_launches(stand_in):
    """Against stub kernels (bench/bench_host.py's stand-in driver), EAGLE and CAST: the second
    call of each (signature, layer) replays, launching argument for argument what the op's own
    path launches for the same tensors (pointers as the state buffer or result they point into,
    with the offset); the expand still advances ``state.layer``, allocates nothing and returns
    None; the emit without ``out`` returns a fresh ``Tree`` (its eight fields made per call, no
    other buffer), with ``out`` it writes into and returns the given tree."""
    res = stand_in
    cases = [k for k in res if "_expand_" in k or "_emit_" in k]
    assert len(cases) == 2 * (3 + 4), cases
    for name in cases:
        r = res[name]
        # EAGLE's emit ranks in its one launch; CAST's selects first (its count reads all requests)
        emit_launches = 1 if name.startswith("eagle") else 2
        assert r["replayed"] == 1 and r["same"] and r["meta"], (name, r)
        if "_expand_" in name:
            assert r["launches"] == 1 and r["returned_none"], (name, r)
            assert (r["fresh_results"], r["fresh_bytes"]) == (0, 0), (name, r)
            assert r["layer_after"] == int(name.rsplit("_", 1)[1]) + 1, (name, r)
        elif "_emit_out_" in name:
            assert r["launches"] == emit_launches and r["returned_inputs"] == [True] * 8, (name, r)
            assert r["out_back"], (name, r)  # the given Tree object itself, replayed or not
            assert (r["fresh_results"], r["fresh_bytes"]) == (0, 0), (name, r)
        else:
            assert r["launches"] == emit_launches and r["returned_inputs"] == [False] * 8, (name, r)
            assert (r["fresh_results"], r["fresh_bytes"]) == (8, 0), (name, r)


def test_another_layer_is_not_replayed(stand_in):
    """A recording of layer i is not replayed at layer j (the layer is launched, so it is in the
    key): the calls above at each layer launch what the op launches there, and a first call at a
    new layer runs the op."""
    assert stand_in["other_layer"] == {"expand": 0, "emit": 0}


def test_validate_never_replays(stand_in):
    """``validate=True`` calls are neither recorded nor replayed (their key is None); the same
    call without it records and then replays."""
    for name in ("eagle", "cast"):
        r = stand_in[f"{name}_validate"]
        assert r == {"replays": 1, "recorded": 0, "plain_replays": 1}, (name, r)


def test_cast_replays_no_stale_value(stand_in):
    """CAST: thresholds changed in place (a frozen policy forced) are launched at once, not
    replayed from the old recording; new device cost rows (the table's cache emptied) are
    launched by the replay in place of the recorded ones."""
    assert stand_in["cast_thresholds"] == {"replays": 0, "launched": [True, True]}
    assert stand_in["cast_rows"] == {"replays": 2, "new": [True, True], "old": [False, False]}


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["eagle", "cast"])
def test_gpu_build_tree_steps_replay_and_equal_the_ops(kind, monkeypatch):
    """Decoding steps of expands and an emit (with and without ``out``) with replays on write
    bitwise what the same steps write through the ops' Python path (the replay tables emptied
    before each of those calls): every state tensor and workspace buffer after each call, the
    host decisions, and the emitted trees; from the second step on the calls replay, and each
    emitted tree without ``out`` is a fresh one."""
    bt = sys.modules["treeops.build_tree"]
    monkeypatch.setattr(sys.modules["treeops.kernels._replay"], "ENABLED", True)
    from treeops._draft_state import STATE_TENSORS

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(7)
    B, V = 3, 32000
    if kind == "eagle":
        pol = treeops.EagleStatic(depth=4, topk=4, budget=16)
    else:
        table = treeops.CostTable.from_functions(
            lambda B, c, n: 4000.0 + c * B / 512 + max(0, B * n - 96) * 20,
            lambda B, c, n: 800.0 + c * B / 16384 + max(0, B * n - 96) * 0.6,
            batch_sizes=[1, 2, 4, 8], L=1024, M=4, n_max=64,
        )  # fmt: skip
        pol = treeops.Cast(C1=0.05, C2=0.02, C3=0.05, R=4, cost_table=table, topk=4,
                           max_width=4, max_depth=4, capacity=16)  # fmt: skip
    root = torch.tensor([11, 12, 13], device=dev)
    sl = torch.tensor([100, 2000, 5000], device=dev)
    got_st = treeops.DraftState.new(pol, root, sl)
    want_st = treeops.DraftState.new(pol, root, sl)
    reps = (bt._EXPAND_REPLAYS, bt._EMIT_REPLAYS)

    def own(fn, *args, **kwargs):
        saved = [dict(r._runs) for r in reps]
        for r in reps:
            r._runs.clear()
        try:
            return fn(*args, **kwargs)
        finally:
            for r, runs in zip(reps, saved, strict=True):
                r._runs.clear()
                r._runs.update(runs)

    def same_state(where):
        for f in STATE_TENSORS:
            assert torch.equal(getattr(got_st, f), getattr(want_st, f)), (where, f)
        assert got_st.workspace.keys() == want_st.workspace.keys(), where
        for k, t in got_st.workspace.items():
            assert torch.equal(t, want_st.workspace[k]), (where, k)
        assert got_st.layer == want_st.layer, where

    before = [r.replays for r in reps]
    outs = [treeops.Tree.uninitialized(B, pol.capacity, dev) for _ in range(2)]
    prev = None
    # the calls whose key was recorded before: the state's workspace gains the split buffers in
    # its first expand (its signature then changes), the layer and ``out`` are keyed
    seen: set = set()
    expected = [0, 0]

    def count(i, key):
        expected[i] += key in seen
        seen.add(key)

    for step in range(4):
        active = torch.tensor([True, step != 1, True], device=dev)
        seq = sl + 37 * step
        got_st.reset(root + step, seq, active)
        want_st.reset(root + step, seq, active)
        while got_st.wants_next_layer():
            assert want_st.wants_next_layer(), step
            logits = (torch.randn(B, pol.max_width, V, generator=g) * 3).to(dev)
            count(0, ("expand", "part_m" in got_st.workspace, got_st.layer))
            treeops.build_tree_expand(logits, got_st, pol)
            own(treeops.build_tree_expand, logits.clone(), want_st, pol)
            same_state((step, got_st.layer))
        assert not want_st.wants_next_layer(), step
        out = None if step % 2 == 0 else outs
        count(1, ("emit", out is None, got_st.layer))
        got = treeops.build_tree_emit(got_st, pol, out=None if out is None else out[0])
        want = own(treeops.build_tree_emit, want_st, pol, out=None if out is None else out[1])
        same_state((step, "emit"))
        assert got_st.verify_count() == want_st.verify_count(), step
        for f in treeops.Tree.FIELDS:
            assert torch.equal(getattr(got, f), getattr(want, f)), (step, f)
        if out is None:
            assert prev is None or got.tokens is not prev.tokens, step
            prev = got
        else:
            assert got is out[0], step
    after = [r.replays for r in reps]
    assert expected[0] >= 4 and expected[1] == 2, expected
    assert [a - b for a, b in zip(after, before, strict=True)] == expected, (before, after)

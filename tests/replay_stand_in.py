"""The stand-in harness of the replay tests (``tests/test_replay*.py``): Python source that a
test runs in a subprocess with its own cases appended (the stand-in driver of
``bench/bench_host.py`` replaces Triton's, so it must not share the test process).

``run(name, replays, op, make)`` calls ``op(*args, **kwargs)`` (``make()`` gives fresh ones per
call) three times: the first records, the second must replay, the third runs the op's own path
(the op's replay table emptied for it); the two calls' launches are compared argument for
argument, pointers as the input or result they point into with the offset (the op's own
buffers by their offsets to each other). A ``Tree`` among the inputs or as the result counts as
its eight tensors. It returns a dict: ``replayed`` (replays in the second call), ``same`` (the
launches equal), ``launches``, ``meta`` (the results' shapes, strides and dtypes equal),
``fresh_bytes`` / ``fresh_results`` (what the replay allocates per call), ``returned_inputs``,
``returned_none``. The script ends by printing ``"RESULT" + json.dumps(res)``.
"""

PRELUDE = r"""
import json, sys, torch
sys.path.insert(0, "bench")
import bench_host
import treeops
TA, KA = sys.modules["treeops.tree_attention"], sys.modules["treeops.kv_append"]

import treeops.kernels._replay
treeops.kernels._replay.ENABLED = True
calls = []
bench_host._StubKernel.run = lambda self, *a: calls.append(a)
BIG = 1 << 24  # CPU heap addresses are above it (on the H200 machine from ~0x20000000); the
# strides, sizes and flags of these tiny cases below


NAMED = []  # (label, buffers): sets a case names pointers into (the launchers' scratch sets)


def norm(args, inputs, results):
    # a launch's arguments: pointers as (input k | result r | a NAMED set's buffer i | the op's
    # own, byte offset)
    out = []
    own = []
    within = lambda p, t: 0 <= p - t.data_ptr() < max(t.untyped_storage().nbytes(), 1)
    for x in args:
        p = x.data_ptr() if isinstance(x, torch.Tensor) else x
        if type(p) is int and p > BIG:
            for name, ts in (("in", inputs), ("res", results)):
                hit = [(k, p - t.data_ptr()) for k, t in enumerate(ts)
                       if t is not None and within(p, t)]
                if hit:
                    out.append((name, *hit[0]))
                    break
            else:
                hit = [(label, i, p - b.data_ptr()) for label, bufs in NAMED
                       for i, b in enumerate(bufs) if within(p, b)]
                if hit:
                    out.append(("named", *hit[0]))
                else:
                    own.append(p)
                    out.append(("own", p - own[0]))
        else:
            out.append(repr(p))
    return out


def run(name, replays, op, make):
    # first call records; each later call of the signature replays. Compared against the same
    # call with the replay table emptied (the op's own launches, recording again)
    res = {}
    make_args = make()
    before = set(replays._runs)
    op(*make_args[0], **make_args[1])  # records
    src = "\n".join(replays._runs[k][0].source for k in set(replays._runs) - before
                    if replays._runs[k])
    a, kw = make()
    calls.clear(); n0 = replays.replays
    got_r = op(*a, **kw); got = [list(c) for c in calls]
    replayed = replays.replays - n0
    runs = dict(replays._runs)
    replays._runs.clear()
    calls.clear(); want_r = op(*a, **kw); want = [list(c) for c in calls]
    replays._runs.clear(); replays._runs.update(runs)
    rs = lambda r: ([] if r is None else [r] if isinstance(r, torch.Tensor)
                    else [t for t in (r.tensors() if isinstance(r, treeops.Tree) else r)
                          if t is not None])
    ins = [x for x in list(a) + list(kw.values()) if isinstance(x, torch.Tensor)]
    for x in list(a) + list(kw.values()):
        if isinstance(x, treeops.Tree):
            ins += list(x.tensors())
    g = [norm(c, ins, rs(got_r)) for c in got]
    w = [norm(c, ins, rs(want_r)) for c in want]
    meta = lambda r: [(tuple(t.shape), t.stride(), str(t.dtype)) for t in rs(r)]
    fresh = all(not any(t is x for x in ins) for t in rs(got_r) if not any(t is x for x in ins))
    res = dict(replayed=replayed, same=g == w, launches=len(got), meta=meta(got_r) == meta(want_r),
               fresh_bytes=src.count("_empty("), fresh_results=src.count("_empty_strided("),
               returned_inputs=[any(t is x for x in ins) for t in rs(got_r)],
               returned_none=got_r is None)
    return res


"""

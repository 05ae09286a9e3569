"""The eager host path's memo of passed checks (``treeops._checks.signature`` / ``Memo``): a call
whose argument signature passed before skips the checks, and nothing else does — an argument that
differs in any checked property (type, shape, strides, dtype, device, a plain value and its
type) is checked in full and refused with the same message as on a first call."""

from __future__ import annotations

import pytest
import torch

import treeops
from treeops._checks import Memo, signature


def _tree(B=2, N=4):
    par = torch.tensor([[-1, 0, 0, 1]] * B, dtype=torch.int32)
    tok = torch.arange(B * N).view(B, N) + 1
    return treeops.Tree.from_parents(par, torch.full((B,), N, dtype=torch.int32), tok)


def test_signature_separates_what_checks_read():
    x = torch.zeros(2, 3)
    base = signature((x,), (1,))
    assert base == signature((torch.ones(2, 3),), (1,))  # values are not metadata
    for other in (
        signature((x.t().contiguous().t(),), (1,)),  # strides
        signature((x.double(),), (1,)),  # dtype
        signature((x.to("meta"),), (1,)),  # device
        signature((torch.nn.Parameter(x),), (1,)),  # type
        signature((x[None],), (1,)),  # shape
        signature((x,), (True,)),  # True == 1, but a bool is not an int
        signature((None,), (1,)),
    ):
        assert other != base
    assert signature(([1, 2],)) is None  # not a tensor: no memo, the full checks run


def test_signature_found_again_is_the_same_object():
    """A signature seen before comes back as the same object, through torch's C++ tensor checks
    where torch has them (``_checks._GUARDS``), and a tensor passed twice or a None moved to
    another position is told apart as the Python tuple tells it."""
    from treeops import _checks

    x, y = torch.zeros(2, 3), torch.zeros(4, dtype=torch.int32)
    first = signature((x, None, y, None), (None, False))
    assert signature((x.clone(), None, y.clone(), None), (None, False)) is first
    assert signature((x, y, None, None), (None, False)) is not first
    assert signature((x, None, y, None), (None, True)) is not first
    twice = signature((x, x, y, None), (None, False))
    assert twice is not first and signature((x, x, y, None), (None, False)) is twice
    if _checks._GUARDS is not None:  # found by the guards, not rebuilt
        seen = _checks._SEEN[(4, ((type(None), None), (bool, False)))]
        assert any(sig is first for _, sig in seen)


def test_signature_caches_are_bounded(monkeypatch):
    """A value argument that differs on every call (a float threshold, say) keeps neither the
    tuples nor the guards growing."""
    from treeops import _checks

    monkeypatch.setattr(_checks, "MAX_SIGNATURES", 8)
    x = torch.zeros(3)
    for i in range(40):
        assert signature((x,), (float(i),)) is not None
    assert len(_checks._SIGNATURES) <= 8 and len(_checks._SEEN) <= 8


def test_memo_is_bounded_and_tolerates_unhashable_keys():
    m = Memo(maxsize=3)
    for i in range(5):
        m.put((i,), i)
    assert len(m) == 3 and m.get((0,)) is None and m.get((4,)) == 4
    assert m.get(([],)) is None  # an unhashable value argument: a miss, no error
    m.put(([],), 1)
    assert m.get(None) is None


def test_errors_after_a_passing_call_are_the_first_calls_errors():
    tree = _tree()
    q = torch.randn(2, 4, 2, 64)
    kc, vc = torch.randn(2, 16, 1, 64), torch.randn(2, 16, 1, 64)
    bt = torch.tensor([[0], [1]], dtype=torch.int32)
    sl = torch.tensor([3, 5], dtype=torch.int32)
    ok = treeops.tree_attention(q, kc, vc, bt, sl, tree)  # memoised from here on
    assert torch.equal(treeops.tree_attention(q, kc, vc, bt, sl, tree), ok)
    with pytest.raises(ValueError, match="Invalid dtype of q"):
        treeops.tree_attention(q.double(), kc, vc, bt, sl, tree)
    with pytest.raises(ValueError, match="Invalid stride of seq_lens"):
        treeops.tree_attention(q, kc, vc, bt, sl[:1].expand(2), tree)
    with pytest.raises(ValueError, match="Invalid value of sm_scale"):
        treeops.tree_attention(q, kc, vc, bt, sl, tree, sm_scale=-1.0)
    bad = _tree()
    bad.anc = bad.anc.transpose(0, 1).contiguous().transpose(0, 1)  # same shape, strided
    with pytest.raises(ValueError, match="Invalid stride of tree.anc"):
        treeops.tree_attention(q, kc, vc, bt, sl, bad)
    # validate=True checks values on every call, memo or not
    with pytest.raises(ValueError, match="seq_lens"):
        treeops.tree_attention(q, kc, vc, bt, torch.tensor([3, 40], dtype=torch.int32), tree,
                               validate=True)  # fmt: skip


def test_in_place_metadata_change_is_seen():
    tree = _tree()
    logits = torch.randn(2, 4, 8)
    treeops.accept_greedy(tree, logits)
    logits.resize_(2, 4, 8, 1)  # the same tensor object, another shape
    with pytest.raises(ValueError, match="Invalid shape of target_logits"):
        treeops.accept_greedy(tree, logits)


def test_graft_out_aliasing_is_checked_on_every_call():
    tree = _tree()
    table = treeops.AdjacencyTable(16, 4)
    template = treeops.RankTemplate.chain(2)
    out = treeops.Tree.uninitialized(2, 4)
    treeops.graft(tree, table, template, 4, out=out)  # memoised from here on
    with pytest.raises(ValueError, match="shares memory with tree"):
        treeops.graft(tree, table, template, 4, out=tree)


def test_kv_append_and_rope_checks_are_memoised_and_errors_unchanged():
    import importlib

    kv = importlib.import_module("treeops.kv_append")

    B, N, H, D = 2, 3, 2, 64
    k, v = torch.randn(B, N, H, D), torch.randn(B, N, H, D)
    kc, vc = torch.zeros(4, 16, H, D), torch.zeros(4, 16, H, D)
    bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    sl, nt = torch.tensor([3, 5], dtype=torch.int32), torch.tensor([3, 2], dtype=torch.int32)
    kv._PASSED.clear()
    treeops.kv_append(k, v, kc, vc, bt, sl, nt)
    assert len(kv._PASSED) == 1
    treeops.kv_append(k, v, kc, vc, bt, sl, nt)  # memo hit
    assert len(kv._PASSED) == 1
    with pytest.raises(ValueError, match="Invalid dtype of v"):
        treeops.kv_append(k, v.double(), kc, vc, bt, sl, nt)
    with pytest.raises(ValueError, match="Invalid value of rope_theta"):
        treeops.kv_append(k, v, kc, vc, bt, sl, nt, rope_theta=-1.0)
    with pytest.raises(ValueError, match="Invalid stride of num_tokens"):
        treeops.kv_append(k, v, kc, vc, bt, sl, nt[:1].expand(2))
    with pytest.raises(ValueError, match="seq_lens"):  # validate=True: values, every call
        treeops.kv_append(k, v, kc, vc, bt, torch.tensor([3, 40], dtype=torch.int32), nt,
                          validate=True)  # fmt: skip
    x, pos = torch.randn(2, 3, 4, 64), torch.zeros(2, 3, dtype=torch.int64)
    y = treeops.rope(x, pos)
    assert torch.equal(treeops.rope(x, pos), y) and len(kv._PASSED) == 2
    with pytest.raises(ValueError, match="Invalid shape of positions"):
        treeops.rope(x, pos[:, :2])
    with pytest.raises(ValueError, match="Invalid head dim of x"):
        treeops.rope(torch.randn(2, 3, 4, 63), pos)
    # other ranks than the kernel's 4-D layout
    assert torch.equal(treeops.rope(x[0], pos[0]), y[0])


# ---------------------------------------------------------------- the ops' direct (eager) path
from treeops import _library  # noqa: E402
from treeops._library import direct_ok  # noqa: E402
from treeops.testing import NoHostSync  # noqa: E402


def test_every_op_has_a_first_tensor_argument():
    assert _library.OPS
    for name, op in _library.OPS.items():
        assert op.first >= 0, name
        assert op.overload is getattr(torch.ops.treeops, name).default
        assert op.cuda is _library.CUDA_BACKENDS[name]


def test_direct_path_guard(monkeypatch):
    x = torch.zeros(2, 3)
    args = (x, x, 1.0, None, 3, True)
    assert not direct_ok(args, 0, 0)  # CPU tensors: the dispatcher (the CPU reference)
    monkeypatch.setattr(_library, "DIRECT", 2)  # as if they were on CUDA
    assert direct_ok(args, 0, 0)
    with NoHostSync():  # a TorchDispatchMode
        assert not direct_ok(args, 0, 0)

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Mode():
        assert not direct_ok(args, 0, 0)
    with torch.device("cpu"):  # a TorchFunctionMode too
        assert not direct_ok(args, 0, 0)
    assert not direct_ok((torch.nn.Parameter(x), x), 0, 0)  # a subclass, anywhere
    assert not direct_ok((x, torch.nn.Parameter(x)), 0, 0)
    assert not direct_ok((x, [x]), 0, 0)  # not a plain argument
    with torch.profiler.profile():
        assert not direct_ok(args, 0, 0)
    assert not direct_ok((x.to("meta"), x), 0, 0) or _library.DIRECT == 2
    g = torch.zeros(2, requires_grad=True)
    assert direct_ok((x, g), 0, 0)  # returns nothing: autograd is not involved
    assert not direct_ok((x, g), 0, 1)  # returns a tensor: the autograd fallback marks it
    with torch.no_grad():
        assert direct_ok((x, g), 0, 1)
    assert torch.vmap(lambda t: t + direct_ok((t,), 0, 0))(x).eq(0).all()  # functorch
    seen = []

    @torch.compile(backend="eager", fullgraph=True)
    def compiled(t):
        seen.append(direct_ok((t,), 0, 0))
        return t + 1

    compiled(x)
    assert seen == [False]
    monkeypatch.setattr(_library, "DIRECT", 0)
    assert not direct_ok(args, 0, 0)


def test_direct_path_calls_the_cuda_backend_with_the_same_arguments(monkeypatch):
    calls = []

    def backend(x, positions, theta):
        calls.append((x, positions, theta))
        return x + 1

    op = _library._make_op(torch.ops.treeops.rope.default, backend)
    x, pos = torch.randn(2, 3, 4, 64), torch.zeros(2, 3, dtype=torch.int64)
    ref = torch.ops.treeops.rope.default(x, pos, 10000.0)
    assert torch.equal(op(x, pos, 10000.0), ref) and not calls  # CPU: the dispatcher
    monkeypatch.setattr(_library, "DIRECT", 2)
    out = op(x, pos, 10000.0)
    assert len(calls) == 1 and calls[0][0] is x and calls[0][1] is pos
    assert torch.equal(out, x + 1)
    with NoHostSync():
        out = op(x, pos, 10000.0)
    assert torch.equal(out, ref) and len(calls) == 1
    xg = x.clone().requires_grad_()
    out = op(xg, pos, 10000.0)  # grad mode and an input requiring grad: the dispatcher
    assert len(calls) == 1 and out.requires_grad
    # ops returning several tensors give a tuple, as the OpOverload does
    op4 = _library._make_op(
        torch.ops.treeops.adjacency_retrieve.default, lambda *a: [a[1], a[1], a[1], a[1]]
    )
    r = op4(torch.zeros(4, 2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64),
            torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
            torch.zeros(1, dtype=torch.int32), 1, None, 1)  # fmt: skip
    assert r.__class__ is tuple and len(r) == 4


@pytest.mark.skipif(
    not treeops._runtime.interpreted(), reason="CPU tensors through the CUDA backend: interpreter"
)
def test_direct_path_matches_the_dispatched_op(monkeypatch):
    """The public ops on CPU tensors with the direct path forced (DIRECT = 2): the CUDA backend
    (the Triton launcher, interpreted here) runs without the dispatcher, and computes what the
    dispatched op does."""
    x, pos = torch.randn(2, 3, 4, 64), torch.arange(6).view(2, 3)
    ref = treeops.rope(x, pos)
    tree = _tree()
    logits = torch.randn(2, 4, 16)
    acc_ref = treeops.accept_greedy(tree, logits)
    monkeypatch.setattr(_library, "DIRECT", 2)
    torch.testing.assert_close(treeops.rope(x, pos), ref)
    acc = treeops.accept_greedy(tree, logits)
    assert torch.equal(acc.accepted, acc_ref.accepted)
    assert torch.equal(acc.accept_len, acc_ref.accept_len)


# ------------------------------------------------------------------- direct Triton launches
import triton.language as tl  # noqa: E402
from triton.runtime import driver as _triton_driver  # noqa: E402
from triton.runtime.jit import JITFunction, compute_cache_key  # noqa: E402

from treeops.kernels import _launch  # noqa: E402


def _probe(X, Y, N, s_x, s_y, scale, flag, BLOCK: tl.constexpr, HAS_Y: tl.constexpr):
    o = tl.arange(0, BLOCK)
    x = tl.load(X + o * s_x, mask=o < N)
    if HAS_Y:
        tl.store(Y + o * s_y, (x * scale).to(Y.dtype.element_ty), mask=o < N)


class _Stub:
    """A compiled kernel that launches nothing, one per Triton key."""

    function = None
    packed_metadata = None

    def __init__(self):
        self.launches = 0
        self.last: tuple = ()

    def launch_metadata(self, *args):
        return None

    def run(self, *args):
        self.launches += 1
        self.last = args


@pytest.fixture
def stand_in_triton(monkeypatch):
    """Triton against compile_check.py's stand-in driver (sm_90), every compile a ``_Stub``
    stored in Triton's own cache under Triton's own key; a JITFunction even under the
    interpreter (the tests' mode), made directly."""
    import importlib
    import os
    import sys

    bench = os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench")
    monkeypatch.syspath_prepend(bench)
    interp = os.environ.pop("TRITON_INTERPRET", None)  # compile_check refuses to import under it
    try:
        compile_check = importlib.import_module("compile_check")
    finally:
        if interp is not None:
            os.environ["TRITON_INTERPRET"] = interp
    active = _triton_driver._active
    _triton_driver.set_active(compile_check._Driver())

    def stub_compile(self, key, signature, device, constexprs, options, attrs, warmup):
        kernel = self.device_caches[device][0][key] = _Stub()
        kernel.options = options  # what the launch would have compiled with
        return kernel

    monkeypatch.setattr(JITFunction, "_do_compile", stub_compile)
    monkeypatch.setattr(_launch, "ENABLED", True)  # (opt-in outside these tests)
    try:
        yield JITFunction(_probe, do_not_specialize=["N"])
    finally:
        _triton_driver._active = active
        sys.modules.pop("compile_check", None)


def _tritons_own(fn, args, kwargs):
    """The kernel ``JITFunction.run`` picks for these arguments: its binder's specialisation,
    its cache key, its cache (device 0 of the stand-in driver)."""
    kernel_cache, key_cache, _, _, binder = fn.device_caches[0]
    kw = dict(kwargs, debug=fn.debug or False, instrumentation_mode="")  # what run() adds
    _, spec, options = binder(*args, **kw)
    return kernel_cache.get(compute_cache_key(key_cache, spec, options)), spec


def test_direct_launch_picks_tritons_kernel(stand_in_triton):
    fn = stand_in_triton
    lau = _launch.Launcher(fn)
    x = torch.zeros(64)
    y = torch.zeros(64, dtype=torch.bfloat16)
    combos = []
    for ptr in (x, x[1:], x[4:], y, y[8:], y[1:]):  # fp32/bf16, 16-byte aligned or not
        for n in (1, 16, 17, 2**31, -5):  # do_not_specialize: only int32 or int64 matters
            for s in (1, 16, 17, 0, 2**40):  # specialised: == 1, % 16, int64
                for flag in (True, 1, 1.0):  # bool, int (1: a constexpr to Triton), float
                    for block in (16, 32):
                        combos.append(((ptr, y, n, s, 16, 0.5, flag),
                                       dict(BLOCK=block, HAS_Y=True, num_warps=4)))  # fmt: skip
    specs = set()
    for rnd in range(2):
        misses = lau.misses
        for args, kwargs in combos:
            got = lau.launch((1,), *args, **kwargs)
            want, spec = _tritons_own(fn, args, kwargs)
            assert got is want, (rnd, spec)
            specs.add(str(spec))
        if rnd:
            # second round: every call whose argument kinds are the first call's (flag a bool)
            # hit the direct cache; the others (flag an int or a float) went through Triton
            assert lau.misses - misses == len(combos) * 2 // 3
    assert len(specs) > 50 and 0 < len(lau.cache) < len(combos)
    assert lau.kinds == ("T", "T", "n", "i", "i", "f", "b", "c", "c")
    stub = next(iter(lau.cache.values()))[3]
    assert stub.launches >= 2  # launched directly, not only compiled


def _probe_gluon_like(X, N, BLOCK: tl.constexpr, num_warps: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(X + o, o, mask=o < N)


def test_direct_launch_of_a_kernel_whose_parameter_is_a_launch_option(stand_in_triton):
    """A Gluon kernel takes ``num_warps`` as a parameter, which ``JITFunction.run`` also reads as
    the launch option: the direct launch passes it as the parameter, keys on it, and launches the
    kernel Triton's own run picks for the same arguments (compiled with that many warps)."""
    gluon_runtime = pytest.importorskip("triton.experimental.gluon._runtime")
    fn = gluon_runtime.GluonJITFunction(_probe_gluon_like)
    lau = _launch.Launcher(fn)
    assert "num_warps" not in lau.options
    x = torch.zeros(64, dtype=torch.int32)
    for rnd in range(2):
        for warps in (4, 8):
            for block in (16, 32):
                kw = dict(BLOCK=block, num_warps=warps)
                got = lau.launch((1,), x, 10, **kw)
                want, spec = _tritons_own(fn, (x, 10), kw)
                assert got is want, (rnd, warps, block)
                assert got.options.num_warps == warps
        if rnd == 0:
            assert lau.misses == 4 and len(lau.cache) == 4
    assert lau.misses == 4  # the second round: every launch direct


def test_direct_launch_falls_back_to_triton(stand_in_triton, monkeypatch):
    fn = stand_in_triton
    lau = _launch.Launcher(fn)
    x = torch.zeros(64)
    args, kw = (x, x, 8, 1, 1, 0.5, True), dict(BLOCK=16, HAS_Y=False)
    lau.launch((1,), *args, **kw)
    lau.launch((1,), *args, **kw)
    assert lau.misses == 1  # the first launch: Triton's run, then the direct cache
    lau.launch(lambda meta: (1,), *args, **kw)  # a callable grid
    lau.launch((1,), *args, **kw, num_ctas=1)  # an option the direct launch does not handle
    lau.launch((1,), None, *args[1:], **kw)  # an argument of another kind (no key)
    assert lau.misses == 4
    seen = []
    run = JITFunction.run

    def patched(self, *a, grid, warmup, **k):  # compile_check.py's compile-only run, say
        seen.append(grid)
        return run(self, *a, grid=grid, warmup=warmup, **k)

    monkeypatch.setattr(JITFunction, "run", patched)
    lau.launch((3,), *args, **kw)
    assert seen == [(3,)] and lau.misses == 5
    monkeypatch.setattr(JITFunction, "run", run)
    from triton import knobs

    lau.launch((1,), *args, **kw)
    stub = next(iter(lau.cache.values()))[3]
    # a direct launch passes no hooks (Triton's chains are empty)
    assert lau.misses == 5 and stub.last[7] is None
    hook = knobs.runtime.launch_enter_hook
    hook.add(print)  # a profiler's hook
    try:
        lau.launch((1,), *args, **kw)
    finally:
        hook.remove(print)
    assert lau.misses == 6 and stub.last[7] is hook  # Triton's run passed it to the launcher
    lau.launch((1,), *args, **kw)
    assert lau.misses == 6 and stub.last[7] is None
    if treeops._runtime.interpreted():  # the interpreter's kernels: through Triton, always
        from treeops.kernels import kv_append as kk

        assert _launch.direct(kk._rope).launch == _launch.direct(kk._rope)._triton


@pytest.mark.skipif(
    not treeops._runtime.interpreted(), reason="CPU tensors through the CUDA backend: interpreter"
)
def test_every_public_op_takes_the_direct_path(monkeypatch):
    """Each public function's call of its op passes what the direct path needs (every argument,
    exact int/float scalars): with the path open to CPU tensors (DIRECT = 2), the op's CUDA
    backend runs (here through the interpreter) instead of the dispatcher's CPU reference."""
    import os
    import sys

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))
    from bench_host import OPS, cases

    calls = cases(torch.device("cpu"))
    backends: dict = {}  # code object -> op names (accept's two ops share one backend)
    for name, op in _library.OPS.items():
        backends.setdefault(op.cuda.__code__, set()).add(name)
    op_of = {
        "adjacency_update_logits": "adjacency_update",
        "tree_attention_prepared": "tree_attention",  # a CPU call: the op's own (not replayed)
        "kv_append_prepared": "kv_append",
        "build_tree_emit_out": "build_tree_emit",  # the emit into a given tree
        "accept_sample_no_trunc": "accept_sample",
        "graft_out": "graft",
        "graft_merge_out": "graft_merge",
        "graft_tail_out": "graft_tail",
        "prune_out": "prune",
    }
    monkeypatch.setattr(_library, "DIRECT", 2)
    for case in OPS:
        seen = set()

        def profile(frame, event, arg, seen=seen):
            if event == "call" and frame.f_code in backends:
                seen.update(backends[frame.f_code])

        sys.setprofile(profile)
        try:
            calls[case]()
        except Exception:  # noqa: BLE001 - a backend that needs CUDA-only state (the adjacency
            pass  # table's claim array): it was called, which is what this test asks
        finally:
            sys.setprofile(None)
        assert op_of.get(case, case) in seen, (case, seen)


def test_direct_path_not_under_jit_trace(monkeypatch):
    monkeypatch.setattr(_library, "DIRECT", 2)
    seen = []

    def f(t):
        seen.append(direct_ok((t,), 0, 0))
        return t + 1

    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.jit.trace(f, (torch.zeros(2),), check_trace=False)
    assert seen == [False] and direct_ok((torch.zeros(2),), 0, 0)


# --------------------------------------------------------------- on the GPU (TREEOPS_GPU_TESTS=1)
def _decode_step(dev, k, v, kc0, vc0, bt, sl, q0, tree, logits):
    kc, vc, q = kc0.clone(), vc0.clone(), q0.clone()
    treeops.kv_append(k, v, kc, vc, bt, sl, tree.num_nodes, tree.depth, q=q)
    out = treeops.tree_attention(q, kc, vc, bt, sl, tree)
    r = treeops.rope(q0, tree.positions(sl))
    acc = treeops.accept_greedy(tree, logits)
    w = treeops.cast_width(logits[:, :, 0].contiguous(), torch.linspace(1, 2, 4, device=dev), 0.5)
    return [kc, vc, q, out, r, acc.accepted, acc.accept_len, acc.bonus, w]


_OPT_IN = pytest.mark.skipif(
    not (_launch.ENABLED and _library.DIRECT),
    reason="the lean paths are turned off (TREEOPS_DISPATCH=1 or TREEOPS_DIRECT_LAUNCH=0)",
)


@pytest.mark.gpu
@_OPT_IN
def test_gpu_direct_paths_compute_what_the_dispatched_triton_paths_do(monkeypatch):
    """On the GPU: a decode step's ops through the direct paths (no dispatcher, direct launches)
    give bitwise the results of the old paths (the OpOverload, JITFunction.run), and repeated
    calls launch every kernel directly (no launch through JITFunction.run)."""
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    B, N, HQ, HKV, D, P = 2, 4, 4, 2, 64, 16
    tree = _tree(B, N).to(dev)

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(dtype).to(dev)

    k, v, q0 = rnd(B, N, HKV, D), rnd(B, N, HKV, D), rnd(B, N, HQ, D)
    kc0, vc0 = rnd(4, P, HKV, D), rnd(4, P, HKV, D)
    bt = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=dev)
    sl = torch.tensor([3, 5], dtype=torch.int32, device=dev)
    logits = rnd(B, N, 16, dtype=torch.float32)
    args = (dev, k, v, kc0, vc0, bt, sl, q0, tree, logits)
    _decode_step(*args)  # first calls: compiles, plans, direct-launch keys
    misses = sum(lau.misses for lau in _launch.LAUNCHERS)
    new = _decode_step(*args)
    torch.cuda.synchronize()
    assert sum(lau.misses for lau in _launch.LAUNCHERS) == misses  # every launch direct
    monkeypatch.setattr(_library, "DIRECT", 0)
    for lau in _launch.LAUNCHERS:
        monkeypatch.setattr(lau, "launch", lau._triton)
    old = _decode_step(*args)
    torch.cuda.synchronize()
    for a, b in zip(new, old, strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
@_OPT_IN
def test_gpu_direct_launch_picks_tritons_kernel():
    """On the GPU's own driver: for pointers aligned and not, two dtypes and strides 1 / 16 / 17,
    the kernel a direct launch runs is the one in Triton's cache under Triton's key."""
    from triton import knobs

    from treeops.kernels import kv_append as kk

    fn = kk._rope
    lau = _launch.Launcher(fn)
    dev = torch.device("cuda")
    inv = kk.inv_freq(64, 10000.0, dev)
    for dtype in (torch.float32, torch.bfloat16):
        for off in (0, 1, 8):
            n = 2 * 3 * 4 * 64
            x = torch.randn(n + 16, device=dev).to(dtype)[off : off + n].view(2, 3, 4, 64)
            y = torch.empty(n + 16, device=dev, dtype=dtype)[off : off + n].view(2, 3, 4, 64)
            pos = torch.arange(6, device=dev).view(2, 3)
            for _ in range(2):
                args = (x, pos, inv, y, 3, 4, *x.stride(), *pos.stride(), *y.stride()[:3])
                kw = dict(H_PAD=4, HALF=32, num_warps=2)
                got = lau.launch((6,), *args, **kw)
                caches = fn.device_caches[torch.cuda.current_device()]
                kernel_cache, key_cache, _, _, binder = caches
                tkw = dict(kw, debug=kw.get("debug", fn.debug) or knobs.runtime.debug,
                           instrumentation_mode=knobs.compilation.instrumentation_mode)  # fmt: skip
                _, spec, options = binder(*args, **tkw)
                assert got is kernel_cache.get(compute_cache_key(key_cache, spec, options))
            tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
            want = kk_rope_reference(x, pos)
            torch.testing.assert_close(y.float(), want.float(), atol=tol, rtol=tol)
    # the first launch of each new key: fp32 and bf16, each aligned and 1-element misaligned
    # (an offset of 8 elements is 16-byte aligned for both: the aligned kernel, launched directly)
    assert lau.misses == 4
    # and those direct launches called Triton's C launcher itself (no scratch to allocate)
    assert lau.cache and all(entry[4] for entry in lau.cache.values())


def kk_rope_reference(x, pos):
    from treeops.reference import kv_append as ref

    return ref.rope(x, pos, 10000.0)


def test_scratch_is_kept_per_key_device_and_stream_and_fresh_in_capture(monkeypatch):
    """``_launch.scratch``: a launcher's scratch is reused by the next call with equal sizes on
    the same device and stream (where the caching allocator would reuse the block), never
    shared across streams, and always fresh inside a CUDA-graph capture."""
    made = []

    def make():
        made.append(torch.empty(4))
        return (made[-1],)

    cpu = torch.device("cpu")
    a = _launch.scratch(("test", 1), cpu, make)
    assert _launch.scratch(("test", 1), cpu, make) is a and len(made) == 1
    assert _launch.scratch(("test", 2), cpu, make) is not a and len(made) == 2
    stream = [7]
    monkeypatch.setattr(_launch, "_current_stream", lambda index: (stream[0], index, 1))
    monkeypatch.setattr(_launch, "_capturing", lambda: False)
    gpu = torch.device("cuda", 0)
    b = _launch.scratch(("test", 1), gpu, make)
    assert b is not a and _launch.scratch(("test", 1), gpu, make) is b
    stream[0] = 8  # another stream: its own
    assert _launch.scratch(("test", 1), gpu, make) is not b
    monkeypatch.setattr(_launch, "_capturing", lambda: True)
    n = len(made)
    c1, c2 = _launch.scratch(("test", 1), gpu, make), _launch.scratch(("test", 1), gpu, make)
    assert c1 is not c2 and len(made) == n + 2
    _launch._SCRATCH.clear()


@pytest.mark.parametrize(
    "value, expected",
    [(None, "0 1"), ("0", "0 0"), ("1", "1 1"), ("early", "2 2"), ("on", "TREEOPS_PDL must be")],
)
def test_pdl_environment_sets_every_launch(value, expected):
    """``TREEOPS_PDL`` (read at import, kernels/_pdl.py): unset, each op's default (the build's
    late release, attention's none); ``0`` / ``1`` / ``early`` every launch; anything else a
    ValueError naming the variable. ``MODE`` and the mode an op defaulting to late release gets
    (the GPU check stubbed: CPU tensors never take PDL)."""
    import os
    import subprocess
    import sys

    code = (
        "import torch; from treeops.kernels import _pdl; _pdl._capable = lambda i: True; "
        "dev = torch.device('cuda', 0); "
        "print(_pdl.use_pdl(dev), _pdl.use_pdl(dev, _pdl.PDL_LATE.value))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TREEOPS_PDL", "TRITON_INTERPRET")}
    if value is not None:
        env["TREEOPS_PDL"] = value
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    if expected.startswith("TREEOPS_PDL"):
        assert proc.returncode != 0
        assert "ValueError: TREEOPS_PDL must be 0, 1 or early, got 'on'" in proc.stderr
    else:
        assert proc.returncode == 0 and proc.stdout.split() == expected.split(), proc.stderr

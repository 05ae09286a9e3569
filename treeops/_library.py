"""The ``treeops`` torch.library namespace: every public op is a custom op ``torch.ops.treeops.*``.

Each op module defines its op here with a schema that declares what it mutates, a CPU backend (the
PyTorch reference), a CUDA backend (the Triton launcher) and a fake implementation that only
computes output shapes, so that ``torch.compile`` traces through the public functions and
``torch.library.opcheck`` can test them. Ops that write into output buffers take them as mutated
arguments and return nothing; the public functions allocate them when the caller passes none.

The low-level ``torch.library.Library`` API is used rather than the ``custom_op`` decorator: its
dispatch costs a few microseconds per call, the decorator's tens (measured on CPU, torch 2.13),
and eager calls are on an engine's host path.

Two paths, one backend. ``define`` returns a callable (``_make_op``) that the public functions call
like the ``OpOverload``. A plain eager call on CUDA tensors skips the dispatcher and calls the CUDA
backend directly (the same Python function the dispatcher would call, with the same arguments);
every other call goes through the ``OpOverload``. The dispatcher is needed where something
intercepts the op: ``torch.compile``/``torch.export`` tracing (the op and its fake implementation
are what they trace), a ``TorchDispatchMode`` or ``TorchFunctionMode`` (``FakeTensorMode``,
``make_fx``, ``treeops.testing.NoHostSync``, ``with torch.device(...)``), tensor subclasses,
functorch transforms, the profiler (it records the op by name), ``torch.jit.trace`` (it records the
op), CPU and meta tensors (their backends), and an op that returns tensors while grad mode is on
and an input requires grad (the dispatcher's autograd fallback marks its outputs). None of these
applies to an engine's eager step, and there the dispatch is most of treeops' host time (about 4.5
µs of a 10 µs call on a fast CPU, three times that on the H200's host). The guard (``direct_ok``,
inlined in each op) costs about half a microsecond on that CPU: six thread-state queries and one
pass over the argument types in C (``map(type, args)``).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

from .tree import Tree

LIB = torch.library.Library("treeops", "DEF")

TREE = ", ".join(f"Tensor tree_{f}" for f in Tree.FIELDS)
"""The schema fragment of a ``Tree`` argument: its fields in ``Tree.FIELDS`` order."""

OUT_TREE = ", ".join(f"Tensor({a}!) out_{f}" for a, f in zip("stuvwxyz", Tree.FIELDS, strict=True))
"""The schema fragment of a ``Tree`` written in place (alias sets s..z)."""

CUDA_BACKENDS: dict[str, Callable] = {}
"""Each op's CUDA backend by op name (``bench/bench_host.py`` runs them on CPU tensors to time
the launchers' host code)."""

OPS: dict[str, Callable] = {}
"""Every op's callable (``define``) by name."""

DIRECT = 0 if os.environ.get("TREEOPS_DISPATCH") == "1" else 1
"""1 (default): plain eager calls on CUDA tensors call the CUDA backend directly; 0 (set
``TREEOPS_DISPATCH=1`` in the environment): every call goes through the dispatcher; 2: CPU
tensors too, for ``bench/bench_host.py`` and the tests, which install the CUDA backends (Triton's
launch stubbed) where the CPU reference would run. The GPU test suite passes on both paths."""

_PLAIN = frozenset({torch.Tensor, type(None), int, float, bool})
_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack
_function_modes = torch._C._len_torch_function_stack
_functorch = torch._C._are_functorch_transforms_active
_profiling = torch._C._autograd._profiler_enabled
_jit_tracing = torch._C._get_tracing_state
_grad = torch.is_grad_enabled
_any_requires_grad = torch._C._any_requires_grad
_plain_issuperset = _PLAIN.issuperset
_plain_or_list_issuperset = (_PLAIN | {list}).issuperset
_tensors_only = frozenset({torch.Tensor}).issuperset


def direct_ok(args: tuple, first: int, returns: int) -> bool:
    """Whether a call with these positional arguments may skip the dispatcher (the guard each op
    runs inline, spelled out for the tests): not compiling or tracing, no dispatch or function mode,
    no functorch transform, no profiler, no ``torch.jit.trace``, ``args[first]`` (the op's
    first ``Tensor`` argument) on CUDA, every argument a plain ``torch.Tensor``, None, int,
    float or bool, and for an op that returns tensors, grad mode off or no argument requiring
    grad. Each op also needs every argument given and its ``int``/``float`` arguments of
    exactly those classes (``_make_op``)."""
    if first < 0 or not direct_state_ok():
        return False
    a = args[first]
    return (
        (a.is_cuda or DIRECT == 2)
        and _PLAIN.issuperset(map(type, args))
        and not (returns and _grad() and _any_requires_grad(*args))
    )


def direct_state_ok() -> bool:
    """``direct_ok``'s thread-state half: the direct path is on, and nothing is compiling or
    tracing, no dispatch or function mode, functorch transform or profiler is active (what a
    replay of recorded launches, ``treeops.prepare``, asks too)."""
    return (
        bool(DIRECT)
        and not _compiling()
        and not (_dispatch_modes() or _function_modes() or _functorch() or _profiling())
        and _jit_tracing() is None
    )


_SCALARS = {"int": "int", "float": "float", "bool": "bool"}


def _make_op(overload: torch._ops.OpOverload, cuda: Callable) -> Callable:
    """The callable ``define`` returns: a function generated per op (a Python call of it costs
    less than of an object's ``__call__``, and its scalar checks are inline), with ``overload``,
    ``cuda``, ``first`` and ``returns`` attributes.

    The direct path also needs every argument given (``len(args)``) and each ``int``/``float``
    schema argument of exactly that class: the dispatcher hands the backend a Python int for an
    ``int`` and a float for a ``float`` (it would turn ``True`` into 1, 1 into 1.0), so the
    backend, and the Triton kernel's specialisation, see the same values on both paths."""
    schema = overload._schema
    name = schema.name.split("::", 1)[-1]
    args = schema.arguments
    first = next((i for i, a in enumerate(args) if str(a.type) == "Tensor"), -1)
    returns = len(schema.returns)
    checks = []
    plain = "_plain_issuperset"
    for i, a in enumerate(args):
        ty = str(a.type)
        if ty in _SCALARS:
            checks.append(f"args[{i}].__class__ is {_SCALARS[ty]}")
        elif ty == "List[Tensor]":  # a list of plain tensors (as the dispatcher passes it on)
            checks.append(f"args[{i}].__class__ is list and _tensors_only(map(type, args[{i}]))")
            plain = "_plain_or_list_issuperset"
        elif ty not in ("Tensor", "Optional[Tensor]"):
            first = -1  # an argument the direct path does not vet (none so far): dispatch
    scalar_ok = " and ".join(checks) or "True"
    if returns == 0:
        call = "cuda(*args)\n            return None"
    elif returns == 1:
        call = "return cuda(*args)"
    else:
        call = (
            "out = cuda(*args)\n"
            "                return out if out.__class__ is tuple else tuple(out)"
        )
    if returns:
        call = f"if not (_grad() and _any_requires_grad(*args)):\n                {call}"
    src = f"""
def _factory(overload, cuda):
    def {name}(*args):
        # direct_ok, inlined: see its docstring
        if (
            DIRECT
            and not _compiling()
            and len(args) == {len(args)}
            and (args[{first}].is_cuda or DIRECT == 2)
            and not (_dispatch_modes() or _function_modes() or _functorch() or _profiling())
            and _jit_tracing() is None
            and {plain}(map(type, args))
            and {scalar_ok}
        ):
            {call}
        return overload(*args)

    return {name}
"""
    if first < 0:
        src = f"""
def _factory(overload, cuda):
    def {name}(*args):
        return overload(*args)

    return {name}
"""
    ns: dict = {}
    exec(compile(src, f"<treeops op {name}>", "exec"), globals(), ns)
    op = ns["_factory"](overload, cuda)
    op.overload = overload
    op.cuda = cuda
    op.first = first
    op.returns = returns
    op.source = src
    op.__doc__ = (
        f"treeops::{name}: the CUDA backend directly on a plain eager call (direct_ok), "
        "else the OpOverload (same backend)."
    )
    return op


def define(
    schema: str,
    *,
    cpu: Callable,
    cuda: Callable,
    fake: Callable | None = None,
) -> Callable:
    """Define ``treeops::<schema>`` with its CPU and CUDA backends; ``fake`` (shapes only) defaults
    to doing nothing, right for ops that return nothing and only write their mutated arguments.
    Returns the callable the public function calls (``_make_op``; its ``overload`` is the
    ``OpOverload``)."""
    name = schema.split("(", 1)[0]
    LIB.define(schema)
    LIB.impl(name, cpu, "CPU")
    LIB.impl(name, cuda, "CUDA")
    CUDA_BACKENDS[name] = cuda
    torch.library.register_fake(f"treeops::{name}", fake or _no_output, lib=LIB)
    op = OPS[name] = _make_op(getattr(torch.ops.treeops, name).default, cuda)
    return op


def _no_output(*args, **kwargs) -> None:
    return None

"""Prepared calls: an op call checked and recorded once, its kernel launches replayed per call.

An engine calls the per-layer ops (``tree_attention``, ``kv_append``) once a layer, with the same
step-wide arguments (block table, sequence lengths, tree, workspace) and that layer's tensors.
``prepare(op, *args, rebind=names, **kwargs)`` makes the call ``op(*args, **kwargs)`` once, with
every check and the launch plan, records the kernel launches it makes, and returns a
``Prepared``: ``prepared(*tensors)`` launches the same kernels again with the ``rebind``
arguments replaced by ``tensors`` (in ``rebind``'s order) and every other argument as given to
``prepare`` (FlashInfer's plan / run, for any of these ops). A call costs one C++ check of every
tensor's metadata (type, dispatch keys, dtype, device, sizes, strides: dynamo's ``TensorGuards``),
their data pointers, and Triton's C launcher per kernel, without the op's Python layers.

The contract (what the replay assumes, and what it checks):

* The other tensor arguments are kept as objects: the replay reads and writes the tensors given
  to ``prepare``, so refill them in place between calls (an engine's persistent buffers) rather
  than passing new ones; a ``Tree``'s field tensors are kept, not the ``Tree``. Their contents
  may change; their metadata is checked on every call with the rebound tensors'.
* A call whose tensors differ in any checked property from those given to ``prepare``, or whose
  pointers are not 16-byte aligned where those were (Triton specialises on it), or that runs
  where the op would not launch directly (``torch.compile`` tracing, a dispatch or function mode,
  the profiler, Triton launch hooks, another current device), calls the op itself with the
  rebound arguments: its checks raise their ``ValueError`` for bad input, and the result is the
  op's. ``Prepared.replays`` counts the calls that replayed.
* Outputs are the caller's: ``tree_attention`` needs ``out`` (and ``lse`` with
  ``return_lse=True``) given, which may be rebound; a prepared call returns what the op returns,
  the rebound tensors where those were returned.
* Buffers the op made for itself in the recorded call (a split-KV workspace when none was
  given, scratch) belong to the ``Prepared``: runs of one ``Prepared`` must not overlap
  (one stream, or streams ordered by events), as with a ``workspace`` argument.
* Where the recorded call's launches cannot be replayed (CPU tensors, Triton's interpreter, a
  launch that went through Triton's own path), every call is the op's call (``fast`` is False).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch

from . import _checks, _library
from . import kv_append as _kv_append_mod
from . import tree_attention as _tree_attention_mod
from .kernels import _launch
from .kernels._replay import NotReplayable as _NotReplayable
from .kernels._replay import launch_line, stand_in
from .tree import Tree

__all__ = ["prepare", "Prepared"]


def _tree_attention_outputs(args: dict) -> tuple[str, ...]:
    return ("out", "lse") if args.get("return_lse") else ("out",)


PREPARABLE: dict[Callable, Callable[[dict], tuple[str, ...]]] = {
    _tree_attention_mod.tree_attention: _tree_attention_outputs,
    _kv_append_mod.kv_append: lambda args: (),
}
"""The ops ``prepare`` takes, each with the output arguments a prepared call needs given. Each
one's CUDA path is kernel launches only (no other device work that a replay would skip)."""


def prepare(op: Callable, *args, rebind: tuple[str, ...] | list[str] = (), **kwargs) -> Prepared:
    """Make the call ``op(*args, **kwargs)`` and return it prepared: ``Prepared(*tensors)``
    repeats it with the arguments named in ``rebind`` replaced (see the module docstring).

    Args:
        op: ``treeops.tree_attention`` or ``treeops.kv_append``.
        args, kwargs: the call, as the op takes it (``validate`` must be False: a prepared call
            never syncs with the host); ``tree_attention`` needs ``out=`` (and ``lse=`` with
            ``return_lse=True``).
        rebind: names of the op's tensor arguments each call passes anew, e.g. ``("q",
            "k_cache", "v_cache", "out")``; every other argument is kept.

    Returns:
        the ``Prepared`` call; this call's result is ``op``'s, which ``prepare`` returns nothing
        of (read it from the output buffers).

    Example:
        >>> import torch, treeops
        >>> k_cache, v_cache = torch.zeros(4, 16, 2, 64), torch.zeros(4, 16, 2, 64)
        >>> bt = torch.tensor([[2, 3]], dtype=torch.int32)
        >>> sl, nt = torch.tensor([15], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
        >>> k, v = torch.randn(1, 3, 2, 64), torch.randn(1, 3, 2, 64)
        >>> append = treeops.prepare(treeops.kv_append, k, v, k_cache, v_cache, bt, sl, nt,
        ...                          rebind=("k", "v", "k_cache", "v_cache"))
        >>> k2, v2 = torch.randn(1, 3, 2, 64), torch.randn(1, 3, 2, 64)
        >>> append(k2, v2, k_cache, v_cache)  # the next layer's K/V and caches
        >>> bool((v_cache[3, 0] == v2[0, 1]).all())
        True
    """
    outputs = PREPARABLE.get(op)
    if outputs is None:
        names = ", ".join(f"treeops.{f.__name__}" for f in PREPARABLE)
        raise ValueError(f"Invalid op: prepare takes {names}, got {op!r}")
    bound = inspect.signature(op).bind(*args, **kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    if arguments.get("validate"):
        raise ValueError("Invalid value of validate: a prepared call never syncs (validate=False)")
    names = tuple(rebind)
    for name in names:
        if name not in arguments:
            raise ValueError(f"Invalid rebind: {op.__name__} has no argument {name!r}")
        if not isinstance(arguments[name], torch.Tensor):
            raise ValueError(
                f"Invalid rebind: {name!r} must be a tensor argument of the call, got "
                f"{type(arguments[name]).__name__}"
            )
    if len(set(names)) < len(names):
        raise ValueError(f"Invalid rebind: a name is given twice in {names}")
    for name in outputs(arguments):
        if arguments.get(name) is None:
            raise ValueError(
                f"Invalid value of {name}: prepare needs {name}= given (a prepared call writes "
                "into the buffers it is given)"
            )
    with _launch.recording() as launches:
        result = op(**arguments)
    return Prepared(op, arguments, names, launches, result)


class Prepared:
    """A prepared call (``prepare``): ``prepared(*tensors)`` with one tensor per ``rebind`` name.

    ``fast``: whether calls can replay the recorded launches (else each is the op's call);
    ``replays``: calls that did."""

    def __init__(self, op, arguments: dict, names: tuple, launches, result) -> None:
        self.op, self.names = op, names
        self._arguments = arguments
        self.replays = 0
        self.fast = False
        self._run: Callable | None = None
        self._result = None
        try:
            self._build(launches, result)
        except _NotReplayable as e:
            self.reason = str(e)
        else:
            self.fast, self.reason = True, ""

    def __repr__(self) -> str:
        how = "replays its launches" if self.fast else f"calls the op ({self.reason})"
        return f"Prepared({self.op.__name__}, rebind={self.names}, {how})"

    # ---------------------------------------------------------------------------- building
    def _build(self, launches, result) -> None:
        rebound = [self._arguments[n] for n in self.names]
        if len({id(t) for t in rebound}) < len(rebound):
            raise _NotReplayable("one tensor is rebound under two names")
        kept: list[torch.Tensor] = []  # the other tensor arguments, each once
        for name, value in self._arguments.items():
            if name in self.names:
                continue
            for t in value.tensors() if isinstance(value, Tree) else (value,):
                if isinstance(t, torch.Tensor) and all(t is not k for k in kept):
                    if any(t is r for r in rebound):
                        raise _NotReplayable(f"{name} is also passed as a rebound tensor")
                    kept.append(t)
        # the kept tensors a launch reads or the op returns: the others need no check
        used = {id(a) for _, _, args in launches for a in args if isinstance(a, torch.Tensor)}
        used |= {id(t) for t in (result if isinstance(result, tuple) else (result,))}
        kept = [t for t in kept if id(t) in used]
        every = rebound + kept
        # CPU tensors run the reference, except where bench/bench_host.py times the CUDA
        # launchers' host code on them (stub kernels, no stream)
        if not (stand_in() or all(t.is_cuda for t in every)):
            raise _NotReplayable("the tensors are not all on CUDA (the op runs its reference)")
        if launches.missed or not launches:
            raise _NotReplayable("a launch of the recorded call went through Triton's own path")
        launch_state = _launch.launch_state()
        if not launch_state[0]:
            raise _NotReplayable("Triton's launch hooks are installed or its run replaced")
        guards = _checks._tensor_guards(every)
        if guards is None:
            raise _NotReplayable("torch has no C++ tensor checks for these tensors")
        dev = every[0].device.index if every[0].is_cuda else _CURRENT_DEVICE()
        storages = {t.untyped_storage().data_ptr() for t in rebound}
        stream = _CURRENT_STREAM if every[0].is_cuda else (lambda index: 0)
        ns: dict[str, object] = {"_stream": stream, "_dev": dev}
        lines, aligned = [], set()
        for j, (entry, grid, args) in enumerate(launches):
            cells = []
            for i, a in enumerate(args):
                if isinstance(a, torch.Tensor):
                    k = next((x for x, t in enumerate(every) if t is a), None)
                    if k is None:  # the op's own buffer: kept alive here, its pointer fixed
                        if a.untyped_storage().data_ptr() in storages:
                            raise _NotReplayable("a launch reads a view of a rebound tensor")
                        ns[f"c{j}_{i}"] = a.data_ptr()
                        ns[f"t{j}_{i}"] = a  # the reference that keeps it alive
                        cells.append(f"c{j}_{i}")
                    else:
                        if a.data_ptr() % 16 == 0:
                            aligned.add(k)
                        cells.append(f"p{k}")
                else:
                    ns[f"c{j}_{i}"] = a
                    cells.append(f"c{j}_{i}")
            lines.append(launch_line(j, entry, grid, cells, ns))
        for k in range(len(kept)):
            ns[f"k{k}"] = kept[k]
        ptrs = [f"    p{k} = r{k}.data_ptr()" for k in range(len(rebound))]
        ptrs += [f"    p{len(rebound) + k} = k{k}.data_ptr()" for k in range(len(kept))]
        check = " | ".join(f"p{k}" for k in sorted(aligned)) or "0"
        params = ", ".join(f"r{k}" for k in range(len(rebound)))
        src = "\n".join(
            [f"def run({params}):", *ptrs, f"    if ({check}) & 15:", "        return False",
             "    s = _stream(_dev)", *lines, "    return True"]
        )  # fmt: skip
        exec(compile(src, f"<treeops prepared {self.op.__name__}>", "exec"), ns)
        self.source = src
        self._result = _map_result(result, every)
        self._guards, self._kept, self._dev = guards, tuple(kept), dev
        self._launch_state = launch_state
        self._run = ns["run"]  # type: ignore[assignment]

    # ------------------------------------------------------------------------------- calls
    def __call__(self, *tensors: torch.Tensor):
        run = self._run
        if (
            run is not None
            and len(tensors) == len(self.names)
            and _library.direct_state_ok()
            and _launch.launch_state() == self._launch_state
            and _CURRENT_DEVICE() == self._dev
            and self._guards.check(*tensors, *self._kept)
            and run(*tensors)
        ):
            self.replays += 1
            res = self._result
            if res is None:
                return None
            every = tensors + self._kept
            if res.__class__ is int:
                return every[res]
            return tuple(every[i] for i in res)
        return self._call_op(tensors)

    def _call_op(self, tensors: tuple):
        if len(tensors) != len(self.names):
            raise TypeError(
                f"a prepared {self.op.__name__} takes {len(self.names)} tensors "
                f"({', '.join(self.names)}), got {len(tensors)}"
            )
        arguments = dict(self._arguments)
        arguments.update(zip(self.names, tensors, strict=True))
        return self.op(**arguments)


def _map_result(result, every: list):
    """The recorded call's result as indices into ``every`` (None, an index, or a tuple)."""
    if result is None:
        return None

    def index(t):
        k = next((x for x, e in enumerate(every) if e is t), None)
        if k is None:
            raise _NotReplayable("the op returned a tensor it made (pass its output buffer)")
        return k

    if isinstance(result, torch.Tensor):
        return index(result)
    return tuple(index(t) for t in result)


_CURRENT_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_CURRENT_DEVICE = getattr(torch._C, "_cuda_getDevice", None) or (lambda: -1)

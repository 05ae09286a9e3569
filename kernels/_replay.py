"""Replays of an op's plain calls: the eager host path of every op whose CUDA path only launches.

An op call pays its Python layers on every eager call: the public function, the custom op's
dispatch, the launch plan's lookup, the launcher's key. For the ops whose CUDA path is kernel
launches and allocations only, the launches of one call are a function of the call's key (its
``_checks.signature``: every tensor's type, shape, strides, dtype and device, and the value
arguments, plus whatever else the op launches as a scalar: RoPE's theta, CAST's thresholds, the
tree build's layer, an int budget) and its tensors' data pointers. So each such op keeps a
``Replays``: the first call of a key (the second, with ``record_after=1``) runs the op with its
launches recorded (``_launch.recording``), and later calls of that key launch the same kernels
through Triton's C launcher from code generated for it, with

* each argument tensor's data pointer where the recorded call passed that tensor, or a view the
  op made of it at the recorded offset (16-byte alignment checked where the recorded pointer had
  it: Triton specialises on it);
* fresh buffers where the op made its own: a result (``out`` when none is given) allocated as the
  op allocates it, any other buffer it made (a split-KV workspace when none is given) as fresh
  bytes, each per call as the op's ``torch.empty`` is; ``_launch.scratch`` buffers asked
  for again (kept per stream); the buffers a launcher keeps across calls (``_launch.kept``:
  RoPE's frequency table, acceptance's per-device workspace, the arrival counters) as recorded;
* everything else as recorded (grids, strides, scalars, constexprs).

The ops that keep one: ``tree_attention``, ``kv_append``, ``rope``, ``accept_greedy``,
``accept_sample``, ``compact_kv`` (stacked caches; a list of layers reaches the kernel through a
table of their pointers, which a replay would pass as recorded), the four ``cast_*`` rules,
``build_tree_expand`` / ``build_tree_emit``, and Graft's ``AdjacencyTable.update`` /
``warm_start`` / ``retrieve``, ``graft_merge``, ``graft``, ``graft_tail``, ``prune`` and
``PruneCheckpoints.check``. An op takes one only after an audit of its CUDA path: it may
allocate and make views, and launch, but do no other device work (a copy, a fill, a table built
from pointers), every buffer it makes must be its result, a ``kept`` buffer, or written by its
kernels before they read it (a replay does none of that work and gives fresh, uninitialised
memory), and every tensor a launch reads must be among the call's ``tensors`` (so its pointer is
read again) unless its identity follows from the key.

A call replays only where the op itself would launch directly (``_library.direct_state_ok``:
not tracing or compiling, no dispatch or function mode, no profiler), with Triton's launch state
and the current device as recorded; otherwise, and for a key whose recorded call cannot be
replayed (a view of arguments that overlap, a launch through Triton's own path), the op runs
as written. ``TREEOPS_REPLAY=0`` turns replays off. ``prepare`` (``treeops.prepared``) uses the
same launch code for calls that also keep some arguments.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch

from treeops import _library

from . import _launch

ENABLED = os.environ.get("TREEOPS_REPLAY", "1") != "0"
"""Whether plain calls replay (the default; ``TREEOPS_REPLAY=0`` turns it off: every call runs
the op's Python layers)."""

MISS = object()
"""``Replays.run``'s answer when the call must run the op."""

MAX_ENTRIES = 256
"""Signatures recorded per op; the table is emptied when full."""

MAX_MISSED = 3
"""Recordings of a signature whose launches went through Triton's own path before it is left
to the op for good."""


class NotReplayable(Exception):
    """Why a recorded call's launches cannot be replayed."""


def launch_line(j: int, entry: tuple, grid: Sequence[int], cells: list[str], ns: dict) -> str:
    """Source of launch ``j`` of a recorded call: ``entry`` (``_launch._entry``), its grid,
    and the expressions of its arguments (``cells``); the names it uses are put in ``ns``. The
    stream is ``s`` where the line runs."""
    if entry[0] is None or len(grid) > 3:
        raise NotReplayable("a launch without a launcher to call")
    g = tuple(grid) + (1,) * (3 - len(grid))
    ns[f"L{j}"], ns[f"F{j}"], ns[f"M{j}"] = entry[0], entry[1], entry[2]
    if entry[4]:  # the C launcher (_launch.py: _entry)
        ns[f"C{j}"], ns[f"P{j}"] = entry[5], entry[6]
        head = f"L{j}({g[0]}, {g[1]}, {g[2]}, s, F{j}, C{j}, P{j}, None, None, M{j}"
    else:
        head = f"L{j}({g[0]}, {g[1]}, {g[2]}, s, F{j}, M{j}"
    return f"    {head}, None, None, None, {', '.join(cells)})"


def stand_in() -> bool:
    """Whether the launchers run on CPU tensors against stub kernels (``bench/bench_host.py``):
    the only case where a CPU call launches (and so can be replayed)."""
    return _library.DIRECT == 2


class Replays:
    """One op's recorded plain calls, each keyed by its ``Signature``.

    ``run(key, tensors)``: the result of the call replayed, or ``MISS``; ``wants(key)``: whether
    a call of this signature should be recorded (``record``). ``tensors`` is the tuple whose
    signature ``key`` is (None where an optional tensor is absent); ``replays`` counts replays."""

    def __init__(self, name: str, record_after: int = 0) -> None:
        self.name = name
        self.record_after = record_after
        """Calls of a signature that run the op before one is recorded: 1 for an op whose key
        holds a float the caller may change on every call (a threshold), so that a value seen
        once costs no recording."""
        self._runs: dict = {}  # Signature -> (run, launch state, device), or None
        self._missed: dict = {}  # Signature -> recorded calls with a launch through Triton
        self._seen: dict = {}  # Signature -> calls not recorded (record_after > 0)
        self.replays = 0

    def run(self, key, tensors: tuple):
        if not ENABLED:
            return MISS
        entry = self._runs.get(key)
        if (
            entry is None
            or _launch.STATE.rec is not None  # a call being recorded (prepare) launches itself
            or not _library.direct_state_ok()
            or _launch.launch_state() != entry[1]
            or _CURRENT_DEVICE() != entry[2]
        ):
            return MISS
        res = entry[0](tensors)
        if res is not MISS:
            self.replays += 1
        return res

    def wants(self, key) -> bool:
        if not (
            ENABLED
            and key is not None
            and key not in self._runs
            and _launch.STATE.rec is None
            and _library.direct_state_ok()
        ):
            return False
        if self.record_after:
            n = self._seen.get(key, 0)
            if n < self.record_after:
                if len(self._seen) >= 4 * MAX_ENTRIES:
                    self._seen.clear()
                self._seen[key] = n + 1
                return False
        return True

    def call(self, key, tensors: tuple, op: Callable, *args, result=MISS):
        """``op(*args)``, recorded for ``key``'s replays when this signature wants a recording
        (``wants``); returns what ``op`` returns. ``result``: what the public call returns
        (outputs it made before the op) when that is not ``op``'s return."""
        if not self.wants(key):
            return op(*args)
        with _launch.recording() as launches:
            ret = op(*args)
        self.record(key, tensors, launches, ret if result is MISS else result)
        return ret

    def record(self, key, tensors: tuple, launches, result) -> None:
        """Keep the recorded call of ``key`` (``launches`` from ``_launch.recording``,
        ``result`` what the op returned), or that it cannot be replayed. A call with a launch
        through Triton's own path (its first compile, say) is not kept: the next is recorded,
        up to ``MAX_MISSED`` times."""
        if len(self._runs) >= MAX_ENTRIES:
            self._runs.clear()
            self._missed.clear()
        if launches.missed:
            n = self._missed[key] = self._missed.get(key, 0) + 1
            if n >= MAX_MISSED:  # a launch that never goes direct: stop recording
                self._runs[key] = None
            return
        try:
            run, source = _compile(self.name, tensors, launches, result)
        except NotReplayable:
            self._runs[key] = None
            return
        run.source = source  # type: ignore[attr-defined]
        self._runs[key] = (run, _launch.launch_state(), _device_of(tensors))

    def source(self, key) -> str | None:
        """The generated code of ``key``'s replay (None: not recorded or not replayable)."""
        entry = self._runs.get(key)
        return entry[0].source if entry else None


def _device_of(tensors: tuple) -> int:
    t = next(t for t in tensors if isinstance(t, torch.Tensor))
    return t.device.index if t.is_cuda else _CURRENT_DEVICE()


def _compile(name: str, tensors: tuple, launches, result) -> tuple[Callable, str]:
    """The replay of a recorded call: ``run(tensors)`` -> the op's result, or ``MISS`` where a
    pointer that was 16-byte aligned is not."""
    args = [(k, t) for k, t in enumerate(tensors) if isinstance(t, torch.Tensor)]
    if not args or not (stand_in() or all(t.is_cuda for _, t in args)):
        raise NotReplayable("the tensors are not all on CUDA (the op runs its reference)")
    if not launches:
        raise NotReplayable("the call launched nothing")
    if not _launch.launch_state()[0]:
        raise NotReplayable("Triton's launch hooks are installed or its run replaced")
    if result is None:
        results = []
    elif isinstance(result, torch.Tensor):
        results = [result]
    else:  # a tuple (a NamedTuple such as Acceptance) of tensors and Nones, or a Tree
        results = [t for t in _fields(result) if t is not None]
    arg_storages = {t.untyped_storage().data_ptr() for _, t in args}
    dev = _device_of(tensors)
    ns: dict[str, object] = {
        "_stream": _CURRENT_STREAM if args[0][1].is_cuda else (lambda index: 0),
        "_dev": dev,
        "_empty_strided": torch.empty_strided,
        "_empty": torch.empty,
        "_scratch": _launch.scratch,
        "_u8": torch.uint8,
        "MISS": MISS,
    }
    head: list[str] = []  # the pointers and buffers, before the launches
    used: set[int] = set()  # argument positions whose pointer is read
    aligned: set[str] = set()  # pointer expressions 16-byte aligned in the recorded call
    made: dict[int, str] = {}  # storage of a buffer the op made -> the name of its base pointer
    asked: set[int] = set()  # scratch calls made again
    scratch_of = {
        id(b): (s, i)
        for s, (_, _, _, bufs) in enumerate(launches.scratch)
        for i, b in enumerate(bufs)
    }

    def fresh(a: torch.Tensor) -> str:
        """The base pointer's name of a fresh buffer in place of the op's own ``a``'s storage."""
        sp = a.untyped_storage().data_ptr()
        if sp in made:
            return made[sp]
        n = len(made)
        owner = next((r for r in results if r.untyped_storage().data_ptr() == sp), None)
        if owner is not None:  # a result: made as the op made it, returned
            if owner.storage_offset() or owner.untyped_storage().nbytes() != _extent(owner):
                raise NotReplayable("a result is a view of a buffer the op made")
            r = next(x for x, t in enumerate(results) if t is owner)
            ns[f"S{n}"], ns[f"T{n}"], ns[f"D{n}"] = tuple(owner.shape), owner.stride(), owner.dtype
            ns[f"V{n}"] = owner.device
            head.append(f"    o{r} = _empty_strided(S{n}, T{n}, dtype=D{n}, device=V{n})")
            head.append(f"    b{n} = o{r}.data_ptr()")
        else:  # its own scratch: fresh bytes per call, as its torch.empty was
            ns[f"V{n}"] = a.device
            nbytes = a.untyped_storage().nbytes()
            head.append(f"    f{n} = _empty({nbytes}, dtype=_u8, device=V{n})")
            head.append(f"    b{n} = f{n}.data_ptr()")
        if sp % 16:
            raise NotReplayable("a buffer the op made is not 16-byte aligned")
        made[sp] = f"b{n}"
        return made[sp]

    lines = []
    for j, (entry, grid, largs) in enumerate(launches):
        cells = []
        for i, a in enumerate(largs):
            if not isinstance(a, torch.Tensor):
                ns[f"c{j}_{i}"] = a
                cells.append(f"c{j}_{i}")
                continue
            k = next((k for k, t in args if t is a), None)
            if k is None and a.untyped_storage().data_ptr() in arg_storages:
                k = _viewed(a, args)  # a view the op made of an argument: at its offset
            if k is not None:
                used.add(k)
                off = a.data_ptr() - tensors[k].data_ptr()
                cell = f"(p{k} + {off})" if off else f"p{k}"
                if a.data_ptr() % 16 == 0:
                    aligned.add(cell)
                cells.append(cell)
            elif _launch.is_kept(a):  # a launcher's own table or counters: as recorded
                ns[f"c{j}_{i}"], ns[f"t{j}_{i}"] = a.data_ptr(), a
                cells.append(f"c{j}_{i}")
            elif id(a) in scratch_of:
                s, b = scratch_of[id(a)]
                if s not in asked:
                    asked.add(s)
                    key, device, make, _ = launches.scratch[s]
                    ns[f"K{s}"], ns[f"E{s}"], ns[f"G{s}"] = key, device, make
                    head.append(f"    w{s} = _scratch(K{s}, E{s}, G{s})")
                cells.append(f"w{s}[{b}].data_ptr()")
            else:
                base = fresh(a)
                off = a.data_ptr() - a.untyped_storage().data_ptr()
                cells.append(f"{base} + {off}" if off else base)
        lines.append(launch_line(j, entry, grid, cells, ns))
    for t in results:  # a result no launch wrote (an empty tensor): made too
        if not any(t is a for _, a in args) and t.untyped_storage().data_ptr() not in made:
            fresh(t)
    ptrs = [f"    p{k} = t[{k}].data_ptr()" for k in sorted(used)]
    check = " | ".join(sorted(aligned)) or "0"

    def ret(t: torch.Tensor) -> str:
        k = next((k for k, a in args if a is t), None)
        return (
            f"t[{k}]" if k is not None else f"o{next(x for x, r in enumerate(results) if r is t)}"
        )

    if result is None:
        out = "None"
    elif isinstance(result, torch.Tensor):
        out = ret(result)
    else:
        items = "".join("None, " if t is None else f"{ret(t)}, " for t in _fields(result))
        if isinstance(result, tuple) and not hasattr(result, "_make"):
            out = f"({items})"
        else:  # a NamedTuple, or a Tree: the same type back, built from its fields
            ns["_R"] = type(result)
            out = f"_R({items})"
    src = "\n".join(
        ["def run(t):", *ptrs, f"    if ({check}) & 15:", "        return MISS", *head,
         "    s = _stream(_dev)", *lines, f"    return {out}"]
    )  # fmt: skip
    exec(compile(src, f"<treeops replay {name}>", "exec"), ns)
    return ns["run"], src  # type: ignore[return-value]


def _fields(result) -> tuple:
    """A result's tensors (None where absent), in the order its type is built from: a tuple's
    items, or an object's ``tensors()`` (a ``Tree``: ``Tree(*tree.tensors())`` rebuilds it)."""
    return tuple(result) if isinstance(result, tuple) else tuple(result.tensors())


def _viewed(a: torch.Tensor, args: list) -> int:
    """The argument position whose elements ``a`` (a view the op made) starts in: exactly one
    argument on ``a``'s storage may span its first byte, else (arguments that overlap there)
    which one the op sliced is unknown."""
    sp, p = a.untyped_storage().data_ptr(), a.data_ptr()
    hits = [
        k
        for k, t in args
        if t.untyped_storage().data_ptr() == sp and 0 <= p - t.data_ptr() < max(_extent(t), 1)
    ]
    if len(hits) != 1:
        raise NotReplayable("a launch reads a view of arguments that overlap")
    return hits[0]


def _extent(t: torch.Tensor) -> int:
    """Bytes ``torch.empty_strided(t.shape, t.stride())`` allocates for ``t``."""
    if t.numel() == 0:
        return 0
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return span * t.element_size()


_CURRENT_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_CURRENT_DEVICE = getattr(torch._C, "_cuda_getDevice", None) or (lambda: -1)

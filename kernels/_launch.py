"""Direct launches of Triton kernels: Triton's compiled kernel, without ``JITFunction.run``.

``kernel[grid](*args)`` spends 5-20 µs of Python per launch before the C launch (on a fast CPU;
about three times that on the H200's host): it binds every argument to the signature, specialises
each one (``native_specialize_impl``: a pointer's dtype and 16-byte alignment, an integer's range,
whether it equals 1 or is divisible by 16), builds a string key from them and the options, looks
the compiled kernel up, checks the globals it read, and builds the launch metadata for the hooks.
``direct(kernel).launch(grid, *args, **kwargs)`` takes the same arguments and does the lookup
itself, from a key that costs a fraction of that, then calls the compiled kernel's launcher
exactly as ``JITFunction.run`` does (``compiled.run(grid..., stream, function, packed_metadata,
...)``), or, for a kernel without scratch memory, the C function that launcher calls with the
arguments it would pass (``_entry``).

Why it launches what Triton would. The key is a tuple, built by code generated per kernel (no loop
in Python), that holds everything Triton's specialisation depends on, and more:

* each tensor argument's dtype and whether its data pointer is 16-byte aligned;
* each integer's value (its value fixes its range, ``== 1``, ``% 16``), or for a
  ``do_not_specialize`` integer whether it fits in int32 (else its value); the key is built only
  when every integer argument is exactly an ``int`` (one check over all of them);
* each float's or bool's class (Triton specialises neither on its value), ``is None`` for None;
* each constexpr's class and value; the launch options (``num_warps``, ``num_stages``,
  ``launch_pdl``) with their classes; ``knobs.runtime.debug`` and
  ``knobs.compilation.instrumentation_mode`` (options Triton adds); the driver object and the
  current device (Triton's caches are per device).

So two calls with equal keys get equal specialisations. A key not seen before launches through
``JITFunction.run`` (compiling if needed) and stores the ``CompiledKernel`` it returns under the
key, provided every argument has the kind the generated code was built for (the kinds of the first
call: tensor, int, float, bool, None; the ``int`` check and the class entries keep a bool or a
float from matching a stored int). tests/test_host_path.py checks, for arguments that differ in
every specialised property (integers 1, 16, 17; pointers aligned and not; dtypes), that the kernel
launched is the one in Triton's own cache under Triton's own key.

Always through ``JITFunction.run`` instead: under ``TRITON_INTERPRET=1`` (the kernel is no
``JITFunction``) and with ``TREEOPS_DIRECT_LAUNCH=0`` in the environment; when ``JITFunction.run``
is not Triton's (``bench/compile_check.py``'s compile-only run, ``bench/bench_host.py``'s timing
stub), a grid that is no tuple, options other than ``OPTIONS``, a kernel with pre-run hooks,
launch enter/exit hooks installed (``knobs.runtime.launch_enter_hook``: the profiler's; Triton
builds their metadata), an argument whose key cannot be built (a kind the generated code does not
expect), or an async compile. The globals a kernel read are checked on every
direct launch, as Triton checks them.
"""

from __future__ import annotations

import inspect
import os
import threading
from collections.abc import Callable

import torch
from triton import knobs
from triton.knobs import HookChain
from triton.runtime.driver import driver as _driver_config
from triton.runtime.jit import JITFunction

ENABLED = os.environ.get("TREEOPS_DIRECT_LAUNCH") != "0"
"""Read at import: on by default; ``TREEOPS_DIRECT_LAUNCH=0`` sends every launch through
``JITFunction.run``. The GPU test suite passes either way."""

_TRITON_RUN = JITFunction.run
"""Triton's own ``run``: when the class's is another (patched), every launch goes through it."""

_CUDA_CURRENT_DEVICE = torch.cuda.current_device
_CUDA_GET_DEVICE = getattr(torch._C, "_cuda_getDevice", None)
if _CUDA_GET_DEVICE is None:  # a build without CUDA: the driver's own call, always
    _CUDA_CURRENT_DEVICE = object()
"""Triton's CUDA driver asks ``torch.cuda.current_device()`` (lazy CUDA init, then
``torch._C._cuda_getDevice()``); once a launch went through Triton CUDA is initialised, so the
direct launch calls ``_cuda_getDevice`` itself (a Python frame or two less)."""

MAX_ENTRIES = 256
"""Keys kept per kernel; the cache is emptied when full (an engine's shapes fit many times)."""


class _State(threading.local):
    """``rec``: while a call is recorded (``recording``), the list each direct launch appends its
    (entry, grid, args) to; ``missed``: a launch of the recorded call went through Triton. Per
    thread: a call recorded in one thread must not take another thread's launches."""

    rec: list | None = None
    missed = False


STATE = _State()
_MISSING = object()
OPTIONS = ("num_warps", "num_stages", "launch_pdl")
"""The launch options a direct launch handles (``launch_pdl``: kernels/_pdl.py); other keywords
go through ``JITFunction.run``."""

KINDS = {torch.Tensor: "T", int: "i", float: "f", bool: "b", type(None): "N"}


def kind_of(value: object, constexpr: bool, dns: bool) -> str | None:
    """A parameter's kind for the generated key code: "c" constexpr, "T" tensor, "i" int ("n" not
    specialised), "f" float, "b" bool, "N" None; None for anything else (no direct launch)."""
    if constexpr:
        return "c"
    k = KINDS.get(value.__class__)
    if k is None and isinstance(value, torch.Tensor):
        k = "T"
    if k == "i" and dns:
        k = "n"
    return k


def _key_expr(name: str, kind: str) -> str:
    """The key entries of one argument (see the module docstring)."""
    if kind == "T":
        return f"{name}.dtype, not {name}.data_ptr() & 15"
    if kind == "c":
        return f"{name}.__class__, {name}"
    # "i", "n": exact ints (the launch code checks every one's class at once, _t_ints_only)
    if kind == "i":
        return name
    if kind == "n":
        return f"-0x80000000 <= {name} <= 0x7fffffff or {name}"
    if kind in ("f", "b"):
        return f"{name}.__class__"
    if kind == "N":
        return f"{name} is None"
    raise ValueError(kind)


def _check_globals(fn: JITFunction) -> None:
    """``JITFunction.run``'s check that the globals a kernel read have not changed since it was
    compiled (the same loop, the same error)."""
    not_present = object()
    for (name, _), (val, globals_dict) in fn.used_global_vals.items():
        if (new_val := globals_dict.get(name, not_present)) != val:
            raise RuntimeError(
                f"Global variable {name} has changed since we compiled this kernel, from {val} "
                f"to {new_val}"
            )


class Launcher:
    """Direct launches of one ``@triton.jit`` kernel: ``launch(grid, *args, **kwargs)`` is
    ``kernel[grid](*args, **kwargs)`` (see the module docstring).

    ``cache``: key -> ``_entry(compiled)`` (the launcher to call and what it takes);
    ``kinds``: the argument kinds the generated key code expects (set by the first launch);
    ``misses``: launches that went through ``JITFunction.run``."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.cache: dict[tuple, tuple] = {}
        self.kinds: tuple[str, ...] | None = None
        self.misses = 0
        self.source = ""
        if ENABLED and isinstance(fn, JITFunction):
            self.params = [p.name for p in fn.params]
            self._sig = inspect.signature(fn.fn)
            # launch options that are also parameters (a Gluon kernel's ``num_warps``): passed
            # as parameters, and by name to ``JITFunction.run``, which reads them as both
            self.options = tuple(o for o in OPTIONS if o not in self.params)
            self.launch: Callable = self._first
        else:  # the interpreter's InterpretedFunction: Triton's path always
            self.launch = self._triton

    def __repr__(self) -> str:
        name = getattr(self.fn, "__name__", repr(self.fn))
        return f"Launcher({name}, {len(self.cache)} keys, {self.misses} misses)"

    def _triton(self, grid, *args, **kwargs):
        self.misses += 1
        STATE.missed = True
        return self.fn[grid](*args, **kwargs)

    def clear(self) -> None:
        """Forget the cached kernels (they are Triton's: its own cache keeps them)."""
        self.cache.clear()

    def _first(self, grid, *args, **kwargs):
        """The first launch: learn the argument kinds, generate the launch code, launch with it."""
        fn = self.fn
        opts = {k: kwargs.pop(k) for k in list(kwargs) if k not in self._sig.parameters}
        try:
            bound = self._sig.bind(*args, **kwargs)
        except TypeError:
            self.launch = self._triton
            return self._triton(grid, *args, **kwargs, **opts)
        bound.apply_defaults()
        kinds = []
        for p, value in zip(fn.params, bound.arguments.values(), strict=True):
            kinds.append(kind_of(value, p.is_constexpr, p.do_not_specialize))
        if None in kinds or any(name.startswith("_t_") for name in self.params):
            self.launch = self._triton
        else:
            self.kinds = tuple(kinds)  # type: ignore[arg-type]
            self.launch = self._generate()
        return self.launch(grid, *args, **kwargs, **opts)

    def _generate(self) -> Callable:
        fn, names, kinds = self.fn, self.params, self.kinds
        assert kinds is not None
        sig_parts = []
        ns: dict[str, object] = {}
        for name, p in zip(names, self._sig.parameters.values(), strict=True):
            if p.default is inspect.Parameter.empty:
                sig_parts.append(name)
            else:
                ns[f"_t_default_{name}"] = p.default
                sig_parts.append(f"{name}=_t_default_{name}")
        sig = ", ".join(["_t_grid", *sig_parts, *(f"{o}=_t_missing" for o in self.options)])
        args = ", ".join(names)
        opts_key = ", ".join(f"{o}.__class__, {o}" for o in self.options)
        key = ", ".join(_key_expr(n, k) for n, k in zip(names, kinds, strict=True))
        ints = [n for n, k in zip(names, kinds, strict=True) if k in ("i", "n")]
        ints_ok = f"_t_ints_only(map(type, ({', '.join(ints)},)))" if ints else "True"
        self.source = f"""
def launch({sig}, **_t_other):
    _t_drv = _t_dc._active or _t_dc.active
    _t_enter = _t_rt.launch_enter_hook
    _t_exit = _t_rt.launch_exit_hook
    if (_t_JF.run is _t_triton_run and not _t_other and _t_grid.__class__ is tuple
            and _t_enter.__class__ is _t_HC and not _t_enter.calls
            and _t_exit.__class__ is _t_HC and not _t_exit.calls and not _t_fn.pre_run_hooks):
        _t_devfn = _t_drv.get_current_device
        _t_dev = _t_cuda_get_device() if _t_devfn is _t_cuda_current_device else _t_devfn()
        try:
            if {ints_ok}:
                _t_key = (_t_dev, _t_drv, _t_rt.debug, _t_comp.instrumentation_mode, {opts_key},
                          {key})
                _t_entry = _t_cache.get(_t_key)
            else:
                _t_key = _t_entry = None
        except Exception:
            _t_key = _t_entry = None
        if _t_entry is not None:
            if _t_fn.used_global_vals:
                _t_check_globals(_t_fn)
            _t_n = len(_t_grid)
            if _t_entry[4]:  # the C launcher itself (no scratch to allocate)
                _t_entry[0](_t_grid[0], _t_grid[1] if _t_n > 1 else 1,
                            _t_grid[2] if _t_n > 2 else 1, _t_drv.get_current_stream(_t_dev),
                            _t_entry[1], _t_entry[5], _t_entry[6], None, None, _t_entry[2], None,
                            None, None, {args})
            else:
                _t_entry[0](_t_grid[0], _t_grid[1] if _t_n > 1 else 1,
                            _t_grid[2] if _t_n > 2 else 1, _t_drv.get_current_stream(_t_dev),
                            _t_entry[1], _t_entry[2], None, None, None, {args})
            if _t_state.rec is not None:
                _t_state.rec.append((_t_entry, _t_grid, ({args},)))
            return _t_entry[3]
    else:
        _t_key = None
    return _t_slow(_t_key, _t_grid, ({args},), ({", ".join(self.options)},), _t_other)
"""
        ns.update(
            _t_dc=_driver_config,
            _t_rt=knobs.runtime,
            _t_comp=knobs.compilation,
            _t_JF=JITFunction,
            _t_triton_run=_TRITON_RUN,
            _t_HC=HookChain,
            _t_fn=fn,
            _t_cache=self.cache,
            _t_check_globals=_check_globals,
            _t_slow=self._slow,
            _t_state=STATE,
            _t_missing=_MISSING,
            _t_cuda_current_device=_CUDA_CURRENT_DEVICE,
            _t_cuda_get_device=_CUDA_GET_DEVICE,
            _t_ints_only=frozenset({int}).issuperset,
        )
        exec(compile(self.source, f"<treeops launch {fn.__name__}>", "exec"), ns)
        return ns["launch"]  # type: ignore[return-value]

    def _slow(self, key, grid, args: tuple, options: tuple, other: dict):
        """Launch through ``JITFunction.run``; remember the compiled kernel under ``key`` if the
        arguments have the kinds the key code was generated for."""
        self.misses += 1
        kwargs = {o: v for o, v in zip(self.options, options, strict=True) if v is not _MISSING}
        kwargs.update(other)
        if len(self.options) < len(OPTIONS):  # an option among the parameters: all by name
            kwargs.update(zip(self.params, args, strict=True))
            kernel = self.fn.run(grid=grid, warmup=False, **kwargs)
        else:
            kernel = self.fn.run(*args, grid=grid, warmup=False, **kwargs)
        if STATE.rec is not None:  # a recorded call: this launch too, if it can be replayed
            if grid.__class__ is tuple and not other and hasattr(kernel, "function"):
                STATE.rec.append((_entry(kernel), grid, args))
            else:
                STATE.missed = True
        if key is not None and kernel is not None and not hasattr(kernel, "result"):
            fn = self.fn
            kinds = tuple(
                kind_of(a, p.is_constexpr, p.do_not_specialize)
                for a, p in zip(args, fn.params, strict=True)
            )
            if kinds == self.kinds:
                if len(self.cache) >= MAX_ENTRIES:
                    self.cache.clear()
                try:
                    self.cache[key] = _entry(kernel)
                except TypeError:  # an unhashable constexpr: no direct launch for it
                    pass
        return kernel


try:
    from triton.backends.nvidia.driver import CudaLauncher as _CudaLauncher
except Exception:  # noqa: BLE001 - no CUDA backend in this Triton: its launcher's __call__
    _CudaLauncher = None


def _entry(kernel) -> tuple:
    """A cache entry: (callable, function, packed_metadata, kernel, is_c, cooperative, pdl).

    ``kernel.run`` is Triton's ``CudaLauncher``, whose ``__call__`` allocates the kernel's global
    and profile scratch (none for a kernel that asks for none: every treeops kernel) and calls
    the C launcher with the launch's cooperative and PDL flags. Where there is no scratch to
    allocate the entry holds the C launcher and those flags (``is_c``) and the launch calls it
    with the arguments ``__call__`` would pass, a Python frame and two calls fewer; otherwise
    ``kernel.run`` itself."""
    run = kernel.run
    c_launch = getattr(run, "launch", None)
    if (
        _CudaLauncher is not None
        and run.__class__ is _CudaLauncher
        and callable(c_launch)
        and getattr(run, "global_scratch_size", 1) == 0
        and getattr(run, "profile_scratch_size", 1) == 0
    ):
        coop, pdl = run.launch_cooperative_grid, run.launch_pdl
        return (c_launch, kernel.function, kernel.packed_metadata, kernel, True, coop, pdl)
    return (run, kernel.function, kernel.packed_metadata, kernel, False, None, None)


LAUNCHERS: list[Launcher] = []
"""Every launcher ``direct`` made (``clear_all`` empties their caches)."""


def direct(fn) -> Launcher:
    """The ``Launcher`` of ``fn`` (made on first use, kept on the kernel object): launch sites
    write ``direct(_kernel).launch(grid, ...)`` and so look the kernel up when they run, as
    ``_kernel[grid](...)`` did (a test may replace a module's kernel)."""
    try:
        return fn._treeops_launcher
    except AttributeError:
        pass
    lau = Launcher(fn)
    try:
        fn._treeops_launcher = lau
    except AttributeError:  # an object that takes no attributes: a new launcher per call
        return lau
    LAUNCHERS.append(lau)
    return lau


def launch_state() -> tuple:
    """What a direct launch's validity depends on beyond its arguments: whether Triton's run is
    its own and its launch hooks are idle (else every launch goes through ``JITFunction.run``),
    and the options Triton adds to a kernel's key (``knobs.runtime.debug``,
    ``knobs.compilation.instrumentation_mode``). A recorded launch replays only while this is
    what it was when recorded."""
    enter, exit_ = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    idle = (
        JITFunction.run is _TRITON_RUN
        and enter.__class__ is HookChain
        and not enter.calls
        and exit_.__class__ is HookChain
        and not exit_.calls
    )
    return (idle, knobs.runtime.debug, knobs.compilation.instrumentation_mode)


class recording:
    """``with recording() as launches:`` the direct launches made inside, as (entry, grid, args)
    (``treeops.prepare`` and the ops' own replays, ``_replay``, replay them);
    ``launches.missed`` after the block: some launch went through Triton instead (a first
    launch, a fallback: not replayable). Scratch buffers made inside are fresh (``scratch``):
    they belong to the recorded call; ``launches.scratch`` lists them, as (key, device, make,
    buffers) per ``scratch`` call, so that a replay can ask ``scratch`` again."""

    def __enter__(self) -> list:
        if STATE.rec is not None:
            raise RuntimeError("a call is being recorded already")
        self.launches = _Recorded()
        self.launches.scratch = []
        STATE.rec, STATE.missed = self.launches, False
        return self.launches

    def __exit__(self, *exc) -> None:
        self.launches.missed = STATE.missed
        STATE.rec, STATE.missed = None, False


class _Recorded(list):
    missed = False
    scratch: list


def clear_all() -> None:
    """Forget every launcher's cached kernels (after a test swapped Triton's driver, say)."""
    for lau in LAUNCHERS:
        lau.clear()


# ---------------------------------------------------------------------------- kept buffers
_KEPT: dict[int, torch.Tensor] = {}  # storage address -> the buffer


def kept(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t`` a buffer a launcher keeps across calls (a cached table, the arrival counters,
    a per-device workspace): a replay of a recorded launch (``_replay``) passes it, or a view of
    it, as it was, where every other buffer the op made is fresh memory. Such buffers are never
    freed (graphs captured with them keep using them), so they are held here, and their
    addresses stay theirs. Returns ``t``."""
    if t.untyped_storage().data_ptr():  # (an empty buffer has no address to keep)
        _KEPT[t.untyped_storage().data_ptr()] = t
    return t


def is_kept(t: torch.Tensor) -> bool:
    """Whether ``t`` is a ``kept`` buffer or a view of one."""
    return t.untyped_storage().data_ptr() in _KEPT


# ------------------------------------------------------------------------------ scratch buffers
_SCRATCH: dict[tuple, tuple[torch.Tensor, ...]] = {}
MAX_SCRATCH = 64
"""Scratch sets kept (all launchers together); the cache is emptied when full."""

_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)
_current_stream = getattr(torch._C, "_cuda_getCurrentStream", None)


def scratch(key: tuple, device: torch.device, make: Callable[[], tuple]) -> tuple:
    """A launch's scratch buffers: ``make()`` (fresh ``torch.empty``s), kept per ``key`` (the
    launcher's sizes and dtypes), device and current stream for the next call.

    Only for buffers that each launch writes before it reads them (no state between launches),
    so two launches may share them exactly when they run one after the other, which is when the
    caching allocator would have handed them the same block: same device, same stream (kernels
    on one stream run in order). Inside a CUDA-graph capture the buffers are always fresh, from
    the graph's pool and the graph's own: a cached set could be used by an eager call on
    another stream while the graph replays."""
    if STATE.rec is not None:  # a recorded call keeps its own buffers
        bufs = make()
        STATE.rec.scratch.append((key, device, make, bufs))
        return bufs
    if device.type == "cuda":
        if _capturing is not None and _capturing():
            return make()
        full = (key, _current_stream(device.index))  # (stream id, device index, type)
    else:  # CPU (the interpreter, the host benchmark): launches are synchronous
        full = (key, device)
    bufs = _SCRATCH.get(full)
    if bufs is None:
        if len(_SCRATCH) >= MAX_SCRATCH:
            _SCRATCH.clear()
        bufs = _SCRATCH[full] = make()
    return bufs

"""Programmatic dependent launch (PDL, sm_90 and later) for chains of treeops kernels.

A kernel launched with ``launch_pdl=True`` may be scheduled while the kernel before it on the
stream is still running, once every program of that kernel has run ``griddepcontrol
.launch_dependents`` (or exited): its launch and the placement of its programs overlap the tail of
the one before, instead of following it. A dependent launch in a CUDA graph costs about 0.5 µs
on the H200 (an empty kernel chained: 0.65 µs), and a draft layer is two launches in sequence.

The contract, kept by ``pdl_enter`` as a kernel's first statement: a kernel launched with PDL
waits (``griddepcontrol.wait``: every earlier kernel on the stream complete, its writes visible)
before it reads or writes any global memory, so nothing it does can race with the kernel before
it, wherever that kernel let it launch. The kernel after it launches once this one's programs
have all run ``pdl_release`` (``PDL_LATE``: placed after a kernel's main work, so dependents
wait in SM slots only through its tail; a kernel without it releases at exit) or at once
(``PDL_EARLY``: ``pdl_enter`` releases it); a kernel launched without PDL starts after this one
completes, as usual. ``launch_pdl`` must be off where the kernel's ``PDL`` constexpr is
``PDL_OFF`` (``use_pdl``); it may be off where it is not (an op's first launch:
``first_launch_pdl``), the kernel then starting after the one before completes and its wait a
no-op, and still releasing the next launch.

``TREEOPS_PDL`` (read at import) sets every launch: ``0`` off, ``1`` late release, ``early``.
Unset, the build's launches release late; sampling acceptance's pass 2 and walk (where a
launch's programs fit beside the one before, ``kernels/accept.py``) follow its pass 1 with PDL,
pass 1 starting as usual (``first_launch_pdl``); tree attention, the table update and every
one-launch op launch plainly. Timed on the H200 (docs/design.md): late release made the whole
B = 64 EAGLE step 1.3 % faster and the B = 1 one 2 %; early release made the B = 64 step 4.5 %
slower. On an H100 (session 48, docs/benchmarks.md): every launch with PDL made chains of one op
0.2-0.5 µs a call faster, but whole decoding steps, where most kernels before a treeops launch
are the model's, up to 0.8 % slower; attention's merge alone with PDL, no faster.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from treeops._runtime import interpreted

# a kernel's ``PDL`` constexpr (constexpr globals, as the kernels compare against them): launched
# plainly; with PDL, the next kernel released at ``pdl_release``; or at ``pdl_enter``
PDL_OFF = tl.constexpr(0)
PDL_LATE = tl.constexpr(1)
PDL_EARLY = tl.constexpr(2)

_MODES = {"0": 0, "1": 1, "early": 2}
_VALUE = os.environ.get("TREEOPS_PDL")
if _VALUE is not None and _VALUE not in _MODES:
    raise ValueError(f"TREEOPS_PDL must be 0, 1 or early, got {_VALUE!r}")
MODE = None if _VALUE is None else _MODES[_VALUE]
"""What every launch that supports PDL uses (``TREEOPS_PDL``); None: each op's default."""


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(device: torch.device, default: int = 0) -> int:
    """The ``PDL`` constexpr of a launch on ``device``: ``MODE``, or the op's ``default`` where
    ``TREEOPS_PDL`` is unset, where it is compiled (the interpreter runs programs one after
    another, with no inline assembly) for a GPU of compute capability 9.0 or later, else
    ``PDL_OFF``. Launch with ``launch_pdl=pdl > 0`` (an op's first launch:
    ``first_launch_pdl(pdl)``)."""
    mode = default if MODE is None else MODE
    if mode == 0 or device.type != "cuda" or interpreted():
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    return mode if _capable(index) else 0


def first_launch_pdl(pdl: int) -> bool:
    """``launch_pdl`` of an op's first launch compiled with ``pdl``: only where ``TREEOPS_PDL``
    asks it of every launch. By default an op's first launch starts after whatever ran before it,
    as usual (its ``PDL`` constexpr still releases the op's next launch): a launch placed early
    gains only where the kernel before releases it early, and behind a kernel that does not
    (a GEMM, a torch kernel) its programmatic edge made whole decoding steps slower (H100,
    session 48: chain B 1 1,414.7 -> 1,425.9 us with every launch taking PDL)."""
    return pdl > 0 and MODE is not None


def pdl_options(device: torch.device, default: int = PDL_OFF.value) -> dict:
    """A one-launch op's ``PDL`` constexpr and ``launch_pdl`` option (``use_pdl``; off unless
    ``TREEOPS_PDL`` turns every launch on, which chains of treeops ops gain from:
    docs/benchmarks.md): ``launch(grid, ..., **pdl_options(device))``."""
    pdl = use_pdl(device, default)
    return {"PDL": pdl, "launch_pdl": first_launch_pdl(pdl)}


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """A kernel's first statement (nothing when ``PDL`` is ``PDL_OFF``): wait for the kernel
    before to complete, after letting the next one launch where ``PDL`` is ``PDL_EARLY``."""
    if PDL == PDL_EARLY:
        gdc_launch_dependents()
    if PDL != PDL_OFF:
        gdc_wait()


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """Let the next kernel launch (where ``PDL`` is ``PDL_LATE``): called by every program, outside
    any branch, once the kernel's main work is issued; the next kernel still waits for this one to
    complete before it touches memory (``pdl_enter``)."""
    if PDL == PDL_LATE:
        gdc_launch_dependents()

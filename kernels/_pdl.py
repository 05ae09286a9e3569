"""Programmatic dependent launch (PDL, sm_90 and later) for chains of treeops kernels.

A kernel launched with ``launch_pdl=True`` may be scheduled while the kernel before it on the
stream is still running, once every program of that kernel has run ``griddepcontrol
.launch_dependents`` (or exited): its launch and the placement of its programs overlap the tail of
the one before, instead of following it. A dependent launch in a CUDA graph costs about 0.5 µs
on the H200 (an empty kernel chained: 0.65 µs), and a draft layer is two launches in sequence.

The contract, kept by ``pdl_enter`` as a kernel's first statement: a kernel launched with PDL
waits (``griddepcontrol.wait``: every earlier kernel on the stream complete, its writes visible)
before it reads or writes any global memory, so nothing it does can race with the kernel before
it; and it lets the kernel after it launch at once (that kernel waits the same way, or, launched
without PDL, starts after this one completes as usual). ``launch_pdl`` and the kernel's ``PDL``
constexpr must therefore be the same value (``use_pdl``).

Off unless ``TREEOPS_PDL=1`` (read at import): on the H200 it made the B = 64 draft step slower
(315.5 -> 377.2 us) and the B = 1 one too (140.1 -> 144.9); docs/design.md has the figures.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from treeops._runtime import interpreted

ENABLED = os.environ.get("TREEOPS_PDL") == "1"
"""Whether launches that support it use PDL (``TREEOPS_PDL=1``; off by default)."""


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def use_pdl(device: torch.device) -> bool:
    """Whether a launch on ``device`` takes PDL: enabled, compiled (the interpreter runs programs
    one after another, with no inline assembly), and a GPU of compute capability 9.0 or later."""
    if not ENABLED or device.type != "cuda" or interpreted():
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """A PDL-launched kernel's first statement (nothing when ``PDL`` is off): let the next kernel
    launch, then wait for the one before to complete (see the module docstring)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()

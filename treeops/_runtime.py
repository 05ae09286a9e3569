"""Runtime facts the kernels' launchers share: interpreter mode, SM count, shared memory, capture
state.

Nothing here touches ``triton.runtime.driver.active`` or CUDA at import time: on a machine with no
GPU both raise, and the interpreter tests import every launcher.
"""

from __future__ import annotations

import functools
import os

import torch

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def interpreted() -> bool:
    """Whether Triton kernels run in the CPU interpreter (``TRITON_INTERPRET=1``).

    Triton fixes this when a kernel is decorated, so it must be set before treeops is imported;
    it is read once, at that import (launchers ask on every call, to pick CPU-sized tiles and
    fp32 dot operands)."""
    return _INTERPRETED


def pow2(n: int) -> int:
    """The smallest power of two >= max(n, 1)."""
    n = max(int(n), 1)
    return 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for positive b."""
    return -(-a // b)


@functools.cache
def _cuda_properties(index: int):
    return torch.cuda.get_device_properties(index)


def _properties(device: torch.device):
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_properties(index)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``, asked lazily and cached per GPU; a pretend 4 off the
    GPU, so that interpreter tests exercise the multi-program (split) paths of the launchers."""
    if device.type == "cuda":
        return _properties(device).multi_processor_count
    return 4


def shared_memory(device: torch.device) -> int:
    """Opt-in shared memory per block of ``device`` in bytes, asked lazily and cached per GPU;
    the H200's 227 KiB off the GPU (the interpreter ignores it)."""
    if device.type == "cuda":
        return _properties(device).shared_memory_per_block_optin
    return 232448


_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}


def current_stream(index: int) -> torch.cuda.Stream:
    """Device ``index``'s current stream as a ``torch.cuda.Stream``, kept per raw handle:
    ``torch.cuda.current_stream()`` builds a new Python object per call (4.3 us on the H200,
    most of an ``Event.record()``'s 5.4), the raw handle costs 0.1. A handle names one stream
    for as long as it exists, so the kept object records on the stream that is current."""
    raw = torch._C._cuda_getCurrentRawStream(index)
    s = _STREAMS.get((index, raw))
    if s is None:
        s = _STREAMS[(index, raw)] = torch.cuda.current_stream(index)
    return s


def refuse_in_capture(what: str) -> None:
    """Raise if a CUDA graph is being captured: ``what`` (a buffer a launcher caches for later
    calls) must be built by an eager call first. Built during a capture, its initialisation would
    only be recorded in that graph, and every other call (eager, or other graphs) would read it
    uninitialised until the graph first replays."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"treeops: {what} is built on the first call and cached; make one call outside "
            "CUDA-graph capture first (the warm-up call before capturing)"
        )

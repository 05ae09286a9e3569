"""Triton kernels (installed as ``treeops.kernels``): @triton.jit bodies and launchers only."""

import torch


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

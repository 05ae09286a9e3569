"""Arrival counters: int32 slots, zero between launches, for kernels whose last-arriving program
of a group finishes the group's work (an atomic increment per program; the program that sees
``count == group size - 1`` merges and resets its slot to 0).

One buffer per device, shared by every kernel that uses it: launches on one stream run one after
another, and each leaves its slots at zero. Cached so that a launch allocates nothing and needs no
memset; built by an eager call (a miss during CUDA-graph capture raises: its zeros would only be
written when that graph first replays); grown to the largest request seen, a replaced buffer kept
alive because graphs captured with it keep replaying atomics into it. Launches that run
concurrently on different streams must not share it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treeops._runtime import refuse_in_capture

from ._launch import kept

_COUNTERS: dict[torch.device, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """At least ``n`` int32 slots on ``device``, all zero between launches."""
    c = _COUNTERS.get(device)
    if c is None or c.numel() < n:
        refuse_in_capture("the arrival counters (per device, up to the largest launch)")
        if c is not None:
            _RETIRED.append(c)
        c = kept(torch.zeros(max(n, 64), dtype=torch.int32, device=device))
        _COUNTERS[device] = c
    return c


@triton.jit
def arrive(p_count, FENCE: tl.constexpr):
    """Count this program's arrival at ``p_count`` (an int32 slot); returns how many arrived
    before it. Every thread's earlier global stores are ordered before the count's release (with
    ``FENCE``, compiled runs: a gpu-scope fence per thread, then the block barrier), so the
    program that sees the last count reads every arrival's stores after its acquire."""
    if FENCE:
        tl.inline_asm_elementwise(
            "fence.acq_rel.gpu; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )
    tl.debug_barrier()
    return tl.atomic_add(p_count, 1, sem="acq_rel", scope="gpu")

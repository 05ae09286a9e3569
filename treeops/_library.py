"""The ``treeops`` torch.library namespace: every public op is a custom op ``torch.ops.treeops.*``.

Each op module defines its op here with a schema that declares what it mutates, a CPU backend (the
PyTorch reference), a CUDA backend (the Triton launcher) and a fake implementation that only
computes output shapes, so that ``torch.compile`` traces through the public functions and
``torch.library.opcheck`` can test them. Ops that write into output buffers take them as mutated
arguments and return nothing; the public functions allocate them when the caller passes none.

The low-level ``torch.library.Library`` API is used rather than the ``custom_op`` decorator: its
dispatch costs a few microseconds per call, the decorator's tens (measured on CPU, torch 2.13),
and eager calls are on an engine's host path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .tree import Tree

LIB = torch.library.Library("treeops", "DEF")

TREE = ", ".join(f"Tensor tree_{f}" for f in Tree.FIELDS)
"""The schema fragment of a ``Tree`` argument: its fields in ``Tree.FIELDS`` order."""

OUT_TREE = ", ".join(
    f"Tensor({a}!) out_{f}" for a, f in zip("stuvwxyz", Tree.FIELDS, strict=True)
)
"""The schema fragment of a ``Tree`` written in place (alias sets s..z)."""

CUDA_BACKENDS: dict[str, Callable] = {}
"""Each op's CUDA backend by op name (``bench/bench_host.py`` runs them on CPU tensors to time
the launchers' host code)."""


def define(
    schema: str,
    *,
    cpu: Callable,
    cuda: Callable,
    fake: Callable | None = None,
) -> torch._ops.OpOverload:
    """Define ``treeops::<schema>`` with its CPU and CUDA backends; ``fake`` (shapes only) defaults
    to doing nothing, right for ops that return nothing and only write their mutated arguments."""
    name = schema.split("(", 1)[0]
    LIB.define(schema)
    LIB.impl(name, cpu, "CPU")
    LIB.impl(name, cuda, "CUDA")
    CUDA_BACKENDS[name] = cuda
    torch.library.register_fake(f"treeops::{name}", fake or _no_output, lib=LIB)
    return getattr(torch.ops.treeops, name).default


def _no_output(*args, **kwargs) -> None:
    return None

"""Checks for engine code that is to be captured in CUDA graphs, runnable on a CPU.

``NoHostSync`` runs a region eagerly (on CPU tensors, say) and fails on every op that would,
on CUDA tensors, stall the host on the device or break a CUDA-graph capture: reading a value on
the host (``.item()``, ``int(t)``, ``bool(t)``, ``.tolist()``, ``.numpy()``), an op whose output
shape depends on values (``nonzero``, boolean-mask indexing, ``unique``, ``masked_select``,
``repeat_interleave`` without ``output_size``, ...) and host data copied in
(``torch.tensor(list)``). It sees every aten op through a ``TorchDispatchMode``; it cannot see a
``.cpu()`` of a tensor that is already on the CPU, nor device-side races. A 0-dim host value
(``x[i] = 5``, ``torch.tensor(3.0)``) passes: writing a Python scalar into a device tensor is a
fill, but ``torch.tensor(3.0, device="cuda")`` would be a blocking copy that this check, run on
CPU tensors, cannot tell apart.

Example:
    >>> import torch
    >>> from treeops.testing import NoHostSync
    >>> x = torch.arange(6)
    >>> with NoHostSync() as check:
    ...     y = torch.where(x > 2, x, 0).cumsum(0)  # fine: no value leaves the device
    >>> check.ops_checked > 0
    True
    >>> with NoHostSync():
    ...     n = int(x.max())
    Traceback (most recent call last):
    ...
    AssertionError: host sync in a region meant for capture: aten._local_scalar_dense.default
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["NoHostSync"]

F = TypeVar("F", bound=Callable[..., Any])

_aten = torch.ops.aten
_SYNC = {
    _aten._local_scalar_dense,  # .item(), int(t), bool(t), float(t)
    _aten.nonzero,
    _aten.masked_select,
    _aten._unique2,
    _aten.unique_consecutive,
    _aten.unique_dim,
    _aten.bincount,
    _aten.equal,
    _aten.allclose,
    _aten.is_nonzero,
}
_INDEX = {_aten.index, _aten.index_put_, _aten.index_put}


class NoHostSync(TorchDispatchMode):
    """A context manager: fails (``AssertionError``) on a host sync inside it, except inside
    calls wrapped by ``opaque`` (and, with ``only_regions=True``, outside calls wrapped by
    ``region``).

    ``check = NoHostSync(only_regions=True)`` checks only inside ``check.region(fn)`` calls (the
    bodies an engine captures), so that the host code between them may read values.
    ``check.opaque(fn)`` suspends the check inside ``fn`` (a call that runs differently on the
    GPU, e.g. a reference standing in for a kernel). ``ops_checked`` counts the ops it saw
    while checking (a test can assert that its region ran under the check)."""

    def __init__(self, only_regions: bool = False) -> None:
        super().__init__()
        self._suspended = 0
        self._in_region = 0
        self._only_regions = only_regions
        self.ops_checked = 0
        self._patched: list[tuple[str, Any]] = []

    @property
    def checking(self) -> bool:
        return self._suspended == 0 and (self._in_region > 0 or not self._only_regions)

    def _fail(self, what: object) -> None:
        raise AssertionError(f"host sync in a region meant for capture: {what}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.checking:
            self.ops_checked += 1
            packet = func.overloadpacket
            if packet in _SYNC:
                self._fail(func)
            if packet in _INDEX and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] or ()
            ):
                self._fail(f"{func} with a boolean mask")
            if packet is _aten.repeat_interleave and kwargs.get("output_size") is None:
                self._fail(f"{func} without output_size")
            if packet is _aten.lift_fresh and args[0].dim() > 0:
                self._fail(f"{func} (torch.tensor of host data)")
        return func(*args, **kwargs)

    def __enter__(self) -> NoHostSync:
        # host reads that dispatch no aten op
        for name in ("tolist", "numpy"):
            orig = getattr(torch.Tensor, name)

            def guard(t, *a, _orig=orig, _name=name, **k):
                if self.checking:
                    self._fail(f"Tensor.{_name}")
                return _orig(t, *a, **k)

            self._patched.append((name, orig))
            setattr(torch.Tensor, name, guard)
        super().__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            super().__exit__(*exc)
        finally:
            for name, orig in reversed(self._patched):
                setattr(torch.Tensor, name, orig)
            self._patched.clear()

    def opaque(self, fn: F) -> F:
        """``fn`` with the check suspended while it runs."""

        def call(*a, **k):
            self._suspended += 1
            try:
                return fn(*a, **k)
            finally:
                self._suspended -= 1

        return call  # type: ignore[return-value]

    def region(self, fn: F) -> F:
        """``fn`` with the check on while it runs (see ``only_regions``)."""

        def call(*a, **k):
            self._in_region += 1
            try:
                return fn(*a, **k)
            finally:
                self._in_region -= 1

        return call  # type: ignore[return-value]

"""Input validation shared by every public op.

Each check raises ``ValueError`` naming the argument, what was expected and what came, e.g.
``Invalid dtype of parents: expected torch.int32, got torch.int64``. Nothing here syncs with the
device unless a caller asks for ``validate=True`` checks (tree well-formedness, index ranges).

Strides are checked always (``check_stride``, O(1) metadata, no host sync), because a kernel that
indexes a tensor as if it were dense reads the wrong elements of a strided view, or past the
allocation (a stride-0 ``expand``), or writes there. The rule, per argument:

* ``unit_last``: the last dimension has unit stride (or size <= 1), e.g. ``block_table``,
  ``accepted``, ``topk_ids``, and every 1-D per-request vector (``seq_lens``, ``num_tokens``,
  ``q_start``, ``accept_len``, ``temperature``, ...), which kernels read as ``ptr + b``;
  the other dimensions' strides are passed to the kernel.
* ``contiguous``: dense row-major (``is_contiguous()`` with a unit last stride), for what a
  kernel reads with a flat index: the ``Tree``/``Retrieved``/``DraftState`` fields, workspaces.
* neither: the kernel receives every stride (q, K/V caches, logits' batch/node dims, ...).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext

import torch

Dim = int | str | None


def _fmt_shape(shape: Sequence[Dim]) -> str:
    return "[" + ", ".join("*" if d is None else str(d) for d in shape) + "]"


def check_tensor(
    name: str,
    t: object,
    *,
    shape: Sequence[Dim] | None = None,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
    sizes: dict[str, int] | None = None,
    unit_last: bool = False,
    contiguous: bool = False,
) -> torch.Tensor:
    """Check that ``t`` is a tensor of the given shape, dtype, strides and device; return it.

    ``shape`` entries are ints (exact), ``None`` (any) or names such as ``"B"``: a name seen for
    the first time binds its size in ``sizes`` (a dict shared across calls), later uses must agree.
    ``unit_last`` / ``contiguous``: see ``check_stride``. Nothing is bound in ``sizes`` unless the
    whole shape matches.
    """
    # the passing path compares metadata only; messages are built only to raise
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"Invalid type of {name}: expected torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        got = t.dtype
        if not (got is dtype if isinstance(dtype, torch.dtype) else got in dtype):
            allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
            exp = (
                allowed[0] if len(allowed) == 1 else "one of (" + ", ".join(map(str, allowed)) + ")"
            )
            raise ValueError(f"Invalid dtype of {name}: expected {exp}, got {got}")
    if shape is not None:
        got_shape = t.shape
        if len(got_shape) != len(shape):
            _shape_error(name, got_shape, shape, sizes)
        new: dict[str, int] | None = None
        for d, n in zip(shape, got_shape):
            if d is None:
                continue
            if isinstance(d, str):
                if sizes is None:
                    continue
                want = sizes.get(d)
                if want is None:
                    want = None if new is None else new.get(d)
                    if want is None:
                        if new is None:
                            new = {}
                        new[d] = n
                        continue
                if n != want:
                    _shape_error(name, got_shape, shape, sizes)
            elif n != d:
                _shape_error(name, got_shape, shape, sizes)
        if new is not None:
            sizes.update(new)  # type: ignore[union-attr]
    if unit_last or contiguous:
        check_stride(name, t, contiguous=contiguous)
    if device is not None and t.device != device:
        raise ValueError(f"Invalid device of {name}: expected {device}, got {t.device}")
    return t


def _shape_error(
    name: str, got: torch.Size, shape: Sequence[Dim], sizes: dict[str, int] | None
) -> None:
    """Raise the shape error: the expected shape with the names ``sizes`` binds (before this
    check, or earlier in this shape) written as their sizes."""
    bound = dict(sizes) if sizes is not None else None
    expected: list[Dim] = []
    ok = len(got) == len(shape)
    for i, d in enumerate(shape):
        if isinstance(d, str) and bound is not None and d in bound:
            expected.append(bound[d])
            ok = ok and i < len(got) and got[i] == bound[d]
        else:
            expected.append(d)
            if isinstance(d, str):
                if bound is not None and ok and i < len(got):
                    bound[d] = int(got[i])
            else:
                ok = ok and (d is None or (i < len(got) and got[i] == d))
    raise ValueError(f"Invalid shape of {name}: expected {_fmt_shape(expected)}, got {list(got)}")


class Signature:
    """A call's signature as ``signature`` returns it: one object per distinct metadata tuple
    (``key``), so that a ``Memo`` looks it up by identity."""

    __slots__ = ("key",)

    def __init__(self, key: tuple) -> None:
        self.key = key

    def __repr__(self) -> str:
        return f"Signature({self.key!r})"


MAX_TENSORS = 64
_NONE_ARGS = tuple(
    torch.empty_strided((0,) * 7, (12345,) * 7, dtype=torch.complex128) for _ in range(MAX_TENSORS)
)
"""What stands for a None argument at each position in a guard check: a layout no op accepts
(7-D complex128), one object per position (the C++ check fails on a tensor passed twice)."""

_SIGNATURES: dict[tuple, Signature] = {}
"""Every metadata tuple seen -> its ``Signature`` (emptied when it holds MAX_SIGNATURES)."""

_SEEN: dict[tuple, list] = {}
"""(number of tensors, values with their classes) -> [(guards, Signature)]: the C++ tensor checks
of each signature seen with those values (``_tensor_guards``), most recently found first
(emptied when it holds MAX_SIGNATURES keys)."""

MAX_SIGNATURES = 4096
MAX_GUARDS = 32
"""Guards kept per (number of tensors, values): an engine's batch-size buckets fit."""


def _tensor_guards(tensors: list) -> object | None:
    """torch's C++ check of these tensors' Python type, dispatch keys, dtype, device,
    ``requires_grad``, sizes and strides (dynamo's ``TensorGuards``; ``check(*tensors)`` is one
    C call, about 0.1 µs a tensor against about 0.4 µs for the Python tuple); None where torch
    has none (``_GUARDS``: it passed ``_guards_work`` at import), a tensor is not exactly a
    ``torch.Tensor`` (a subclass may have symbolic sizes) or one is passed twice (the check
    refuses a tensor it sees twice, so it would never pass)."""
    if (
        _GUARDS is None
        or not all(t.__class__ is torch.Tensor for t in tensors)
        or len(set(map(id, tensors))) < len(tensors)  # a tensor passed twice never passes
    ):
        return None
    try:
        return _GUARDS(
            *tensors,
            dynamic_dims_sizes=[list(t.shape) for t in tensors],
            dynamic_dims_strides=[list(t.stride()) for t in tensors],
        )
    except Exception:  # noqa: BLE001 - no fast path for these: the Python tuple each call
        return None


def _guards_work() -> object | None:
    """``TensorGuards`` if it is importable and tells apart what the signature must (a check of
    equal metadata passes; another dtype, shape, stride, type, device or None argument fails)."""
    try:
        from torch._C._dynamo.guards import TensorGuards
    except Exception:  # noqa: BLE001 - an older or smaller torch: the Python tuple
        return None
    try:
        x = torch.zeros(2, 3)
        none = _NONE_ARGS[1]
        g = TensorGuards(x, none, dynamic_dims_sizes=[[2, 3], [0] * 7],
                         dynamic_dims_strides=[[3, 1], [12345] * 7])  # fmt: skip
        same = g.check(torch.ones(2, 3), none)
        others = (
            (x.double(), none), (x.t().contiguous().t(), none), (x[None], none),
            (torch.nn.Parameter(x), none), (x.to("meta"), none), (x, x), (x, torch.zeros(0)),
            (None, none),
        )  # fmt: skip
        if same is True and not any(g.check(*o) for o in others):
            return TensorGuards
    except Exception:  # noqa: BLE001
        pass
    return None


_GUARDS = _guards_work()
_compiling = torch.compiler.is_compiling


def signature(tensors: Sequence[object], values: Sequence[object] = ()) -> Signature | None:
    """What the O(1) checks of a call read: each tensor's (type, shape, strides, dtype, device),
    None for None, and each plain value with its type (``True`` and ``1`` differ); None when an
    argument is no tensor or under ``torch.compile`` (no memo then: the full checks run).

    Two calls with equal signatures pass or fail the same metadata checks (shapes, dtypes,
    strides, devices, types, value arguments), so a ``Memo`` keyed by it can skip them. Equal
    signatures are the same ``Signature`` object. A signature seen before is found by torch's
    C++ tensor checks (``_tensor_guards``) without building its tuple."""
    if _compiling():
        return None
    vals = tuple([(v.__class__, v) for v in values]) if values else ()
    if len(tensors) > MAX_TENSORS:
        return _tuple_signature(tensors, vals)
    args = [_NONE_ARGS[i] if t is None else t for i, t in enumerate(tensors)]
    try:
        seen = _SEEN.get((len(args), vals))
    except TypeError:  # an unhashable value: no memo
        return None
    if seen:
        for i, (guards, sig) in enumerate(seen):
            if guards.check(*args):
                if i:  # most recently found first: an engine's steady shapes stay in front
                    seen.insert(0, seen.pop(i))
                return sig
    sig = _tuple_signature(tensors, vals)
    if sig is not None:
        guards = _tensor_guards(args)
        if guards is not None:
            if len(_SEEN) >= MAX_SIGNATURES:  # a value argument that differs on every call
                _SEEN.clear()
            seen = _SEEN.setdefault((len(args), vals), [])
            if len(seen) >= MAX_GUARDS:
                seen.pop()
            seen.insert(0, (guards, sig))
    return sig


def _tuple_signature(tensors: Sequence[object], vals: tuple) -> Signature | None:
    """The ``Signature`` of this metadata tuple (built in Python: the path of a first call)."""
    try:
        key = tuple(
            [t if t is None else (t.__class__, t.shape, t.stride(), t.dtype, t.device)
             for t in tensors]
        ) + vals  # fmt: skip
    except Exception:  # noqa: BLE001 - not a tensor (or one without strides): check in full
        return None
    try:
        sig = _SIGNATURES.get(key)
    except TypeError:  # an unhashable value: no memo
        return None
    if sig is None:
        if len(_SIGNATURES) >= MAX_SIGNATURES:
            _SIGNATURES.clear()
        sig = _SIGNATURES[key] = Signature(key)
    return sig


class Memo:
    """Signatures (``signature``) whose checks passed, each with what the checks derived (sizes,
    a launch plan): a later call with an equal signature skips the checks. Bounded: the oldest
    entry goes when ``maxsize`` are held (an engine's batch-size buckets fit). Only passing
    signatures are stored, so every error is raised by the full checks, with their messages. A
    key holds its value arguments (a policy object, say), so those stay alive while it is kept."""

    __slots__ = ("_d", "_maxsize")

    def __init__(self, maxsize: int = 256) -> None:
        self._d: dict = {}
        self._maxsize = maxsize

    def get(self, key: tuple | None):
        if key is None:
            return None
        try:
            return self._d.get(key)
        except TypeError:  # an unhashable value argument
            return None

    def put(self, key: tuple | None, value) -> None:
        if key is None:
            return
        d = self._d
        try:
            if key not in d and len(d) >= self._maxsize:
                del d[next(iter(d))]
            d[key] = value
        except (TypeError, StopIteration, KeyError, RuntimeError):
            pass  # unhashable, or another thread changed the dict: stay unmemoised

    def clear(self) -> None:
        self._d.clear()

    def __len__(self) -> int:
        return len(self._d)


def check_stride(name: str, t: torch.Tensor, *, contiguous: bool = False) -> torch.Tensor:
    """The layout a kernel can index (O(1), no host sync; always checked, not only under
    ``validate=True``: a wrong stride is a memory-safety issue).

    Default: the last dimension has unit stride, or size <= 1 (a 1-D vector: unit stride, or at
    most one element; a stride-0 ``expand`` of several elements is rejected). ``contiguous``:
    ``t.is_contiguous()`` and a unit last stride, even where the last size is <= 1 (so that
    ``stride(-1) == 1`` holds for every field a kernel indexes densely).
    """
    if t.dim() == 0:
        return t
    if contiguous:
        if not (t.is_contiguous() and t.stride(-1) == 1):
            raise ValueError(
                f"Invalid stride of {name}: expected a contiguous tensor, got strides "
                f"{tuple(t.stride())} for shape {list(t.shape)}"
            )
        return t
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        what = "a contiguous tensor" if t.dim() == 1 else "the last dimension contiguous"
        raise ValueError(
            f"Invalid stride of {name}: expected unit stride along dim {t.dim() - 1} ({what}), "
            f"got strides {tuple(t.stride())}"
        )
    return t


def check_same_device(**tensors: torch.Tensor | None) -> torch.device:
    """All given tensors on one device; return it."""
    dev: torch.device | None = None
    first = ""
    for name, t in tensors.items():
        if t is None:
            continue
        if dev is None:
            dev, first = t.device, name
        elif t.device != dev:
            raise ValueError(
                f"Invalid device of {name}: expected {dev} (the device of {first}), got {t.device}"
            )
    if dev is None:
        raise ValueError("no tensor given")
    return dev


def check_range(name: str, t: torch.Tensor, lo: int | None = None, hi: int | None = None) -> None:
    """Values of ``t`` in ``[lo, hi)`` (host sync: call only under ``validate=True``)."""
    if t.numel() == 0:
        return
    if lo is not None and int(t.min()) < lo:
        raise ValueError(f"Invalid value in {name}: expected >= {lo}, got {int(t.min())}")
    if hi is not None and int(t.max()) >= hi:
        raise ValueError(f"Invalid value in {name}: expected < {hi}, got {int(t.max())}")


def check_finite(name: str, t: torch.Tensor, *, nonnegative: bool = False) -> None:
    """No NaN/inf (and optionally no negative) values (host sync: ``validate=True`` only)."""
    if t.numel() == 0:
        return
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"Invalid value in {name}: expected finite numbers, got NaN or inf")
    if nonnegative and bool((t < 0).any()):
        raise ValueError(
            f"Invalid value in {name}: expected non-negative numbers, got {float(t.min())}"
        )


def check_positive_int(name: str, v: object) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"Invalid value of {name}: expected a positive int, got {v!r}")
    return v


_NO_CONTEXT = nullcontext()
_cuda_get_device = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device


def cuda_device(t: torch.Tensor) -> AbstractContextManager:
    """A context that makes ``t``'s CUDA device the current one for the kernel launches inside
    it (Triton launches, events and stream queries use the current device); nothing to do for a
    CPU tensor or one already on the current device. (A CUDA tensor exists, so CUDA is
    initialised: the device is asked of torch's C API without ``torch.cuda``'s Python frames.)"""
    if t.is_cuda and t.get_device() != _cuda_get_device():
        return torch.cuda.device(t.device)
    return _NO_CONTEXT


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SEQ_LEN_DTYPES = (torch.int32, torch.int64)
"""Every op that takes ``seq_lens`` accepts both (the kernels load either and compute in int64)."""
HEAD_DIMS = (64, 128, 256)


def check_head_dim(name: str, d: int) -> None:
    """The attention kernels' tiles exist for these head dims only."""
    if d not in HEAD_DIMS:
        raise ValueError(f"Invalid head dim of {name}: expected one of {HEAD_DIMS}, got {d}")


def check_paged_batch(block_table: object, seq_lens: object, sizes: dict[str, int]) -> None:
    """A paged batch's ``block_table`` [B, max_pages] int32 and ``seq_lens`` [B] int32/int64,
    both with a unit last stride (the kernels index them as ``ptr + b * stride + page``)."""
    check_tensor("block_table", block_table, shape=("B", None), dtype=torch.int32, sizes=sizes,
                 unit_last=True)  # fmt: skip
    check_tensor("seq_lens", seq_lens, shape=("B",), dtype=SEQ_LEN_DTYPES, sizes=sizes,
                 unit_last=True)  # fmt: skip

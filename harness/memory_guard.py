"""Bounds checks for kernels run by Triton's CPU interpreter (``TRITON_INTERPRET=1``).

On a GPU a kernel that reads past the tensors it was given reads garbage (or stops with an
illegal memory access); the fuzzer sees the consequence as a wrong output. Under the
interpreter the same access dereferences a raw address inside the Python process: it
silently returns whatever lies there, or it segfaults the process and everything running in
it (a campaign's worker, a pytest-xdist worker), so the search never sees a finding at all.

``install()`` wraps the interpreter's launch and its memory operations: every load, store
and atomic checks its active addresses (mask true) against the storages of the tensors
passed to that launch, and raises :class:`OutOfBounds` instead of touching memory. The error
is raised inside the kernel's own frame, so its traceback names the kernel's file and the
line of the ``tl.load`` / ``tl.store``; the executor turns it into a ``bounds`` finding.

A tensor's whole storage counts as in bounds (a view may be read past its end into its base,
as on a GPU); a launch with a CUDA tensor argument (the interpreter copies those to the host)
is not checked.
"""
from __future__ import annotations

import bisect
import os

import numpy as np
import torch

__all__ = ["OutOfBounds", "install", "installed", "interpreting"]

_INSTALLED = False
# (starts, ends, names) of the launch running now; None outside a launch or when unchecked
_RANGES: list = [None]


class OutOfBounds(RuntimeError):
    """A kernel run by the interpreter touched memory outside every tensor of its launch."""


def interpreting() -> bool:
    """Whether Triton kernels run on its CPU interpreter in this process."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def installed() -> bool:
    return _INSTALLED


def _tensors(name, arg, out):
    if isinstance(arg, torch.Tensor):
        out.append((name, arg))
    elif isinstance(arg, (tuple, list)):
        for i, a in enumerate(arg):
            _tensors(f"{name}[{i}]", a, out)
    elif hasattr(arg, "base") and isinstance(getattr(arg, "base"), torch.Tensor):  # a tensor descriptor
        out.append((f"{name}.base", arg.base))


def _ranges(fn, args, kwargs):
    """Sorted storage ranges of a launch's tensor arguments; None when one is not on the CPU."""
    try:
        import inspect
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        names = []
    found: list = []
    for i, a in enumerate(args):
        _tensors(names[i] if i < len(names) else f"arg{i}", a, found)
    for k, v in kwargs.items():
        _tensors(k, v, found)
    spans = {}
    for name, t in found:
        if t.device.type != "cpu":
            return None
        s = t.untyped_storage()
        start = s.data_ptr()
        if s.nbytes() == 0:
            continue
        prev = spans.get(start)
        if prev is None or prev[0] < start + s.nbytes():
            spans[start] = (start + s.nbytes(), name if prev is None else f"{prev[1]}/{name}")
    starts = sorted(spans)
    return starts, [spans[s][0] for s in starts], [spans[s][1] for s in starts]


def _describe(addr: int, itemsize: int, ranges, op: str) -> str:
    starts, ends, names = ranges
    i = bisect.bisect_right(starts, addr) - 1
    where = []
    if i >= 0:
        where.append(f"{addr + itemsize - ends[i]} bytes past the end of '{names[i]}'" if addr >= ends[i]
                     else f"inside '{names[i]}' but running past its end")
    if i + 1 < len(starts):
        where.append(f"{starts[i + 1] - addr} bytes before the start of '{names[i + 1]}'")
    near = "; ".join(where) or "no tensor argument at all"
    return (f"out-of-bounds {op} at address {addr:#x}: outside every tensor passed to this kernel launch "
            f"({near}); on a GPU the same access reads garbage or faults. Mask this access, or check the index "
            f"that reaches it (a block-table entry, a length, a stride) for this batch")


def _check(ptrs: np.ndarray, mask, itemsize: int, op: str) -> None:
    ranges = _RANGES[-1]
    if ranges is None:
        return
    addrs = np.asarray(ptrs).reshape(-1)
    if mask is not None:
        m = np.broadcast_to(np.asarray(mask), np.asarray(ptrs).shape).reshape(-1)
        if not m.all():
            addrs = addrs[m]
    if addrs.size == 0:
        return
    starts, ends, _ = ranges
    lo, hi = int(addrs.min()), int(addrs.max())
    i = bisect.bisect_right(starts, lo) - 1
    if i >= 0 and hi + itemsize <= ends[i]:
        return  # the common case: one tensor holds every address
    s = np.asarray(starts, dtype=np.uint64)
    e = np.asarray(ends, dtype=np.uint64)
    idx = np.searchsorted(s, addrs, side="right").astype(np.int64) - 1
    ok = idx >= 0
    ok[ok] &= (addrs[ok] + np.uint64(itemsize)) <= e[idx[ok]]
    if not ok.all():
        raise OutOfBounds(_describe(int(addrs[~ok][0]), itemsize, ranges, op))


def install() -> None:
    """Check every interpreted memory access (module doc). Idempotent; call it after any other
    patch of ``GridExecutor.__call__`` (``mla_fuzz.kernels.interpreter_patches.install``), so
    that this wrapper is the outermost."""
    global _INSTALLED
    if _INSTALLED:
        return
    from triton.runtime import interpreter as _interp

    builder_cls = type(_interp.interpreter_builder)
    executor = _interp.GridExecutor
    launch = executor.__call__

    def call(self, *args, **kwargs):
        _RANGES.append(_ranges(self.fn, args, kwargs))
        try:
            return launch(self, *args, **kwargs)
        finally:
            _RANGES.pop()

    load, store = builder_cls.create_masked_load, builder_cls.create_masked_store
    rmw, cas = builder_cls.create_atomic_rmw, builder_cls.create_atomic_cas

    def masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        elem = _interp._get_np_dtype(ptrs.get_element_ty())
        _check(ptrs.data, mask.data, np.dtype(elem).itemsize, "load")
        return load(self, ptrs, mask, other, cache_policy, is_volatile)

    def masked_store(self, ptrs, value, mask, cache_policy):
        _check(ptrs.data, mask.data, np.dtype(value.data.dtype).itemsize, "store")
        return store(self, ptrs, value, mask, cache_policy)

    def atomic_rmw(self, rmwOp, ptr, val, mask, sem, scope):
        _check(ptr.data, mask.data, np.dtype(val.data.dtype).itemsize, "atomic")
        return rmw(self, rmwOp, ptr, val, mask, sem, scope)

    def atomic_cas(self, ptr, cmp, val, sem, scope):
        _check(ptr.data, None, np.dtype(val.data.dtype).itemsize, "atomic")
        return cas(self, ptr, cmp, val, sem, scope)

    # the launch underneath stays recognisable as ours (interpreter_patches' idempotence check)
    call._mla_fuzz = getattr(launch, "_mla_fuzz", False)
    call._mla_fuzz_bounds = True
    executor.__call__ = call
    builder_cls.create_masked_load = masked_load
    builder_cls.create_masked_store = masked_store
    builder_cls.create_atomic_rmw = atomic_rmw
    builder_cls.create_atomic_cas = atomic_cas
    _INSTALLED = True


def install_for_interpreter() -> None:
    """In a process that interprets Triton kernels: our interpreter speed-ups where this Triton
    is one they are written for, then the bounds checks. Nothing otherwise."""
    if not interpreting():
        return
    from mla_fuzz.kernels import interpreter_patches
    if not interpreter_patches.installed():
        try:
            interpreter_patches.install()
        except RuntimeError as exc:  # another Triton: the interpreter as shipped, slower, same results
            import warnings
            warnings.warn(f"mla-fuzz: Triton's CPU interpreter runs without our speed-ups ({exc})", RuntimeWarning,
                          stacklevel=2)
    install()

"""The ``emulated`` mode: CUDA-graph semantics on any device (CPU included).

Capture runs ``fn()`` under a ``TorchDispatchMode`` that records every dispatched op
touching the graph's device, with the *identity* of its tensor arguments (the tensor
objects plus a snapshot of their storage/offset/sizes/strides), its non-tensor arguments
and its outputs. Replay walks that record and re-executes it on the same tensors without
running any of ``fn``'s Python, so:

- in-place updates of captured inputs are seen; a Python name or attribute rebound to a
  fresh tensor after capture is not (the record holds the old tensor: a stale address);
- a planner skipped during capture (state already planned by warmup) is never run;
- outputs of non-mutating ops are copied back into the tensors they produced at capture,
  so every later recorded op (holding references to those tensors) sees the new values,
  and tensors allocated during capture keep their storage (``data_ptr``) for the graph's
  lifetime (the record keeps them alive, like a private pool);
- views made during capture are not re-made (they already alias their base);
- ``torch.library.custom_op`` ops are recorded as one op each; their implementation runs
  with recording off (PyTorch pops the mode while an op executes), but under a guard that
  still refuses host reads, so a kernel wrapper calling ``.item()`` fails like on a GPU;
- host reads (``.item()``, ``.tolist()``, ``.numpy()``, ``bool(t)``, ``torch.equal``,
  ``nonzero``/``torch.where(cond)``, boolean-mask indexing, ``unique``, ``masked_select``,
  ``bincount``, ``repeat_interleave`` without ``output_size``, device->host copies,
  host->device copies unless ``non_blocking`` from pinned memory) raise ``CaptureError``
  naming the op, like CUDA's "operation not permitted when stream is capturing". They are
  decided by op, not by device: on a CPU emulation the CPU *is* the device (so ``.cpu()``
  of a CPU tensor is a no-op and allowed). With ``device="cuda"``, ops touching only CPU
  tensors run at capture and are not recorded, and host reads of CPU tensors are allowed,
  as in a real capture (see ``opclass`` for the exact rules);
- everything else -- functional ops, in-place and ``out=`` ops (``copy_``, ``index_put_``,
  ``fill_``, ``scatter_``...), ``_foreach`` ops, random ops, allocations -- is handled by the
  generic rule of its replay class (``opclass``).

Differences from a real CUDA capture (documented, by design):

- capture EXECUTES the ops (a CUDA capture only records them, leaving outputs garbage until
  the first replay): ``graph.outputs`` hold real values right after capture. The fuzzer
  always replays before reading, so results agree. Writes into *pre-existing* device
  memory (captured inputs, persistent buffers, the KV cache) are rolled back when the
  capture ends, as a CUDA capture never performed them: a graph that does ``x.add_(1)``
  leaves ``x`` unchanged by capture and adds 1 per replay, on both;
- every tensor the graph touched stays alive until ``close()``; on CUDA a dropped captured
  input may be reused by the allocator (the ``cuda`` runner keeps those alive too, see
  ``oplog``), and intermediates of disjoint lifetime may share pool memory, so reads of
  *uninitialised* memory differ (use ``poison_empty`` to make them loud instead);
- random ops draw from PyTorch's generator again on each replay (fresh numbers each replay,
  as CUDA's philox offsets give), but not the same numbers as a CUDA replay would;
- Triton kernels launched from Python outside a custom op cannot be replayed: the capture
  raises ``CaptureError`` (see ``triton_guard``) rather than drop them silently;
- custom-op implementations re-run their Python on replay; they must be pure functions
  of their arguments (the ``custom_op`` contract), which is what a captured kernel is;
- a CPU-side effect of an op that also touches the device (a custom op writing a CPU
  tensor) is replayed, whereas CUDA would have done it once at capture;
- unsupported, raising ``CaptureError`` at capture: tensor subclasses, non-strided layouts
  (sparse, nested, mkldnn), nested captures, Triton launches outside an op;
- invisible (cannot be detected, so neither replayed nor rolled back): writes that bypass
  the dispatcher, e.g. through raw pointers (ctypes, DLPack, a numpy view of a CPU tensor).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, List, NamedTuple, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from . import triton_guard
from .base import CapturedGraph, GraphRunner, Outputs, check_outputs
from .errors import CaptureError, ReplayError, describe_chain
from .opclass import (ALLOC, EXEC, FUNCTION_HOST_READS, META, VIEW, OpInfo, arg, classify,
                      host_read_reason)

DevicePredicate = Callable[[Any], bool]


def device_predicate(device: Optional[torch.device]) -> DevicePredicate:
    """``is_dev(t)``: does ``t`` (anything with ``.device``) live on the graph's device?

    ``None`` means every device: the strictest reading, right for CPU-only emulation."""
    if device is None:
        return lambda t: True
    dtype = device.type
    return lambda t: t.device.type == dtype


def poison_(t: torch.Tensor) -> None:
    """Fill ``t`` in place the way PyTorch's deterministic mode fills uninitialised memory:
    NaN for floating/complex dtypes, the dtype's max for integers, True for bool."""
    if t.numel() == 0:
        return
    if t.is_floating_point() or t.is_complex():
        try:
            t.fill_(float("nan"))
        except RuntimeError:  # an fp8 dtype without a fill kernel here: 0xFF is NaN in e4m3/e5m2
            t.view(torch.uint8).fill_(0xFF)
    elif t.dtype is torch.bool:
        t.fill_(True)
    else:
        t.fill_(torch.iinfo(t.dtype).max)


class _Ref:
    """A recorded tensor: its storage and its layout at record time (and, for arguments,
    the tensor object itself).

    ``resolve()`` returns the object while its layout is unchanged, else an alias with the
    recorded layout on the recorded storage: a graph keeps the address it captured even if
    Python later calls ``set_``/``resize_``/``t_`` on the tensor object.

    Op *outputs* are referenced through storage only (``keep_object=False``): holding a
    strong reference to the tensor a factory op (``empty``, ``zeros``) returns makes
    PyTorch's Python binding hand the caller a ``detach()``-ed alias instead of it, which
    would add a spurious ``aten::detach`` to ``graph.ops``. An alias on the same storage
    reads and writes the same memory, which is all a graph needs."""

    __slots__ = ("t", "storage", "ptr", "size", "stride", "offset", "dtype", "device", "alias")

    def __init__(self, t: torch.Tensor, keep_object: bool = True):
        self.t = t if keep_object else None
        self.storage = t.untyped_storage()
        self.ptr = t.data_ptr()
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()
        self.dtype = t.dtype
        self.device = t.device
        self.alias: Optional[torch.Tensor] = None

    def resolve(self) -> torch.Tensor:
        t = self.t
        if (t is not None and t.dtype == self.dtype and t.data_ptr() == self.ptr
                and t.size() == self.size and t.stride() == self.stride):
            return t
        if self.alias is None:
            a = torch.empty(0, dtype=self.dtype, device=self.device)
            a.set_(self.storage, self.offset, self.size, self.stride)
            self.alias = a
        return self.alias


class RecordedOp(NamedTuple):
    """One recorded op, for inspection: ``name`` ("aten::mm"), ``overload`` ("default"),
    ``kind`` (``opclass.VIEW | META | ALLOC | EXEC``)."""

    name: str
    overload: str
    kind: str


class _Op:
    __slots__ = ("func", "info", "leaves", "spec", "writeback", "allocs")

    def __init__(self, func, info: OpInfo):
        self.func = func
        self.info = info
        self.leaves: Optional[list] = None
        self.spec = None
        self.writeback: List[tuple] = []   # (output leaf index, _Ref)
        self.allocs: List[_Ref] = []       # ALLOC outputs, for poison refills


class _HostReadFunctionGuard(TorchFunctionMode):
    """Catches host reads that never reach the dispatcher (``Tensor.tolist`` etc.)."""

    def __init__(self, is_dev: DevicePredicate):
        super().__init__()
        self.is_dev = is_dev

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", None)
        if (name in FUNCTION_HOST_READS and args and isinstance(args[0], torch.Tensor)
                and self.is_dev(args[0])):
            raise CaptureError(f"operation not permitted when stream is capturing (emulated): "
                               f"Tensor.{name}: {FUNCTION_HOST_READS[name]}")
        return func(*args, **(kwargs or {}))


_AFTER_PYTHON_KEY = torch._C._dispatch_keyset_full_after(torch._C.DispatchKey.Python)


def run_impl_guarded(func, args: tuple, kwargs: dict, is_dev: DevicePredicate, check: bool,
                     poison: bool) -> Any:
    """Run a non-builtin op (a ``torch.library`` custom op) with its implementation watched
    by an ``_InnerGuard`` (and, when ``check``, a ``_HostReadFunctionGuard``).

    A dispatch mode is popped while its handler runs, and pushing a new mode then calling
    ``func`` would hand ``func`` itself to the new mode (endless recursion). Redispatching
    to the keys below ``Python`` runs the implementation directly, with the guard active
    for the ops *it* dispatches."""
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    if not tensors:  # nothing to route the redispatch by; run it unguarded
        return func(*args, **kwargs)
    keys = torch._C._dispatch_keys(tensors[0])
    for t in tensors[1:]:
        keys = keys | torch._C._dispatch_keys(t)
    with contextlib.ExitStack() as stack:
        if check:
            stack.enter_context(_HostReadFunctionGuard(is_dev))
        stack.enter_context(_InnerGuard(is_dev, check, poison))
        return func.redispatch(keys & _AFTER_PYTHON_KEY, *args, **kwargs)


class _InnerGuard(TorchDispatchMode):
    """Active while a custom op's Python implementation runs (at capture, and at replay
    when poisoning): checks host reads and poisons allocations, records nothing."""

    def __init__(self, is_dev: DevicePredicate, check: bool, poison: bool):
        super().__init__()
        self.is_dev = is_dev
        self.check = check
        self.poison = poison

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        info = classify(func)
        if self.check:
            reason = host_read_reason(func, info, args, kwargs, self.is_dev)
            if reason:
                raise _host_read_error(info, reason, inside_custom_op=True)
        if info.builtin:
            out = func(*args, **kwargs)
        else:  # a custom op calling another custom op: guard that one's implementation too
            out = run_impl_guarded(func, args, kwargs, self.is_dev, self.check, self.poison)
        if self.poison and info.kind == ALLOC:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and self.is_dev(t):
                    poison_(t)
        return out


def _host_read_error(info: OpInfo, reason: str, inside_custom_op: bool = False) -> CaptureError:
    where = " (inside a custom op's implementation)" if inside_custom_op else ""
    return CaptureError(f"operation not permitted when stream is capturing (emulated): "
                        f"{info.name}{where} {reason}")


def _check_supported(t: torch.Tensor, info: OpInfo) -> None:
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        raise CaptureError(f"emulated capture does not support tensor subclass "
                           f"{type(t).__name__} (argument of {info.name})")
    if t.layout is not torch.strided or t.is_nested:
        raise CaptureError(f"emulated capture supports strided tensors only; {info.name} got "
                           f"layout {t.layout}")


def _written_tensors(func, args: tuple, kwargs: dict) -> List[torch.Tensor]:
    """The tensors a call writes, per its schema's ``(a!)`` annotations."""
    found = []
    for name in _written_arg_names(func):
        v = arg(func, args, kwargs, name)
        if isinstance(v, torch.Tensor):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            found.extend(t for t in v if isinstance(t, torch.Tensor))
    return found


@functools.lru_cache(maxsize=None)
def _written_arg_names(func) -> tuple:
    return tuple(a.name for a in func._schema.arguments
                 if a.alias_info is not None and a.alias_info.is_write)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _Recorder(TorchDispatchMode):
    """The capture-time dispatch mode: executes each op, checks it, records it.

    Before an op first writes a device storage that existed before the capture, a copy of
    that storage is saved; ``rollback()`` restores them all when the capture ends."""

    def __init__(self, is_dev: DevicePredicate, bake_host_scalars: bool, poison: bool):
        super().__init__()
        self.is_dev = is_dev
        self.bake_host_scalars = bake_host_scalars
        self.poison = poison
        self.ops: List[_Op] = []
        self.recorded: List[RecordedOp] = []
        self._fresh: set = set()      # storage keys allocated during the capture
        self._saved: dict = {}        # storage key -> (storage, saved copy)

    def _save_before_write(self, func, args, kwargs) -> None:
        for t in _written_tensors(func, args, kwargs):
            if not self.is_dev(t) or t.layout is not torch.strided:
                continue
            key = _storage_key(t)
            if key in self._fresh or key in self._saved:
                continue
            st = t.untyped_storage()
            self._saved[key] = (st, st.clone())

    def rollback(self) -> None:
        """Restore every pre-existing device storage the capture wrote."""
        for st, saved in self._saved.values():
            if st.nbytes() == saved.nbytes():
                st.copy_(saved)
            else:  # resized in place by a custom op: restore the bytes that existed before
                n = min(st.nbytes(), saved.nbytes())
                dst = torch.empty(0, dtype=torch.uint8, device=saved.device).set_(st)
                src = torch.empty(0, dtype=torch.uint8, device=saved.device).set_(saved)
                dst[:n].copy_(src[:n])
        self._saved.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        info = classify(func)
        flat, spec = tree_flatten((args, kwargs))
        ins = [x for x in flat if isinstance(x, torch.Tensor)]
        for t in ins:
            if self.is_dev(t):
                _check_supported(t, info)
        reason = host_read_reason(func, info, args, kwargs, self.is_dev)
        if reason:
            raise _host_read_error(info, reason)

        if info.mutable and info.kind != META:  # META ops change layout, not bytes
            self._save_before_write(func, args, kwargs)
        with triton_guard.inside_op():
            if info.builtin:
                out = func(*args, **kwargs)
            else:
                out = run_impl_guarded(func, args, kwargs, self.is_dev, True, self.poison)

        outs = tree_leaves(out)
        out_tensors = [t for t in outs if isinstance(t, torch.Tensor)]
        if not (any(self.is_dev(t) for t in ins) or any(self.is_dev(t) for t in out_tensors)):
            return out  # host-only work: a CUDA capture does not record it either
        for t in ins + out_tensors:
            _check_supported(t, info)
        self._record(func, info, flat, spec, ins, outs)
        return out

    def _record(self, func, info: OpInfo, flat, spec, ins, outs) -> None:
        kind = info.kind
        op = _Op(func, info)
        if kind == ALLOC:
            for t in outs:
                if isinstance(t, torch.Tensor) and self.is_dev(t):
                    if self.poison:
                        poison_(t)
                    op.allocs.append(_Ref(t, keep_object=False))
                    self._fresh.add(_storage_key(t))
        elif kind == EXEC:
            for i, t in enumerate(outs):
                if isinstance(t, torch.Tensor) and not any(torch._C._is_alias_of(t, x) for x in ins):
                    op.writeback.append((i, _Ref(t, keep_object=False)))
                    self._fresh.add(_storage_key(t))
            aliases_only = not op.writeback and any(isinstance(t, torch.Tensor) for t in outs)
            if aliases_only and not info.mutable:
                # e.g. _unsafe_view: a view in all but schema; re-running it changes nothing.
                kind = VIEW
            else:
                # Snapshots are taken after the op ran: an out= argument it resized must
                # be replayed with the layout it ended with.
                op.leaves = [self._leaf(x) for x in flat]
                op.spec = spec
        self.recorded.append(RecordedOp(info.name, func._overloadname, kind))
        if kind in (ALLOC, EXEC):
            self.ops.append(op)

    def _leaf(self, x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if self.bake_host_scalars and not self.is_dev(x) and x.dim() == 0 and x.device.type == "cpu":
            # A CPU scalar argument of a device kernel is passed by value at capture.
            return x.clone()
        return _Ref(x)


class EmulatedGraph(CapturedGraph):
    """A recorded op list replayed on the captured tensor objects; see the module docstring.

    Extra attribute ``recorded``: list of ``RecordedOp`` (every recorded op with its replay
    class; ``ops`` is their names)."""

    mode = "emulated"

    def __init__(self, outputs: Outputs, recorder: _Recorder, inference: bool,
                 is_dev: DevicePredicate, poison: bool):
        super().__init__(outputs, [r.name for r in recorder.recorded])
        self.recorded = recorder.recorded
        self._ops = recorder.ops
        self._inference = inference
        self._is_dev = is_dev
        self._poison = poison

    def _replay(self) -> None:
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.inference_mode(self._inference))
            stack.enter_context(torch.no_grad())
            for op in self._ops:
                self._run(op)

    def _run(self, op: _Op) -> None:
        if op.info.kind == ALLOC:
            if self._poison:
                for ref in op.allocs:
                    poison_(ref.resolve())
            return
        vals = [x.resolve() if type(x) is _Ref else x for x in op.leaves]
        args, kwargs = tree_unflatten(vals, op.spec)
        try:
            if self._poison and not op.info.builtin:
                out = run_impl_guarded(op.func, args, kwargs, self._is_dev, False, True)
            else:
                out = op.func(*args, **kwargs)
            if op.writeback:
                leaves = tree_leaves(out)
                for i, ref in op.writeback:
                    dst, src = ref.resolve(), leaves[i]
                    if dst.shape != src.shape or dst.dtype != src.dtype:
                        # copy_ would broadcast/cast silently; a graph's buffers never change.
                        raise ReplayError(f"output {i} is {tuple(src.shape)} {src.dtype} on replay "
                                          f"but was {tuple(dst.shape)} {dst.dtype} at capture")
                    dst.copy_(src)
        except Exception as e:
            raise ReplayError(f"emulated replay of {op.info.name} failed: {describe_chain(e)}") from e

    def _release(self) -> None:
        self._ops = []
        self.recorded = []


class EmulatedRunner(GraphRunner):
    """Emulated CUDA graphs (see module docstring).

    ``device``: the graph's device; tensors elsewhere are host memory (ops only on them
    run at capture and are not recorded, host reads of them are allowed). ``None`` (the
    default) counts every tensor as device memory: right for a CPU-only emulation; pass
    ``device="cuda"`` when emulating beside real CUDA tensors with CPU-side helpers.
    ``poison_empty``: fill ``empty``-family allocations made during capture (including
    inside custom ops) with NaN / integer-max, at capture and again at every replay, as
    PyTorch's deterministic mode does inside a CUDA graph.
    """

    mode = "emulated"

    def __init__(self, device: Optional[torch.device] = None, *, poison_empty: bool = False):
        super().__init__(device)
        self.poison_empty = bool(poison_empty)
        self._is_dev = device_predicate(device)

    def capture(self, fn: Callable[[], Outputs]) -> EmulatedGraph:
        """Run ``fn()`` once under the recorder; return the graph. ``graph.outputs`` hold
        real values (capture executes), but callers should replay before reading, as on a
        GPU. Raises ``CaptureError`` (cause chained) on a host read, an unsupported op or
        tensor, or any exception from ``fn``."""
        if triton_guard.in_capture():
            raise CaptureError("nested graph capture: an emulated capture is already active "
                               "on this thread")
        recorder = _Recorder(self._is_dev, bake_host_scalars=self.device is not None
                             and self.device.type != "cpu", poison=self.poison_empty)
        inference = torch.is_inference_mode_enabled()
        try:
            with triton_guard.capture_scope(), _HostReadFunctionGuard(self._is_dev), recorder:
                raw = fn()
        except CaptureError:
            raise
        except Exception as e:
            raise CaptureError(f"emulated graph capture failed: {describe_chain(e)}") from e
        finally:
            recorder.rollback()
        return EmulatedGraph(check_outputs(raw), recorder, inference, self._is_dev,
                             self.poison_empty)
